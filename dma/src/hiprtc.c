/* hiprtc.c - the copy kernel (copy_kernel.c) compiled by HIP's run-time
 * compiler, found at run time: a code object for the AMD GPU it runs on,
 * made from the node's ROCm.  Nothing is compiled where kvtier is built:
 * Debian's ROCm 5.2 toolchain predates the MI300/MI355 targets (gfx942,
 * gfx950), so a code object made there would not load on them.
 *
 * Which hiprtc.  $KVTIER_HIPRTC_LIBRARY when set (then it must load, and
 * is taken as it is); else a libhiprtc already in the process, the HIP
 * runtime's own major first (libhiprtc.so.7, .6: ROCm 6 moved hiprtc out
 * of libamdhip64); else the HIP runtime itself (ROCm 5's libamdhip64
 * carries hiprtc); else one the loader finds.  None: the caller copies by
 * DMA only and says so.  Its builtins library (libhiprtc-builtins) is
 * loaded from its folder first, where there is one, for a hiprtc outside
 * the loader's path (a wheel's).
 *
 * Which target.  The agent's ISA name without its triple: the full target
 * ID (gfx942:sramecc+:xnack-), so the code object matches the device's
 * mode.  A hiprtc that does not know the processor may crash rather than
 * fail (ROCm 5.2's, given gfx942, frees a bad pointer): a processor newer
 * than the HIP runtime's release (gfx94x before ROCm 6.0, gfx950 before
 * 7.0) is not given to it -- DMA only, saying why -- unless the operator
 * named the hiprtc.
 *
 * One compile per target and process: the code object is kept (a process
 * opens a DMA handle per rank registration; compiling takes about a
 * second).  The prototypes are hiprtc's C API (stable since ROCm 4.2);
 * hiprtc.h is not needed to build.
 */
#include "dma_int.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int hiprtc_result;
typedef struct hiprtc_prog *hiprtc_prog;

struct hiprtc_fns {
	hiprtc_result (*create)(hiprtc_prog *, const char *, const char *, int,
				const char *const *, const char *const *);
	hiprtc_result (*compile)(hiprtc_prog, int, const char *const *);
	hiprtc_result (*code_size)(hiprtc_prog, size_t *);
	hiprtc_result (*code)(hiprtc_prog, char *);
	hiprtc_result (*log_size)(hiprtc_prog, size_t *);
	hiprtc_result (*log)(hiprtc_prog, char *);
	hiprtc_result (*destroy)(hiprtc_prog *);
	const char *(*err)(hiprtc_result);
};

#define CACHED 8
static pthread_mutex_t cache_mu = PTHREAD_MUTEX_INITIALIZER;
static struct {
	char target[96];
	char *code;
	size_t len;
	char what[160];
} cache[CACHED];
static int n_cached;

/* The oldest ROCm whose compiler knows a processor (by prefix). */
static const struct {
	const char *proc;
	int major, minor;
} newer[] = {
	{ "gfx940", 6, 0 }, { "gfx941", 6, 0 }, { "gfx942", 6, 0 }, /* MI300 */
	{ "gfx950", 7, 0 },                                           /* MI350/MI355 */
};

static int has_hiprtc(void *h)
{
	return h && dlsym(h, "hiprtcCompileProgram");
}

static void *open_hiprtc(void *hip_lib, int hip_major, char *why, size_t why_len)
{
	const char *path = getenv("KVTIER_HIPRTC_LIBRARY");
	char names[3][32];
	int n = 0;
	void *h;

	if (path && *path) {
		h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
		if (!h)
			kvt__fmt(-ENOENT, why, why_len, "KVTIER_HIPRTC_LIBRARY=%s: %s", path,
				 dlerror());
		else if (!has_hiprtc(h))
			kvt__fmt(-ENOENT, why, why_len, "KVTIER_HIPRTC_LIBRARY=%s has no "
				 "hiprtcCompileProgram", path);
		return has_hiprtc(h) ? h : NULL;
	}
	if (hip_major >= 6)
		snprintf(names[n++], sizeof(names[0]), "libhiprtc.so.%d", hip_major);
	if (hip_major != 7)
		snprintf(names[n++], sizeof(names[0]), "libhiprtc.so.7");
	if (hip_major != 6)
		snprintf(names[n++], sizeof(names[0]), "libhiprtc.so.6");
	for (int i = 0; i < n; i++)
		if ((h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)) && has_hiprtc(h))
			return h;
	if (has_hiprtc(hip_lib))
		return hip_lib;
	for (int i = 0; i < n; i++)
		if ((h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL)) && has_hiprtc(h))
			return h;
	kvt__fmt(-ENOENT, why, why_len, "no hiprtc (libhiprtc.so.7/.6 neither loaded nor found, "
		 "none in the HIP runtime; KVTIER_HIPRTC_LIBRARY names one)");
	return NULL;
}

/* libhiprtc-builtins from the folder of the library that holds sym */
static void preload_builtins(void *sym)
{
	char path[4096];
	const char *slash;
	Dl_info info;

	if (!dladdr(sym, &info) || !info.dli_fname || !(slash = strrchr(info.dli_fname, '/')))
		return;
	for (int major = 7; major >= 5; major--)
		if (snprintf(path, sizeof(path), "%.*s/libhiprtc-builtins.so.%d",
			     (int)(slash - info.dli_fname), info.dli_fname, major) <
		    (int)sizeof(path) && dlopen(path, RTLD_NOW | RTLD_LOCAL))
			return;
}

static int compile(void *h, const char *target, char **code_out, size_t *len_out, char *what,
		   size_t what_len)
{
	struct hiprtc_fns f;
	hiprtc_prog prog = NULL;
	char arch[128], *code = NULL, *log = NULL;
	const char *opts[2] = { arch, "-O3" };
	size_t sz = 0;
	hiprtc_result r;
	int rc;

	*(void **)&f.create = dlsym(h, "hiprtcCreateProgram");
	*(void **)&f.compile = dlsym(h, "hiprtcCompileProgram");
	*(void **)&f.code_size = dlsym(h, "hiprtcGetCodeSize");
	*(void **)&f.code = dlsym(h, "hiprtcGetCode");
	*(void **)&f.log_size = dlsym(h, "hiprtcGetProgramLogSize");
	*(void **)&f.log = dlsym(h, "hiprtcGetProgramLog");
	*(void **)&f.destroy = dlsym(h, "hiprtcDestroyProgram");
	*(void **)&f.err = dlsym(h, "hiprtcGetErrorString");
	if (!f.create || !f.compile || !f.code_size || !f.code || !f.log_size || !f.log ||
	    !f.destroy || !f.err)
		return kvt__fmt(-ENOENT, what, what_len, "the hiprtc found lacks its C API");
	preload_builtins((void *)f.compile);
	snprintf(arch, sizeof(arch), "--offload-arch=%s", target);
	r = f.create(&prog, kvt__copy_kernel_src, "kvtier_copy_kernel.hip", 0, NULL, NULL);
	if (r)
		return kvt__fmt(-EIO, what, what_len, "hiprtcCreateProgram: %s", f.err(r));
	r = f.compile(prog, 2, opts);
	if (r) {
		if (!f.log_size(prog, &sz) && sz && (log = malloc(sz + 1)) && !f.log(prog, log)) {
			/* its first error line names it */
			char *e = strstr(log, "error");
			char *nl;

			log[sz] = 0;
			if (e)
				memmove(log, e, strlen(e) + 1);
			if ((nl = strchr(log, '\n')))
				*nl = 0;
		}
		rc = kvt__fmt(-EIO, what, what_len, "hiprtc, %s: %s%s%s", arch, f.err(r),
			      log && *log ? ": " : "", log ? log : "");
		free(log);
		f.destroy(&prog);
		return rc;
	}
	if (f.code_size(prog, &sz) || !sz || !(code = malloc(sz)) || f.code(prog, code)) {
		free(code);
		f.destroy(&prog);
		return kvt__fmt(-EIO, what, what_len, "hiprtc, %s: no code object", arch);
	}
	f.destroy(&prog);
	*code_out = code;
	*len_out = sz;
	return kvt__fmt(0, what, what_len, "hiprtc, %s", target);
}

int kvt__hiprtc_code(const char *target, int hip_version, void *hip_lib, const char **code,
		     size_t *len, char *what, size_t what_len)
{
	int hip_major = hip_version / 10000000, hip_minor = hip_version / 100000 % 100;
	int named, rc = 0;
	char *c = NULL;
	size_t n = 0;
	void *h;

	*code = NULL;
	*len = 0;
	pthread_mutex_lock(&cache_mu);
	for (int i = 0; i < n_cached; i++)
		if (!strcmp(cache[i].target, target)) {
			*code = cache[i].code;
			*len = cache[i].len;
			snprintf(what, what_len, "%s", cache[i].what);
			pthread_mutex_unlock(&cache_mu);
			return 0;
		}
	named = getenv("KVTIER_HIPRTC_LIBRARY") && *getenv("KVTIER_HIPRTC_LIBRARY");
	for (size_t i = 0; !named && hip_version > 0 && i < sizeof(newer) / sizeof(newer[0]); i++)
		if (!strncmp(target, newer[i].proc, strlen(newer[i].proc)) &&
		    (hip_major < newer[i].major ||
		     (hip_major == newer[i].major && hip_minor < newer[i].minor))) {
			pthread_mutex_unlock(&cache_mu);
			return kvt__fmt(-ENOTSUP, what, what_len, "the HIP runtime is ROCm %d.%d, "
					"whose hiprtc predates %s (ROCm %d.%d+; "
					"KVTIER_HIPRTC_LIBRARY names a newer one)", hip_major,
					hip_minor, newer[i].proc, newer[i].major, newer[i].minor);
		}
	h = open_hiprtc(hip_lib, hip_major, what, what_len);
	if (!h) {
		pthread_mutex_unlock(&cache_mu);
		return -ENOENT;
	}
	rc = compile(h, target, &c, &n, what, what_len);
	if (!rc && n_cached < CACHED) {
		snprintf(cache[n_cached].target, sizeof(cache[0].target), "%s", target);
		snprintf(cache[n_cached].what, sizeof(cache[0].what), "%s", what);
		cache[n_cached].code = c;
		cache[n_cached].len = n;
		n_cached++;
	} else if (!rc) {
		free(c); /* more targets than slots: compiled again next time */
		c = NULL;
		rc = kvt__fmt(-ENOSPC, what, what_len, "more than %d GPU targets in one process",
			      CACHED);
	}
	pthread_mutex_unlock(&cache_mu);
	if (!rc) {
		*code = c;
		*len = n;
	}
	return rc;
}
