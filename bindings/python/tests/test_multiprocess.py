"""The engine cycle across processes: a scheduler (this process) and 4 rank
processes started with multiprocessing's 'spawn', as an engine's workers
are.  The ranks hash the prompt themselves (keys must agree across
processes), save their shards, then load a lease whose id travels over a
queue, into zeroed blocks, and check the bytes."""

import multiprocessing as mp
import os
import queue
import signal

import pytest

import kvtier
from kvt_testlib import WORLD, block_table, blocks_equal, kv_cache, prompt, rank, scheduler

N_CHUNKS = 6
TIMEOUT = 60


def rank_worker(name, r, replicated, cmds, results):
    """One rank process: open, register, then serve commands."""
    try:
        kv = kv_cache(seed=100 + (0 if replicated else r))
        with rank(name, r, kv, replicated) as t:
            results.put(("ready", r, None))
            while True:
                cmd, arg = cmds.get(timeout=TIMEOUT)
                if cmd == "save":
                    tokens, table = arg
                    keys = t.hash_tokens(tokens)
                    op = t.save(keys, table)
                    op.wait(timeout=TIMEOUT)
                    results.put(("saved", r, (op.count, [tuple(k) for k in keys])))
                elif cmd == "load":
                    lease_id, n, src_table, dst_table = arg
                    for a in kv:
                        a[dst_table] = 0
                    done = t.load(lease_id, dst_table, n=n).wait(timeout=TIMEOUT)
                    ok = done and blocks_equal(kv, src_table, kv, dst_table)
                    results.put(("loaded", r, ok))
                elif cmd == "hold":
                    results.put(("holding", r, os.getpid()))
                elif cmd == "exit":
                    break
        results.put(("bye", r, None))
    except BaseException as e:  # report, never hang the parent
        results.put(("error", r, e if isinstance(e, kvtier.KvtierError) else repr(e)))


def _collect(rp, what, ranks=None):
    got = {}
    for r in (range(WORLD) if ranks is None else ranks):
        try:
            kind, rr, val = rp.results[r].get(timeout=TIMEOUT)
        except queue.Empty:
            pytest.fail("timed out waiting for %s from rank %d (have %s)"
                        % (what, r, sorted(got)))
        if kind == "error":
            pytest.fail("rank %d failed: %s" % (rr, val))
        assert kind == what and rr == r, (kind, rr, val)
        got[r] = val
    return got


class RankProcs:
    def __init__(self, name, replicated):
        ctx = mp.get_context("spawn")
        # A queue per rank each way: a process killed while it writes a
        # shared queue would leave the queue's lock held for the others.
        self.results = [ctx.Queue() for _ in range(WORLD)]
        self.cmds = [ctx.Queue() for _ in range(WORLD)]
        self.procs = [ctx.Process(target=rank_worker, args=(name, r, replicated, self.cmds[r],
                                                            self.results[r]), daemon=True)
                      for r in range(WORLD)]

    def __enter__(self):
        for p in self.procs:
            p.start()
        return self

    def send(self, cmd, arg=None, ranks=None):
        for r in (range(WORLD) if ranks is None else ranks):
            self.cmds[r].put((cmd, arg))

    def __exit__(self, *exc):
        for p in self.procs:
            if p.is_alive():
                try:
                    self.cmds[self.procs.index(p)].put(("exit", None))
                except Exception:
                    pass
        for p in self.procs:
            p.join(timeout=TIMEOUT)
            if p.is_alive():
                p.kill()
                p.join()
        return False


@pytest.mark.parametrize("replicated", [False, True], ids=["sharded", "replicated"])
def test_multiprocess_cycle(segname, replicated):
    toks = prompt(N_CHUNKS, seed=42)
    with scheduler(segname, replicated=replicated) as s, RankProcs(segname, replicated) as rp:
        keys = s.hash_tokens(toks)
        _collect(rp, "ready")
        with s.lookup(keys) as lease:
            assert lease.hits == 0

        save_tab = block_table(N_CHUNKS, seed=42)
        savers = [0] if replicated else list(range(WORLD))
        rp.send("save", (toks, save_tab), ranks=savers)
        saved = _collect(rp, "saved", savers)
        for r, (count, rkeys) in saved.items():
            assert count == N_CHUNKS
            assert [kvtier.Key(*k) for k in rkeys] == keys   # same keys in every process

        with s.lookup(keys) as lease:
            assert lease.hits == N_CHUNKS
            s.step([lease])
            dst_tab = block_table(N_CHUNKS, seed=43, half=1)
            rp.send("load", (lease.hand_off(), lease.hits, save_tab, dst_tab))
            loaded = _collect(rp, "loaded")
            assert all(loaded.values()), loaded
        st = s.stats()
        assert st["leases_live"] == 0 and st["slots_pinned"] == 0
        assert st["hit_chunks"] == N_CHUNKS
        assert st["saved_chunks"] == len(savers) * N_CHUNKS
        rp.send("exit")
        _collect(rp, "bye")


def test_dead_rank_is_reaped_and_its_place_taken(segname):
    """A rank process killed while attached: its entry is reaped and a new
    process can attach as that rank (no -EBUSY forever)."""
    with scheduler(segname) as s, RankProcs(segname, False) as rp:
        _collect(rp, "ready")
        rp.send("hold", ranks=[1])
        pid = _collect(rp, "holding", [1])[1]
        os.kill(pid, signal.SIGKILL)
        rp.procs[1].join(timeout=TIMEOUT)
        assert s.reap() >= 0
        with rank(segname, 1, kv_cache()) as t:
            assert t.stats()["world"] == WORLD
        assert s.stats()["reaped_ranks"] >= 1
        rp.send("exit", ranks=[0, 2, 3])
        _collect(rp, "bye", [0, 2, 3])
