/* kvt_sp.h - schedule points: one named hook at each step of a
 * shared-memory protocol, so that a test can pause a process exactly there,
 * run other operations, resume it, kill it there, or inject random delays.
 *
 * A kill -9 test finds deaths between steps; it cannot find a preemption at
 * the wrong instant.  Every step of a protocol in core/ that another
 * process can observe half done is a point of this list, named for what
 * has just happened.  KVT_SP(name) compiles to nothing unless core is built
 * with KVT_SCHEDULE_POINTS (the kvtier_core_sp library that the
 * schedule-point tests link, or every target with
 * cmake -DKVTIER_SCHEDULE_POINTS=ON for a long preemption run).
 */
#ifndef KVT_SP_H
#define KVT_SP_H

/* X(name, what has just happened) */
#define KVT_SP_LIST(X)                                                          \
	X(ALLOC_TAKEN,      "alloc: FREE -> FILLING|allocator done, fields not written") \
	X(ALLOC_SETUP,      "alloc: fields and own claim written, before the index insert") \
	X(ALLOC_INSERTED,   "alloc: index entry final, allocator still in the state word") \
	X(INDEX_TENTATIVE,  "index insert: tentative entry claimed, before the commit") \
	X(INDEX_COMMITTED,  "index insert: committed (ctl pending), before finalize") \
	X(INDEX_HELP,       "index help: a pending ctl read, before its entry is read") \
	X(INDEX_HELP_CAS,   "index help: entry and ctl re-read match, before the entry CAS") \
	X(FIND_KEYREAD,     "index find: key compared, before the generation re-check") \
	X(JOIN_FOUND,       "join: slot found FILLING in the index, before the claim") \
	X(JOIN_CLAIMED,     "join: shard claim taken, before the state re-check") \
	X(JOIN_BACKOUT,     "join: the slot moved on, before the claim is given back") \
	X(WEND_READY_BIT,   "write_end: ready bit set, before the READY CAS") \
	X(WEND_READY,       "write_end: READY CAS done, claim still held") \
	X(WEND_DROPPED,     "write_end: claim dropped, before doom / reclaim") \
	X(EVICT_CLAIMED,    "evict: READY -> EVICTING done, before the reclaim") \
	X(DOOMED,           "doom: FILLING -> DOOMED done, before the reclaim") \
	X(RECLAIM_DRAINED,  "reclaim: no claim of this life left, before DOOMED/EVICTING moves on") \
	X(RECLAIM_UNINDEXED, "reclaim: index entries removed, before EVICTING -> FREE") \
	X(LEASE_BUILDING,   "lookup: lease FREE -> BUILDING done") \
	X(PIN_JOURNALED,    "pin: journal PIN written, before the pin CAS") \
	X(PIN_DONE,         "pin: pin CAS done, before the lease records the ref") \
	X(RELEASE_CLAIMED,  "release: lease ACTIVE -> RELEASING done, before the unpins") \
	X(UNPIN_JOURNALED,  "unpin: journal UNPIN written, before the unpin CAS") \
	X(UNPIN_DONE,       "unpin: unpin CAS done, before the lease ref is cleared") \
	X(UNPIN_FROZEN,     "unpin: found the slot frozen, marked itself blocked") \
	X(SLOTS_COUNTED,    "lease_slots: lease read live and its ref count, before the refs") \
	X(LOADED_CHECKED,   "loaded: lease read ACTIVE, before the rank's mark") \
	X(LOADED_MARKED,    "loaded: rank's mark written, before the full check") \
	X(STEP_CHECKED,     "step: lease read ACTIVE and absent, before the miss count") \
	X(REPAIR_FROZEN,    "pin repair: slot frozen (or adopted), before the wait") \
	X(REPAIR_COUNTED,   "pin repair: refs counted, before the unfreeze") \
	X(REPAIR_GAVE_UP,   "pin repair: past its deadline, a live process between its stores counted pessimistically") \
	X(REPAIR_TAKEOVER,  "pin repair: past its deadline, a live freezer's repair about to be taken over") \
	X(CLAIM_LOCKED,     "attach: entry lock taken, before the owner word changes") \
	X(REAP_LOCKED,      "reap: dead entry locked and REAPING, before any repair") \
	X(REAP_SLOTS,       "reap: slots repaired, before the leases") \
	X(REAP_DONE,        "reap: leases released, before the entry is EMPTY") \
	X(DETACH_ABORTED,   "detach: own claims aborted, before the entry is EMPTY")

enum kvt_sp {
#define KVT_SP_ENUM(n, d) KVT_SP_##n,
	KVT_SP_LIST(KVT_SP_ENUM)
#undef KVT_SP_ENUM
	KVT_SP__COUNT
};

struct kvt_seg;

#ifdef KVT_SCHEDULE_POINTS
/* The hook a test installs (process-wide; threads tell themselves apart by
 * their handle or by thread-local state).  NULL: points are no-ops. */
typedef void (*kvt_sp_hook_fn)(enum kvt_sp sp, const struct kvt_seg *s, void *arg);
void kvt_sp_set_hook(kvt_sp_hook_fn fn, void *arg);
void kvt__sp(enum kvt_sp sp, const struct kvt_seg *s);
#define KVT_SP(name, s) kvt__sp(KVT_SP_##name, (s))
#else
#define KVT_SP(name, s) ((void)0)
#endif

/* The name ("PIN_DONE") and description of a point; NULL out of range. */
const char *kvt_sp_name(int sp);
const char *kvt_sp_what(int sp);

#endif /* KVT_SP_H */
