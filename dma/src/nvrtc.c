/* nvrtc.c - the copy kernel (copy_kernel.c) compiled to PTX by NVRTC, found
 * at run time: no CUDA toolkit where kvtier is built, and the PTX made for
 * the device it runs on.
 *
 * Which NVRTC.  $KVTIER_NVRTC_LIBRARY when set (then it must load); else an
 * NVRTC already in the process (an engine's torch loads the one its wheel
 * ships, nvidia-cuda-nvrtc, outside the loader's path: found by soname with
 * RTLD_NOLOAD), else one the loader finds (libnvrtc.so.13, .12, .11.2).
 * None: the caller copies by DMA only and says so.  NVRTC loads its
 * builtins (libnvrtc-builtins.so.M.m) by soname at compile time, which
 * fails where its folder is not on the loader's path (a wheel's): the one
 * beside it is loaded first, by its full path, and then found.
 *
 * Which target.  compute_<major><minor> of the device, or the highest
 * NVRTC supports below it (PTX is compiled forward by the driver).  A
 * driver older than the NVRTC rejects its PTX at load
 * (CUDA_ERROR_UNSUPPORTED_PTX_VERSION): the caller's problem, also DMA only.
 *
 * The prototypes are NVRTC's documented C API (stable since CUDA 11.2);
 * nvrtc.h is not needed to build.
 */
#include "dma_int.h"

#include <dlfcn.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef int nvrtc_result;
typedef struct nvrtc_prog *nvrtc_prog;

struct nvrtc_fns {
	nvrtc_result (*version)(int *, int *);
	nvrtc_result (*n_archs)(int *);
	nvrtc_result (*archs)(int *);
	nvrtc_result (*create)(nvrtc_prog *, const char *, const char *, int,
			       const char *const *, const char *const *);
	nvrtc_result (*compile)(nvrtc_prog, int, const char *const *);
	nvrtc_result (*ptx_size)(nvrtc_prog, size_t *);
	nvrtc_result (*ptx)(nvrtc_prog, char *);
	nvrtc_result (*log_size)(nvrtc_prog, size_t *);
	nvrtc_result (*log)(nvrtc_prog, char *);
	nvrtc_result (*destroy)(nvrtc_prog *);
	const char *(*err)(nvrtc_result);
};

static void *open_nvrtc(char *why, size_t why_len)
{
	static const char *const names[] = { "libnvrtc.so.13", "libnvrtc.so.12",
					     "libnvrtc.so.11.2" };
	const char *path = getenv("KVTIER_NVRTC_LIBRARY");
	void *h;

	if (path && *path) {
		h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
		if (!h)
			kvt__fmt(-ENOENT, why, why_len, "KVTIER_NVRTC_LIBRARY=%s: %s", path,
				 dlerror());
		return h;
	}
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if ((h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL | RTLD_NOLOAD)))
			return h;
	for (size_t i = 0; i < sizeof(names) / sizeof(names[0]); i++)
		if ((h = dlopen(names[i], RTLD_NOW | RTLD_LOCAL)))
			return h;
	kvt__fmt(-ENOENT, why, why_len, "no NVRTC (libnvrtc.so.13/.12 neither loaded nor "
		 "found; KVTIER_NVRTC_LIBRARY names one)");
	return NULL;
}

/* libnvrtc-builtins.so.M.m from the folder of the NVRTC that holds sym, if
 * there (left loaded, as NVRTC is) */
static void preload_builtins(void *sym, int major, int minor)
{
	char path[4096];
	const char *slash;
	Dl_info info;

	if (!dladdr(sym, &info) || !info.dli_fname || !(slash = strrchr(info.dli_fname, '/')))
		return;
	if (snprintf(path, sizeof(path), "%.*s/libnvrtc-builtins.so.%d.%d",
		     (int)(slash - info.dli_fname), info.dli_fname, major, minor) >=
	    (int)sizeof(path))
		return;
	dlopen(path, RTLD_NOW | RTLD_LOCAL);
}

int kvt__nvrtc_ptx(int cc, char **ptx_out, char *what, size_t what_len)
{
	struct nvrtc_fns f;
	nvrtc_prog prog = NULL;
	int major = 0, minor = 0, n = 0, arch = 0, *archs = NULL;
	char opt[64], *ptx = NULL, *log = NULL;
	const char *opts[1] = { opt };
	size_t sz = 0;
	nvrtc_result r;
	void *h;
	int rc;

	*ptx_out = NULL;
	h = open_nvrtc(what, what_len);
	if (!h)
		return -ENOENT;
	*(void **)&f.version = dlsym(h, "nvrtcVersion");
	*(void **)&f.n_archs = dlsym(h, "nvrtcGetNumSupportedArchs");
	*(void **)&f.archs = dlsym(h, "nvrtcGetSupportedArchs");
	*(void **)&f.create = dlsym(h, "nvrtcCreateProgram");
	*(void **)&f.compile = dlsym(h, "nvrtcCompileProgram");
	*(void **)&f.ptx_size = dlsym(h, "nvrtcGetPTXSize");
	*(void **)&f.ptx = dlsym(h, "nvrtcGetPTX");
	*(void **)&f.log_size = dlsym(h, "nvrtcGetProgramLogSize");
	*(void **)&f.log = dlsym(h, "nvrtcGetProgramLog");
	*(void **)&f.destroy = dlsym(h, "nvrtcDestroyProgram");
	*(void **)&f.err = dlsym(h, "nvrtcGetErrorString");
	if (!f.version || !f.n_archs || !f.archs || !f.create || !f.compile || !f.ptx_size ||
	    !f.ptx || !f.log_size || !f.log || !f.destroy || !f.err)
		return kvt__fmt(-ENOENT, what, what_len, "NVRTC older than CUDA 11.2 (no "
				"nvrtcGetSupportedArchs)");
	f.version(&major, &minor);
	preload_builtins((void *)f.version, major, minor);
	/* the device's target, or the highest below it that NVRTC knows */
	if (f.n_archs(&n) || n <= 0 || !(archs = calloc((size_t)n, sizeof(int))) ||
	    f.archs(archs)) {
		free(archs);
		return kvt__fmt(-EIO, what, what_len, "NVRTC %d.%d: no supported targets",
				major, minor);
	}
	for (int i = 0; i < n; i++)
		if (archs[i] <= cc && archs[i] > arch)
			arch = archs[i];
	free(archs);
	if (!arch)
		return kvt__fmt(-ENOTSUP, what, what_len, "NVRTC %d.%d targets nothing at or "
				"below compute_%d", major, minor, cc);
	snprintf(opt, sizeof(opt), "--gpu-architecture=compute_%d", arch);
	r = f.create(&prog, kvt__copy_kernel_src, "kvtier_copy_kernel.cu", 0, NULL, NULL);
	if (r)
		return kvt__fmt(-EIO, what, what_len, "nvrtcCreateProgram: %s", f.err(r));
	r = f.compile(prog, 1, opts);
	if (r) {
		if (!f.log_size(prog, &sz) && sz && (log = malloc(sz)) && !f.log(prog, log)) {
			/* its first line names the error */
			char *nl = strchr(log, '\n');

			if (nl)
				*nl = 0;
		}
		rc = kvt__fmt(-EIO, what, what_len, "NVRTC %d.%d, %s: %s%s%s", major, minor, opt,
			      f.err(r), log ? ": " : "", log ? log : "");
		free(log);
		f.destroy(&prog);
		return rc;
	}
	if (f.ptx_size(prog, &sz) || !sz || !(ptx = malloc(sz)) || f.ptx(prog, ptx)) {
		free(ptx);
		f.destroy(&prog);
		return kvt__fmt(-EIO, what, what_len, "NVRTC %d.%d: no PTX", major, minor);
	}
	f.destroy(&prog);
	*ptx_out = ptx;
	return kvt__fmt(0, what, what_len, "NVRTC %d.%d, compute_%d", major, minor, arch);
}
