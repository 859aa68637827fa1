/* kvt_atomic.h - the one wrapper over <stdatomic.h> used by core/.
 *
 * Every shared word in the segment is an _Atomic object, so that no access
 * is a data race in the C11 sense and ThreadSanitizer sees the orderings.
 * The wrappers only shorten the spelling; each call site names the ordering
 * it needs and, for every non-relaxed one, its partner (STYLE.md).
 *
 * Names: kat_* ("kvtier atomic").  They were kvt_load/kvt_cas once, which
 * collided in every reader's head (and in every cross-reference tool) with
 * the public API's kvt_load, "load chunks".  kat_or / kat_and are the
 * fetch-or / fetch-and; every kat_* returns what the C11 call returns.
 *
 * Cross-process use: these objects live in a MAP_SHARED mapping.  64-bit
 * atomics are lock-free on every platform kvtier builds for (checked
 * below), and lock-free atomics are address-free, so they work between
 * processes (C11 7.17.5 note; the GCC/Clang implementation).
 */
#ifndef KVT_ATOMIC_H
#define KVT_ATOMIC_H

#include <stdatomic.h>
#include <stdint.h>

_Static_assert(ATOMIC_LLONG_LOCK_FREE == 2, "64-bit atomics must be lock-free");
_Static_assert(ATOMIC_INT_LOCK_FREE == 2, "32-bit atomics must be lock-free");
_Static_assert(ATOMIC_SHORT_LOCK_FREE == 2, "16-bit atomics must be lock-free");

typedef _Atomic uint64_t kvt_a64;
typedef _Atomic uint32_t kvt_a32;
typedef _Atomic uint16_t kvt_a16;

#define KVT_RLX memory_order_relaxed
#define KVT_ACQ memory_order_acquire
#define KVT_REL memory_order_release
#define KVT_AR  memory_order_acq_rel
#define KVT_SC  memory_order_seq_cst

#define kat_load(p, mo)        atomic_load_explicit((p), (mo))
#define kat_store(p, v, mo)    atomic_store_explicit((p), (v), (mo))
#define kat_xchg(p, v, mo)     atomic_exchange_explicit((p), (v), (mo))
#define kat_fadd(p, v, mo)     atomic_fetch_add_explicit((p), (v), (mo))
#define kat_fsub(p, v, mo)     atomic_fetch_sub_explicit((p), (v), (mo))
#define kat_or(p, v, mo)       atomic_fetch_or_explicit((p), (v), (mo))
#define kat_and(p, v, mo)      atomic_fetch_and_explicit((p), (v), (mo))
/* Strong CAS; on failure *expected is updated with the current value and
 * the failure ordering is the success ordering without its release part. */
#define kat_cas(p, expected, desired, mo)                                   \
	atomic_compare_exchange_strong_explicit((p), (expected), (desired),  \
		(mo), ((mo) == KVT_AR || (mo) == KVT_REL) ?                  \
		((mo) == KVT_AR ? KVT_ACQ : KVT_RLX) : (mo))

static inline void kat_relax(void)
{
#if defined(__x86_64__) || defined(__i386__)
	__builtin_ia32_pause();
#elif defined(__aarch64__)
	__asm__ __volatile__("yield" ::: "memory");
#endif
}

#endif /* KVT_ATOMIC_H */
