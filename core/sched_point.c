/* sched_point.c - names of the schedule points (kvt_sp.h), and, in a
 * KVT_SCHEDULE_POINTS build, the hook that tests install.  The hook is
 * process-wide test state; release builds have none. */
#include <stdatomic.h>
#include <stddef.h>

#include "kvt_format.h"

static const char *const sp_names[KVT_SP__COUNT] = {
#define KVT_SP_NAME(n, d) #n,
	KVT_SP_LIST(KVT_SP_NAME)
#undef KVT_SP_NAME
};

static const char *const sp_whats[KVT_SP__COUNT] = {
#define KVT_SP_WHAT(n, d) d,
	KVT_SP_LIST(KVT_SP_WHAT)
#undef KVT_SP_WHAT
};

const char *kvt_sp_name(int sp)
{
	return sp >= 0 && sp < KVT_SP__COUNT ? sp_names[sp] : NULL;
}

const char *kvt_sp_what(int sp)
{
	return sp >= 0 && sp < KVT_SP__COUNT ? sp_whats[sp] : NULL;
}

#ifdef KVT_SCHEDULE_POINTS
static kvt_sp_hook_fn _Atomic sp_hook;
static void *_Atomic sp_arg;

void kvt_sp_set_hook(kvt_sp_hook_fn fn, void *arg)
{
	atomic_store_explicit(&sp_arg, arg, memory_order_relaxed);
	/* Release: the argument is visible to whoever sees the hook. */
	atomic_store_explicit(&sp_hook, fn, memory_order_release);
}

void kvt__sp(enum kvt_sp sp, const struct kvt_seg *s)
{
	kvt_sp_hook_fn fn = atomic_load_explicit(&sp_hook, memory_order_acquire);

	if (fn)
		fn(sp, s, atomic_load_explicit(&sp_arg, memory_order_relaxed));
}
#endif
