/* pins.pml - pins, lease refs, the per-entry journal, pin repair by
 * freezing, its adoption by waiters, and reapers that die (core/leases.c,
 * core/ranks.c), checked exhaustively with spin.
 *
 * One READY slot.  Holders pin it (journal PIN, pin CAS, ref, journal
 * clear), read it, and unpin (journal UNPIN, unpin CAS, ref clear, journal
 * clear); a holder may die at any step.  Reapers take a dead, unreaped
 * entry (lock[e] names the process holding entry e's lock: the kernel's
 * OFD lock, dropped at death), turn its journal into REPAIR, repair the
 * slot if the journal named it or the dead entry had frozen it, release
 * the dead holder's ref with their own journal, and free the entry.  The
 * first reaper may die (mid-repair too); the last never dies, so
 * everything gets reaped.  With -DREATTACH the first reaper acts with the
 * dead entry's own journal, as a rank re-attaching to its dead entry does.
 * An evictor evicts the slot once it is unpinned and not frozen.
 *
 * Liveness as a process sees it (kvt__entry_alive): its acting entry is
 * alive; an entry whose lock it holds to reap it is dead; any other entry
 * is alive when some process holds its lock.
 *
 * Assertions:
 *   S1   the slot is never evicted while a live holder reads it; a pin
 *        count never goes below 0;
 *   P1   no wait on a dead process: every wait is a blocking guard, so a
 *        process left waiting for ever is an invalid end state;
 *   end  when everybody is done: no pin left, the slot not frozen.
 *
 * Stopped processes (-DSTOPS=n): a holder or the mortal reaper (a freezer,
 * mid-repair) may stop at any step (SIGSTOP, the cgroup freezer) and stay
 * stopped, alive, until every process not stopped has finished: longer
 * than any wait's bound.  Every
 * wait on another live process is bounded (the give-up branches, which
 * spin may take at any moment, so every timing is covered): a repairer
 * past its deadline counts a pending PIN journal as a pin that happened
 * (pessimistic: a pin too many is a leak, a pin too few is an eviction
 * under a reader), and a waiter takes a live freezer's repair over.  The
 * count is then flagged for a recount (not modelled: a plain repair).
 *   end  with stops: every pin left is one of those counted pessimistically.
 * -DNO_BOUND (the waits of layout 5, unbounded) must deadlock with a stop
 * (an invalid end state); -DOPTIMISTIC (a give-up that counts refs only)
 * must break S1.
 *
 * spin -DLAYOUT1 models layout 1's rules (a repairer skips entries being
 * reaped; liveness is "the process exists"; a repairer adopts any freeze;
 * an unpinner waits for the unfreeze only).  spin then finds finding 4 (a
 * release, or a reaper's own unpin, waiting for ever on a slot frozen by a
 * dead reaper) and, with -DREATTACH, finding 5 (a repair counting the ref
 * of a re-attacher's finished unpin: one pin too many).
 */
#define NH 2        /* holders: entries 0, 1 */
#define N  4        /* + reapers: entries 2 (mortal), 3 (immortal) */
#ifndef DEATHS
#define DEATHS 2
#endif

#ifndef STOPS
#define STOPS 0
#endif

#define J_NONE   0
#define J_PIN    1
#define J_UNPIN  2
#define J_REPAIR 4

byte pins = 0;
bool frozen = false;
byte freezer = N;        /* the freezer entry; N: nobody */
bool evicted = false;
bool ref[N + 1];             /* holder e's lease ref on the slot */
byte lact[N + 1];            /* the actor of holder e's lease: its builder, then
			  * whoever took it over to release it (RELEASING) */
byte jop[N + 1];
bool jblk[N + 1];
byte lock[N + 1];            /* process + 1 holding entry e's lock; 0: nobody */
bool dead[N + 1];
bool reaped[N + 1];
bool reading[N + 1];         /* ghost: a live holder reads the chunk */
byte deaths = 0;
byte nstops = 0;         /* stops so far */
byte nstopped = 0;       /* holders stopped now */
byte nst_all = 0;        /* processes stopped now */
bool stopped[N + 1];
byte extra_pins = 0;     /* pins counted pessimistically (upper bound of the leak) */
byte done = 0;           /* processes finished (or dead) */
byte hdone = 0;          /* ... of them holders */

#ifdef LAYOUT1
#define ALIVE(e, acting, who) (!dead[e])
#define SKIP_IN_WAIT(e)       (lock[e] != 0 && lock[e] != (e) + 1) /* REAPING */
#else
#define ALIVE(e, acting, who) ((e) == (acting) || (lock[e] != 0 && lock[e] != (who) + 1))
#define SKIP_IN_WAIT(e)       false
#endif

#define DIE(me) atomic { deaths < DEATHS && !stopped[me] -> deaths++; dead[me] = true; \
			 lock[me] = 0; reading[me] = false }; goto gone
/* a stop lasts until everybody else finished: longer than any bound */
#define STOP(me) atomic { nstops < STOPS && !stopped[me] -> nstops++; nst_all++; \
			  if :: me < NH -> nstopped++ :: else fi; stopped[me] = true }; \
		 (done + nst_all == N); \
		 atomic { nst_all--; if :: me < NH -> nstopped-- :: else fi }
#if STOPS > 0
#define MAYBE_DIE(me) if :: DIE(me) :: STOP(me) :: skip fi
#else
#define MAYBE_DIE(me) if :: DIE(me) :: skip fi
#endif
#define HELD_STOPPED(x) (lock[x] != 0 && stopped[lock[x] - 1])
#define PENDING(e, bact, bwho) ((jop[e] == J_PIN || jop[e] == J_UNPIN) && !jblk[e] && \
				ALIVE(e, bact, bwho))

/* Waits for the live processes between their two stores on the slot,
 * counts the refs, unfreezes.  Uses the caller's byte e. */
inline repair_body(bact, bwho)
{
	e = 0;
	x = 0;
	y = 0;
	do
	:: e < N ->
		if
		:: e != bact && !SKIP_IN_WAIT(e) ->
			if
			:: (!PENDING(e, bact, bwho))
#ifndef NO_BOUND
			/* past the deadline: a PIN journal's CAS may have
			 * happened (its ref not yet written): count it */
			:: atomic { PENDING(e, bact, bwho) ->
#ifndef OPTIMISTIC
				    if :: jop[e] == J_PIN -> x++ :: else fi;
#endif
				    /* either way a pin too many is possible: a
				     * PIN whose CAS had not happened, an UNPIN
				     * whose CAS had (its ref still counted) */
				    y++
			   }
#endif
			fi
		:: else
		fi;
		e++
	:: else -> break
	od;
	atomic {
		if
		:: frozen && freezer == bact ->
			pins = ref[0] + ref[1] + ref[2] + ref[3] + x; frozen = false; freezer = N;
			extra_pins = extra_pins + y
		:: else
		fi
	};
	x = 0;
	y = 0
}

#ifdef LAYOUT1
#define FREEZE(acting, who) atomic { frozen = true; freezer = acting }
#else
/* a live freezer is waited for; a dead one's freeze (or our own) adopted */
#ifdef NO_BOUND
#define FREEZE(acting, who) atomic { (!frozen || freezer == acting || \
	!ALIVE(freezer, acting, who)) -> frozen = true; freezer = acting }
#else
/* ... and a live one's taken over past the deadline: any moment */
#define FREEZE(acting, who) atomic { frozen = true; freezer = acting }
#endif
#endif

/* The unpin loop, journal uj, of ref ur. */
inline unpin_loop(uj, ur, uact, uwho)
{
	do
	:: atomic { !frozen -> jblk[uj] = false; assert(pins > 0); pins--; reading[ur] = false };
		break
	:: atomic { frozen -> jblk[uj] = true };
#ifdef LAYOUT1
		(!frozen)
#else
		if
		:: (!frozen)
		:: atomic { frozen && (freezer == uact || !ALIVE(freezer, uact, uwho)) ->
			    freezer = uact };
			repair_body(uact, uwho)   /* adopt the dead freezer's repair */
#ifndef NO_BOUND
		:: atomic { frozen -> freezer = uact };
			repair_body(uact, uwho)   /* past the deadline: a live one's too */
#endif
		fi
#endif
	od
}

proctype holder(byte me)
{
	byte e, x, y;

	jop[me] = J_PIN;
	MAYBE_DIE(me);
	if
	:: atomic { !frozen && !evicted -> pins++ }
	:: else -> jop[me] = J_NONE; goto out
	fi;
	MAYBE_DIE(me);
	atomic { ref[me] = true; reading[me] = true };
	MAYBE_DIE(me);
	jop[me] = J_NONE;
	MAYBE_DIE(me);
	jop[me] = J_UNPIN;          /* read; now the release */
	MAYBE_DIE(me);
	unpin_loop(me, me, me, me);
	MAYBE_DIE(me);
	ref[me] = false;
	MAYBE_DIE(me);
	jop[me] = J_NONE;
out:
	lock[me] = 0;
gone:
	atomic { done++; hdone++ }
}

proctype reaper(byte me; bool mortal)
{
	byte d, j, e, k, x, y;

	do
	:: atomic {
		if
		:: dead[0] && !reaped[0] && lock[0] == 0 -> d = 0
		:: dead[1] && !reaped[1] && lock[1] == 0 -> d = 1
		:: dead[2] && !reaped[2] && lock[2] == 0 -> d = 2
		fi;
		assert(d != me);
		lock[d] = me + 1
	   } ->
#ifdef REATTACH
		j = (mortal -> d : me);   /* the mortal one re-attaches: d's journal */
#else
		j = me;
#endif
		if
		:: jop[d] == J_PIN || jop[d] == J_UNPIN || jop[d] == J_REPAIR ||
		   (frozen && freezer == d) ->
#ifndef LAYOUT1
			if :: jop[d] != J_NONE -> jop[d] = J_REPAIR :: else fi;
#endif
			FREEZE(j, me);
			if :: mortal -> MAYBE_DIE(me) :: else fi;
			repair_body(j, me)
		:: else
		fi;
		jop[d] = J_NONE;
		jblk[d] = false;
		/* release the leases d built or was releasing: take each over
		 * (one CAS: RELEASING, actor = us), unpin with our journal */
		k = 0;
		do
		:: k < NH ->
			if
			:: atomic { ref[k] && lact[k] == d -> lact[k] = j };
				jop[j] = J_UNPIN;
				if :: mortal -> MAYBE_DIE(me) :: else fi;
				unpin_loop(j, k, j, me);
				if :: mortal -> MAYBE_DIE(me) :: else fi;
				ref[k] = false;
				jop[j] = J_NONE
			:: else
			fi;
			k++
		:: else -> break
		od;
		atomic { reaped[d] = true; lock[d] = 0 }
	/* done when no holder runs and no dead entry is left to take (one
	 * whose lock a stopped reaper holds is that reaper's to finish) */
	:: atomic { hdone + nstopped == NH &&
		    !((dead[0] && !reaped[0] && !HELD_STOPPED(0)) ||
		      (dead[1] && !reaped[1] && !HELD_STOPPED(1)) ||
		      (dead[2] && !reaped[2] && !HELD_STOPPED(2))) } -> break
	od;
	lock[me] = 0;
	atomic { done++ };
	goto end;
gone:
	/* the kernel drops every lock the dead reaper held */
	atomic {
		d = 0;
		do
		:: d < N -> if :: lock[d] == me + 1 -> lock[d] = 0 :: else fi; d++
		:: else -> break
		od;
		done++
	};
end:
	skip
}

proctype evictor()
{
	/* may never run: a pin counted pessimistically is never released
	 * (init's last assertion bounds those) */
end:	atomic { pins == 0 && !frozen && !evicted ->
		 assert(!reading[0] && !reading[1]); evicted = true }
}

init {
	atomic {
		lock[0] = 1; lock[1] = 2; lock[2] = 3; lock[3] = 4;
		lact[0] = 0; lact[1] = 1; dead[N] = true; /* entry N: "nobody" */
		run holder(0); run holder(1);
		run reaper(2, true);
		run reaper(3, false);
		run evictor()
	};
	(done == N);
	assert(!frozen);
	assert(pins <= extra_pins)
}
