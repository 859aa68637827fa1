/* slot.pml - the slot state machine with shard claims, doom, reclaim and
 * eviction (core/slots.c), checked exhaustively with spin.
 *
 * One slot, two shards, three writers (writers 0 and 2 share shard 0),
 * an evictor and a fill-timeout sweeper.  Each shared word is a variable;
 * each load, store and CAS of the C code is one atomic step (a CAS is an
 * atomic block that compares the whole word, generation included, as the
 * 64-bit word does).  Promela's interleavings are sequentially
 * consistent: the Dekker pairs of slots.c are seq_cst there too.
 *
 * Assertions:
 *   S2  no life of the slot ends (EVICTING|g -> FREE|g+1) while a writer's
 *       copy into life g is in flight (ghost inflight[]);
 *   S4  a slot becomes READY only when every shard was written in that
 *       life by the holder of its claim (ghost written[]);
 *   S5  no slot is doomed while a writer's copy into it is in flight (a
 *       doom decided before a join fails its CAS on the join version);
 *   end when everybody is done, no life is left half ended (DOOMED or
 *       EVICTING: the last writer out reclaims);
 *   S3  (by construction) only EVICTING -> FREE ends a life, and DOOMED
 *       and EVICTING never go back.
 *
 * spin -DLAYOUT1 models the protocol of layout 1 (a writer field and one
 * writing mask per slot, neither tagged with the life, a writer that
 * clears its mask bit even when its writer CAS failed, and an eviction
 * that completes without looking at the mask): spin finds the trail of
 * finding 1 (a writer preempted between its READY CAS and its release
 * wipes the bit of the next life's writer; the sweeper then reclaims the
 * slot under that writer's copy).  The default is layout 2: clean.
 */
#ifndef NSH
#define NSH 2      /* shards */
#endif
#ifndef NW
#define NW 3       /* writers; writer i writes shard i % NSH */
#endif
#ifndef ITER
#define ITER 1     /* operations per writer */
#endif
#ifndef ITER0
#define ITER0 ITER /* operations of writer 0 (the others do ITER) */
#endif
#ifndef AUX_ITER
#define AUX_ITER 1 /* operations of the evictor and of the sweeper */
#endif

#define FREE     0
#define FILLING  1
#define READY    2
#define EVICTING 3
#define DOOMED   4

byte st = FREE;
byte gen = 0;
byte owner = 0;          /* allocator + 1 while it sets the slot up */
byte jv = 0;             /* the join version (in FILLING; the same word) */
byte finished = 0;
bool indexed = false;    /* the index finds the slot in life gen */
byte ready = 0;          /* shard bits written in this life */
byte inflight[NW];       /* ghost: life + 1 of a copy in progress */
byte written[NSH];       /* ghost: life + 1 in which the shard was written */
#ifdef LAYOUT1
byte writer[NSH];        /* writer + 1 */
byte writing = 0;        /* shard bits being written */
#else
byte cgen[NSH];          /* claim word: life ... */
byte cent[NSH];          /* ... and writer + 1; 0 = free */
#endif

#define BIT(s) (1 << (s))
#define FULL   ((1 << NSH) - 1)
#if NW == 2
#define NOT_INFLIGHT(g) (inflight[0] != (g) + 1 && inflight[1] != (g) + 1)
#else
#define NOT_INFLIGHT(g) (inflight[0] != (g) + 1 && inflight[1] != (g) + 1 && inflight[2] != (g) + 1)
#endif
#if NSH == 1
#define ALL_WRITTEN(g) (written[0] == (g) + 1)
#else
#define ALL_WRITTEN(g) (written[0] == (g) + 1 && written[1] == (g) + 1)
#endif

/* ---- reclaim: DOOMED|g -> EVICTING|g -> FREE|g+1 ---- */
#ifdef LAYOUT1
inline reclaim(g)
{
	atomic { if :: st == DOOMED && gen == g && writing == 0 -> st = EVICTING :: else fi };
	atomic {
		if
		:: st == EVICTING && gen == g ->
			indexed = false;
			assert(NOT_INFLIGHT(g));
			st = FREE; gen++
		:: else
		fi
	}
}
#else
/* the seq_cst scan of every claim word, one load per word */
inline drained(g, res)
{
	res = true;
	atomic { if :: cent[0] != 0 && cgen[0] == g -> res = false :: else fi };
#if NSH > 1
	atomic { if :: cent[1] != 0 && cgen[1] == g -> res = false :: else fi }
#endif
}

/* uses the caller's bool dr */
inline reclaim(g)
{
	if
	:: st == DOOMED && gen == g ->
		drained(g, dr);
		if :: dr -> atomic { if :: st == DOOMED && gen == g -> st = EVICTING :: else fi }
		   :: else fi
	:: else
	fi;
	if
	:: st == EVICTING && gen == g ->
		drained(g, dr);
		if
		:: dr -> indexed = false;  /* index entries removed */
			atomic {
				if
				:: st == EVICTING && gen == g ->
					assert(NOT_INFLIGHT(g));
					st = FREE; gen++
				:: else
				fi
			}
		:: else
		fi
	:: else
	fi
}
#endif

#ifdef LAYOUT1
inline abandon(g)
{
	atomic { if :: st == FILLING && gen == g -> st = DOOMED; owner = 0 :: else fi };
	reclaim(g)
}
#else
/* kvt__slot_abandon: read the word, scan the claims, CAS the word read */
inline abandon(g)
{
	v = 255;
	atomic { if :: st == FILLING && gen == g && owner == 0 -> v = jv :: else fi };
	if
	:: v != 255 ->
		drained(g, dr);
		if
		:: dr -> atomic {
				if
				:: st == FILLING && gen == g && owner == 0 && jv == v ->
					assert(NOT_INFLIGHT(g));   /* S5 */
					st = DOOMED
				:: else
				fi
			};
			reclaim(g)
		:: else
		fi
	:: else
	fi
}
#endif

/* ---- a writer of shard id % NSH ---- */
proctype writer_p(byte id)
{
	byte sh = id % NSH, g, it = 0, v;
	bool ok, isfull, dr;

	do
	:: (id == 0 && it < ITER0) || (id != 0 && it < ITER) ->
		it++;
		if
		:: atomic { st == FREE -> st = FILLING; owner = id + 1; g = gen;
			    ready = 0 /* the fields: nobody reads them before the index */ };
			/* setup: own claim, index entry; then done */
#ifdef LAYOUT1
			writer[sh] = id + 1;
			writing = writing | BIT(sh);
#else
			atomic { cgen[sh] = g; cent[sh] = id + 1 };
#endif
			indexed = true;
			atomic { if :: st == FILLING && gen == g && owner == id + 1 -> owner = 0
				    :: else fi }
		:: atomic { st == FILLING && indexed -> g = gen };  /* found by a joiner */
#ifdef LAYOUT1
			atomic { if :: writer[sh] == 0 -> writer[sh] = id + 1
				    :: else -> goto next fi };
			writing = writing | BIT(sh);
			if
			:: atomic { !(st == FILLING && gen == g) } ->
				/* back out: shard_release */
				atomic { if :: writer[sh] == id + 1 -> writer[sh] = 0 :: else fi };
				writing = writing & ~BIT(sh);
				reclaim(g);
				goto next
			:: else
			fi;
			if :: (ready & BIT(sh)) ->
				atomic { if :: writer[sh] == id + 1 -> writer[sh] = 0 :: else fi };
				writing = writing & ~BIT(sh);
				goto next
			   :: else fi
#else
			atomic {
				if
				:: cent[sh] != 0 && cgen[sh] == g -> goto next   /* busy: skip */
				:: cent[sh] != 0 && cgen[sh] > g -> goto next    /* newer life */
				:: else -> cgen[sh] = g; cent[sh] = id + 1
				fi
			};
			/* the re-check: a CAS that bumps the join version */
			ok = false;
			atomic { if :: st == FILLING && gen == g -> jv++; ok = true :: else fi };
			if
			:: !ok ->
				atomic { if :: cent[sh] == id + 1 && cgen[sh] == g -> cent[sh] = 0
					    :: else fi };
				reclaim(g);
				goto next
			:: else
			fi;
			if :: (ready & BIT(sh)) ->
				atomic { if :: cent[sh] == id + 1 && cgen[sh] == g -> cent[sh] = 0
					    :: else fi };
#ifndef NO_JOIN_RECLAIM
				reclaim(g);
#endif
				goto next
			   :: else fi
#endif
		:: else -> goto next
		fi;
		/* the copy: in flight until the claim goes; then commit or abort */
		if
		:: d_step { inflight[id] = g + 1; ok = true }
		:: d_step { inflight[id] = g + 1; ok = false }
		fi;
		if
		:: ok && st == FILLING && gen == g ->
			atomic { ready = ready | BIT(sh); written[sh] = g + 1;
				 isfull = (ready == FULL) };
			if
			:: isfull -> atomic { if :: st == FILLING && gen == g ->
						assert(ALL_WRITTEN(g));
						st = READY; owner = 0
					    :: else fi }
			:: else
			fi
		:: else
		fi;
		/* drop the claim (the copy is over) */
#ifdef LAYOUT1
		atomic { inflight[id] = 0; if :: writer[sh] == id + 1 -> writer[sh] = 0 :: else fi };
		writing = writing & ~BIT(sh);
		if
		:: atomic { gen == g && st == FILLING && !ok && ready == 0 && writing == 0 } -> abandon(g)
		:: atomic { gen == g && (st == DOOMED || st == EVICTING) } -> reclaim(g)
		:: else
		fi;
#else
		atomic { inflight[id] = 0;
			 if :: cent[sh] == id + 1 && cgen[sh] == g -> cent[sh] = 0 :: else fi };
		if
		:: atomic { gen == g && st == FILLING && !ok && ready == 0 } -> abandon(g)
		:: atomic { gen == g && (st == DOOMED || st == EVICTING) } -> reclaim(g)
		:: else
		fi;
#endif
next:		skip;
		d_step { g = 0; ok = false; isfull = false; dr = false; v = 0 }
	:: else -> break
	od;
	finished++
}

proctype evictor()
{
	byte g, it = 0;
	bool dr;
	do
	:: it < AUX_ITER ->
		it++;
		if
		:: atomic { st == READY -> st = EVICTING; g = gen }; reclaim(g)
		:: atomic { st == EVICTING -> g = gen }; reclaim(g)
		:: else
		fi;
		d_step { g = 0; dr = false }
	:: else -> break
	od;
	finished++
}

/* The CLOCK sweep's fill timeout: a FILLING slot set up and not written */
proctype sweeper()
{
	byte g, it = 0, v;
	bool dr;

	do
	:: it < AUX_ITER ->
		it++;
		if
		:: atomic { st == FILLING && owner == 0 -> g = gen };
#ifdef LAYOUT1
			if :: atomic { writing == 0 } -> abandon(g) :: else fi
#else
			abandon(g)
#endif
		:: atomic { st == DOOMED -> g = gen }; reclaim(g)
		:: else
		fi;
		d_step { g = 0; dr = false; v = 0 }
	:: else -> break
	od;
	finished++
}

init {
	atomic {
		byte i = 0;
		do
		:: i < NW -> run writer_p(i); i++
		:: else -> break
		od;
		run evictor(); run sweeper()
	};
	(finished == NW + 2);
	assert(st != DOOMED && st != EVICTING)
}
