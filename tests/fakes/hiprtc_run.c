/* hiprtc_run.c - the real hiprtc, for relay_hiprtc.c: compiles the HIP
 * source on stdin with the options given as arguments; the code object on
 * stdout, hiprtc's log on stderr.  Exit 0 compiled, 1 not compiled, 2 no
 * real hiprtc here.  Run in a process of its own, away from the fake
 * runtimes, so that Debian's hiprtc (inside its real libamdhip64.so.5)
 * loads with the real libhsa-runtime64 it needs; it compiles without a GPU.
 *
 * Which hiprtc: $KVT_REAL_HIPRTC, else ROCm 6/7's libhiprtc, else the one
 * in ROCm 5's libamdhip64.
 */
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int main(int argc, char **argv)
{
	static const char *const names[] = { "libhiprtc.so.7", "libhiprtc.so.6",
					     "libamdhip64.so.5" };
	const char *want = getenv("KVT_REAL_HIPRTC");
	int (*create)(void **, const char *, const char *, int, const char **, const char **);
	int (*compile)(void *, int, const char **);
	int (*code_size)(void *, size_t *), (*code)(void *, char *);
	int (*log_size)(void *, size_t *), (*log)(void *, char *);
	size_t cap = 1 << 16, len = 0, n = 0;
	char *src = malloc(cap), *buf;
	void *h = NULL, *prog = NULL;
	int r;

	if (want && *want)
		h = dlopen(want, RTLD_NOW | RTLD_LOCAL);
	for (size_t i = 0; !h && !(want && *want) && i < sizeof(names) / sizeof(names[0]); i++)
		h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL);
	if (!h) {
		fprintf(stderr, "hiprtc_run: no real hiprtc (libhiprtc.so.7/.6, libamdhip64.so.5; "
			"Debian's libamdhip64-dev installs one): %s\n", dlerror());
		return 2;
	}
	*(void **)&create = dlsym(h, "hiprtcCreateProgram");
	*(void **)&compile = dlsym(h, "hiprtcCompileProgram");
	*(void **)&code_size = dlsym(h, "hiprtcGetCodeSize");
	*(void **)&code = dlsym(h, "hiprtcGetCode");
	*(void **)&log_size = dlsym(h, "hiprtcGetProgramLogSize");
	*(void **)&log = dlsym(h, "hiprtcGetProgramLog");
	if (!create || !compile || !code_size || !code || !log_size || !log || !src) {
		fprintf(stderr, "hiprtc_run: the library has no hiprtc API\n");
		return 2;
	}
	while ((n = fread(src + len, 1, cap - len - 1, stdin)) > 0) {
		len += n;
		if (len + 1 == cap && !(src = realloc(src, cap *= 2)))
			return 2;
	}
	src[len] = 0;
	if (create(&prog, src, "kvtier_copy_kernel.hip", 0, NULL, NULL))
		return 1;
	r = compile(prog, argc - 1, (const char **)argv + 1);
	if (!log_size(prog, &n) && n > 1 && (buf = malloc(n)) && !log(prog, buf)) {
		fwrite(buf, 1, strnlen(buf, n), stderr);
		free(buf);
	}
	if (r)
		return 1;
	if (code_size(prog, &n) || !n || !(buf = malloc(n)) || code(prog, buf))
		return 1;
	fwrite(buf, 1, n, stdout);
	fflush(stdout);
	/* quickly, and without the runtime's teardown: nothing here to keep */
	_exit(0);
}
