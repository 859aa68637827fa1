/* disk.pml - the disk tier's two protocols in the segment, checked with
 * spin (core/diskidx.c, tier/disk/disk.c).
 *
 * 1. The index entry's seqlock (D1, D2): one writer (the engine) puts and
 *    deletes keys in one entry, and may die at any step (kill -9), after
 *    which a restarted engine empties the index (a seq left odd is bumped
 *    first).  Readers read seq, val, key_lo, key_hi, seq as the C code does
 *    and accept only an even, unchanged seq and a nonzero val (one reader:
 *    readers never write, so one stands for all).  A put of
 *    key i writes lo = hi = val = i, so an accepted read that mixes two
 *    puts shows lo, hi and val unequal.
 *    Assertion: an accepted read has lo == hi == val (one put's words).
 *
 * 2. Demotion without a pin: the engine takes a READY slot's life g, copies
 *    its payload (two reads: a copy takes time), and publishes only if the
 *    slot is READY in life g at completion; an evictor meanwhile evicts the
 *    slot and refills it in life g + 1 (payload written in two halves).
 *    Assertion: a published copy holds life g's payload, both halves.
 *
 * 3. Promotion with a dying engine: the engine allocates the slot for key A
 *    in a new life, claims it, submits the read (the kernel writes the
 *    slot's bytes later, at a moment of its own), and publishes READY after
 *    the completion if its claim and life still hold; it may die at any
 *    step.  Its liveness token (the entry's lock) is held by the process
 *    and by the ring, which keeps it until its request finished
 *    (kvt_seg_lock_fd).  A reaper that sees the token gone drops the claim
 *    and abandons the slot; a writer takes the free slot for key B, writes
 *    B's bytes and publishes it.  A reader checks any READY slot.
 *    Assertion: a READY slot holds the bytes of its own key.
 *
 * -DNO_SEQCHECK (a reader that skips the second seq read),
 * -DNO_LIFECHECK (a demotion published without the life re-check) and
 * -DNO_RING_HOLD (the token dies with the process, as before the ring held
 * the lock descriptor) must fail: the model is strong enough to see each
 * check's reason.
 *
 * Promela's interleavings are sequentially consistent; the C code's
 * acquire/release pairs (DW1/DR1 in diskidx.c, the slot's R6/A2) are what
 * make the hardware keep these orders.
 */
#ifndef PUTS
#define PUTS 2
#endif
#ifndef LIVES
#define LIVES 2
#endif

/* ---- 1. the index entry ---- */
byte seq = 0;   /* modulo 256: the model's runs stay far below */
byte klo = 0, khi = 0, val = 0;
bool dead = false;
bool restarted = false;

inline dent_write(lo, hi, v)
{
	/* dent_write: a seq left odd by a dead engine is bumped first */
	if
	:: (seq % 2 == 1) -> seq++
	:: else -> skip
	fi;
	seq++;
	klo = lo;
	khi = hi;
	val = v;
	seq++
}

proctype engine_writer()
{
	byte i = 1;
	do
	:: i <= PUTS ->
		/* a put, possibly killed after any store */
		if
		:: (seq % 2 == 1) -> seq++
		:: else -> skip
		fi;
		seq++;
		if :: true -> skip :: true -> dead = true; goto gone fi;
		klo = i;
		if :: true -> skip :: true -> dead = true; goto gone fi;
		khi = i;
		if :: true -> skip :: true -> dead = true; goto gone fi;
		val = i;
		seq++;
		/* a delete */
		seq++;
		if :: true -> skip :: true -> dead = true; goto gone fi;
		val = 0;
		seq++;
		i++
	:: else -> break
	od;
	goto out;
gone:
	/* the next engine's start: index_empty */
	dent_write(0, 0, 0);
	restarted = true;
out:
	skip
}

proctype reader()
{
	byte s1, s2, v, lo, hi, n = 0;
	do
	:: n < PUTS + 2 ->
		s1 = seq;
		if
		:: (s1 % 2 == 0) ->
			v = val;
			lo = klo;
			hi = khi;
			s2 = seq;
			if
#ifdef NO_SEQCHECK
			:: (v != 0) -> assert(lo == v && hi == v)
#else
			:: (s1 == s2 && v != 0) -> assert(lo == v && hi == v)
#endif
			:: else -> skip
			fi
		:: else -> skip
		fi;
		d_step { s1 = 0; s2 = 0; v = 0; lo = 0; hi = 0 }; /* fewer states */
		n++
	:: else -> break
	od
}

/* ---- 2. demotion without a pin ---- */
#define READY    2
#define EVICTING 3
#define FREE     0
#define FILLING  1
byte st = READY;
byte gen = 1;
byte half0 = 1, half1 = 1; /* the payload: the life each half was written in */

proctype evictor()
{
	byte l = 0;
	do
	:: l < LIVES ->
		atomic { st == READY -> st = EVICTING };
		atomic { st = FREE; gen++ };
		st = FILLING;
		half0 = gen;
		half1 = gen;
		st = READY;
		l++
	:: else -> break
	od
}

proctype demoter()
{
	byte g, c0, c1, w;
	/* kvt_slot_ready: READY in life g (state read twice around the key) */
	atomic { st == READY -> g = gen };
	w = st;
	if
	:: (w != READY || gen != g) -> goto out
	:: else -> skip
	fi;
	/* the write: the kernel reads the payload, over time */
	c0 = half0;
	c1 = half1;
	/* completion: kvt_slot_same_life */
	atomic {
		if
#ifdef NO_LIFECHECK
		:: true -> assert(c0 == g && c1 == g)
#else
		:: (st == READY && gen == g) -> assert(c0 == g && c1 == g)
#endif
		:: else -> skip /* dropped: never published */
		fi
	}
out:
	skip
}

/* ---- 3. promotion with a dying engine ---- */
#define KA 1
#define KB 2
byte pst = FREE;      /* the slot's state */
byte pkey = 0;        /* whose life it is */
byte pbytes = 0;      /* whose bytes it holds */
bool claim = false;   /* the engine's shard claim */
bool alive = true;    /* the engine's process */
bool inflight = false;/* its read, submitted, not landed */
bool pdone = false;

#ifdef NO_RING_HOLD
#define TOKEN (alive)
#else
#define TOKEN (alive || inflight)
#endif

proctype promoter()
{
	/* allocate + claim (kvt_write_begin); every end state of a process
	 * that waits for another is a valid one (end labels): what is
	 * checked is the assertion */
end:	atomic { pst == FREE -> pst = FILLING; pkey = KA; claim = true };
	if :: alive = false; goto out :: skip fi;
	inflight = true;                        /* io_uring_submit */
	if :: alive = false; goto out :: skip fi;
	!inflight;                              /* the completion */
	if :: alive = false; goto out :: skip fi;
	/* kvt_write_end: its claim still there, in its life */
	atomic { if :: claim && pst == FILLING && pkey == KA -> pst = READY; claim = false
		    :: else fi };
out:
	skip
}

proctype kernel()
{
	/* the read lands whenever the device gets to it, alive or not */
end:	atomic { inflight -> pbytes = KA; inflight = false }
}

proctype reaper()
{
	/* the token gone: drop the claim, abandon the FILLING slot */
end:	atomic { !TOKEN && claim -> claim = false;
		 if :: pst == FILLING -> pst = FREE; pkey = 0 :: else fi }
}

proctype writer()
{
	/* a rank saving key B into whatever slot is free */
end:	atomic { pst == FREE -> pst = FILLING; pkey = KB };
	pbytes = KB;
	atomic { if :: pst == FILLING && pkey == KB -> pst = READY :: else fi };
	pdone = true
}

proctype preader()
{
end:	do
	:: atomic { pst == READY -> assert(pbytes == pkey) }
	:: pdone && !inflight -> break
	od
}

/* The parts share nothing: checked one at a time (-DPART=1, 2, 3), so
 * their states do not multiply. */
#ifndef PART
#define PART 1
#endif
init
{
	atomic {
#if PART == 1
		/* readers do not interact: one is every reader */
		run engine_writer();
		run reader()
#elif PART == 3
		run promoter();
		run kernel();
		run reaper();
		run writer();
		run preader()
#else
		run evictor();
		run demoter();
		run demoter()
#endif
	}
}
