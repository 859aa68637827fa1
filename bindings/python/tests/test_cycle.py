"""The engine cycle from Python in one process: a scheduler and 4 ranks on
one segment, numpy KV caches laid out like vLLM's per-layer arrays."""

import errno

import numpy as np
import pytest

import kvtier
from kvt_testlib import (BLOCKS_PER_CHUNK, CHUNK_TOKENS, WORLD, block_table, blocks_equal,
                         kv_cache, prompt, rank, scheduler)

N_CHUNKS = 5


def test_hash_tokens_full_chunks_only_and_deterministic(segname):
    with scheduler(segname) as s:
        toks = prompt(N_CHUNKS)
        keys = s.hash_tokens(toks)
        assert len(keys) == N_CHUNKS                    # the partial tail is not hashed
        assert all(isinstance(k, kvtier.Key) for k in keys)
        assert len(set(keys)) == N_CHUNKS
        assert s.hash_tokens(list(int(x) for x in toks)) == keys   # a list works too
        # chained: a prefix has the prefix's keys; a changed token changes
        # its chunk's key and every later one
        assert s.hash_tokens(toks[: 2 * CHUNK_TOKENS]) == keys[:2]
        t2 = toks.copy()
        t2[2 * CHUNK_TOKENS + 3] ^= 1
        k2 = s.hash_tokens(t2)
        assert k2[:2] == keys[:2] and all(a != b for a, b in zip(k2[2:], keys[2:]))
        # parent: continue a chain
        assert s.hash_tokens(toks[2 * CHUNK_TOKENS:], parent=keys[1]) == keys[2:]
        assert s.hash_tokens(toks[: CHUNK_TOKENS - 1]) == []
        fp = s.fingerprint
        assert isinstance(fp, kvtier.Key) and int(fp) != 0
        assert kvtier.Key.from_int(int(keys[0])) == keys[0]


def test_empty_lookup(segname):
    with scheduler(segname) as s:
        keys = s.hash_tokens(prompt(N_CHUNKS))
        with s.lookup(keys) as lease:
            assert lease.hits == 0 and lease.id == 0
        st = s.stats()
        assert st["lookups"] == 1 and st["lookup_chunks"] == N_CHUNKS
        assert st["hit_chunks"] == 0 and st["leases_live"] == 0
        assert st["chunk_tokens"] == CHUNK_TOKENS and st["world"] == WORLD


def _sharded_cycle(segname, replicated):
    toks = prompt(N_CHUNKS, seed=1)
    src = [kv_cache(seed=10 + r) for r in range(WORLD)]
    if replicated:  # MLA: every rank holds the same bytes
        src = [src[0]] * WORLD
    with scheduler(segname, replicated=replicated) as s:
        keys = s.hash_tokens(toks)
        assert s.lookup(keys).hits == 0

        # prefill: the ranks save their shards from a scattered block table
        save_tab = block_table(N_CHUNKS, seed=1)
        savers = [0] if replicated else range(WORLD)
        ranks = [rank(segname, r, src[r], replicated) for r in range(WORLD)]
        try:
            for r in savers:
                assert s.lookup(keys).hits == 0      # not ready before every shard
                with ranks[r].save(keys, save_tab) as op:
                    assert op.count == N_CHUNKS
            assert op.done
            # a second save of the same chunks is deduplicated
            op = ranks[0].save(keys, save_tab)
            assert op.count == 0 and op.wait() and op.poll()
        finally:
            for t in ranks:
                t.close()
        st = s.stats()
        assert st["saved_chunks"] == len(savers) * N_CHUNKS
        assert st["slots_ready"] == N_CHUNKS

        # a restarted engine: fresh ranks, fresh (zeroed) KV caches
        dst = [kv_cache() for _ in range(WORLD)]
        ranks = [rank(segname, r, dst[r], replicated) for r in range(WORLD)]
        try:
            with s.lookup(keys) as lease:
                assert lease.hits == N_CHUNKS and lease.id != 0
                load_tab = block_table(N_CHUNKS, seed=2)
                for r in range(WORLD):
                    assert s.stats()["leases_live"] == 1   # held until every rank loaded
                    ranks[r].load(lease, load_tab).wait(timeout=30)
                assert lease.loading
            st = s.stats()
            assert st["leases_live"] == 0                  # the last rank's load released it
            assert st["slots_pinned"] == 0
            assert st["double_unpins"] == 0                # exit did not release again
            for r in range(WORLD):
                assert blocks_equal(src[r], save_tab, dst[r], load_tab), "rank %d" % r
            # other blocks were not touched
            untouched = sorted(set(range(dst[0][0].shape[0])) - set(load_tab.tolist()))
            assert all(not d[untouched].any() for d in dst[0])
            # a prefix lookup hits the prefix only; a lease never loaded is
            # released by the context manager
            with s.lookup(keys[:3]) as lease:
                assert lease.hits == 3
                assert s.stats()["leases_live"] == 1
            assert s.stats()["leases_live"] == 0
        finally:
            for t in ranks:
                t.close()


def test_sharded_cycle(segname):
    _sharded_cycle(segname, replicated=False)


def test_replicated_cycle(segname):
    _sharded_cycle(segname, replicated=True)


def test_partial_load_and_table_forms(segname):
    toks = prompt(N_CHUNKS, seed=3)
    src = [kv_cache(seed=20 + r) for r in range(WORLD)]
    with scheduler(segname) as s:
        keys = s.hash_tokens(toks)
        tab = block_table(N_CHUNKS, seed=3)
        ranks = [rank(segname, r, src[r]) for r in range(WORLD)]
        try:
            # one table as a list of ints, and as a list of per-group tables;
            # keys as a numpy (n, 2) array
            karr = np.array([[k.lo, k.hi] for k in keys], dtype=np.uint64)
            for r, t in enumerate(ranks):
                table = tab.tolist() if r % 2 else [tab]
                assert t.save(karr if r == 3 else keys, table).wait()
            lease = s.lookup(keys)
            assert lease.hits == N_CHUNKS
            out = block_table(2, seed=4, half=1)
            for r, t in enumerate(ranks):
                op = t.load(lease.id, out, n=2)        # a lease id and n, as a rank gets them
                while not op.poll():
                    pass
            assert s.stats()["leases_live"] == 0
            for r in range(WORLD):
                # loaded in place: the first 2 chunks' blocks now equal
                assert blocks_equal(src[r], tab[: 2 * BLOCKS_PER_CHUNK], src[r], out)
        finally:
            for t in ranks:
                t.close()


def test_load_skips_blocks(segname):
    """BLOCK_SKIP in a load's table: that block of the cache keeps its bytes
    (a block before vLLM's sliding window, or one it computed itself), the
    others are loaded; a chunk of skips only loads nothing.  A save with a
    skip is refused: chunks are saved whole."""
    src = kv_cache(seed=7)
    with scheduler(segname) as s:
        keys = s.hash_tokens(prompt(3, seed=7))
        tab = block_table(3, seed=7)
        ranks = [rank(segname, r, src) for r in range(WORLD)]
        try:
            bad = tab.copy()
            bad[5] = kvtier.BLOCK_SKIP
            with pytest.raises(kvtier.KvtierError) as e:
                ranks[0].save(keys, bad)
            assert e.value.errno == errno.EINVAL and "whole" in str(e.value)
            for t in ranks:
                t.save(keys, tab).wait()
        finally:
            for t in ranks:
                t.close()
        assert s.stats()["saved_chunks"] == WORLD * 3  # the refused save claimed nothing
        dst = [kv_cache() for _ in range(WORLD)]
        for d in dst:
            for layer in d:
                layer[:] = 7  # a recognisable "computed elsewhere" fill
        ranks = [rank(segname, r, dst[r]) for r in range(WORLD)]
        try:
            lease = s.lookup(keys)
            assert lease.hits == 3
            out = block_table(3, seed=8, half=1)
            load = out.copy()
            skipped = [0, 1, 2, 3, 6]        # all of chunk 0, and one block of chunk 1
            load[skipped] = kvtier.BLOCK_SKIP
            for t in ranks:
                t.load(lease.id, load, n=3).wait(timeout=30)
            assert s.stats()["leases_live"] == 0
            kept = [i for i in range(len(out)) if i not in skipped]
            for r in range(WORLD):
                assert blocks_equal(src, tab[kept], dst[r], out[kept]), r
                for layer in dst[r]:
                    assert (layer[out[skipped]] == 7).all(), r
        finally:
            for t in ranks:
                t.close()


def test_step_releases_stale_leases(segname):
    src = kv_cache(seed=5)
    with scheduler(segname) as s:
        keys = s.hash_tokens(prompt(2, seed=5))
        ranks = [rank(segname, r, src) for r in range(WORLD)]
        try:
            for t in ranks:
                t.save(keys, block_table(2, seed=5)).wait()
        finally:
            for t in ranks:
                t.close()
        kept = s.lookup(keys)
        dropped = s.lookup(keys)
        assert kept.hits == dropped.hits == 2
        released = 0
        for _ in range(3):
            released += s.step([kept])
        assert released == 1
        st = s.stats()
        assert st["stale_unpins"] == 1 and st["leases_live"] == 1
        assert kept.release() is True
        assert kept.release() is False                 # already released: counted
        assert s.stats()["double_unpins"] == 1
        assert s.stats()["leases_live"] == 0
        assert s.reap() >= 0


def test_client_does_everything(segname):
    """A client (tools, tests) with world 1 saves, looks up and loads."""
    src = kv_cache(seed=6)
    g = [kvtier.Group(6, 128, 16)]
    with kvtier.Tier(segment=segname, role="client", world=1, groups=g, chunk_tokens=64,
                     create=True, replace=True, n_slots=16, dma="host") as c:
        c.register_kv(layers=src)
        keys = c.hash_tokens(prompt(3, seed=6))
        tab = block_table(3, seed=6)
        c.save(keys, tab).wait()
        with c.lookup(keys) as lease:
            assert lease.hits == 3
            c.load(lease, block_table(3, seed=7, half=1)).wait()
        assert c.stats()["leases_live"] == 0
        assert blocks_equal(src, tab, src, block_table(3, seed=7, half=1))


def test_raw_addresses(segname):
    """register_kv with base addresses, a block stride and n_blocks."""
    src = kv_cache(seed=8)
    g = [kvtier.Group(6, 128, 16)]
    with kvtier.Tier(segment=segname, role="client", world=1, groups=g, chunk_tokens=64,
                     create=True, replace=True, n_slots=16, dma="host") as c:
        c.register_kv(groups=[([a.ctypes.data for a in src], src[0].strides[0],
                               src[0].shape[0])])
        keys = c.hash_tokens(prompt(1, seed=8))
        assert c.save(keys, [0, 1, 2, 3]).wait()
        with c.lookup(keys) as lease:
            c.load(lease, [8, 9, 10, 11]).wait()
        assert blocks_equal(src, [0, 1, 2, 3], src, [8, 9, 10, 11])


def test_order_after(segname):
    """kvt_order_after: on the host backend there is nothing to order (the
    copies read what the caller wrote); before register_kv it is refused;
    the save that follows works as ever."""
    with scheduler(segname) as s:
        t = kvtier.Tier(segment=segname, role="rank", rank=0, world=WORLD, instance=0,
                        groups=s_groups(), chunk_tokens=CHUNK_TOKENS, dma="host",
                        model="kvtier-pytest")
        try:
            with pytest.raises(kvtier.KvtierError) as e:
                t.order_after(0)
            assert e.value.errno == errno.EPERM
            t.register_kv(groups=[kv_cache(seed=3)])
            assert t.order_after(0) is None
            keys = s.hash_tokens(prompt(2, seed=4))
            op = t.save(keys, block_table(2, seed=4))
            op.wait()
            assert op.count == 2
        finally:
            t.close()


def s_groups():
    from kvt_testlib import groups
    return groups(False)


def test_library_lines_through_the_callers_logger(segname, capfd, monkeypatch):
    """log=: the library's own lines (the arena's placement, the DMA
    backend's) reach the caller's logger, at logging's levels, and not
    stderr; without it they are on stderr as before; a logger that raises
    does not break the library."""
    from kvt_testlib import groups
    monkeypatch.setenv("KVTIER_LOG_LEVEL", "info")
    got = []
    s = kvtier.Tier(segment=segname, role="scheduler", world=WORLD, instance=0,
                    groups=groups(False), chunk_tokens=CHUNK_TOKENS, create=True, replace=True,
                    n_slots=64, model="kvtier-pytest", log=lambda lv, m: got.append((lv, m)))
    try:
        t = kvtier.Tier(segment=segname, role="rank", rank=0, world=WORLD, instance=0,
                        groups=groups(False), chunk_tokens=CHUNK_TOKENS, dma="host",
                        model="kvtier-pytest", log=lambda lv, m: got.append((lv, m)))
        t.register_kv(groups=[kv_cache()])
        t.close()

        def boom(lv, m):
            raise RuntimeError("a broken logger")
        t = kvtier.Tier(segment=segname, role="rank", rank=1, world=WORLD, instance=0,
                        groups=groups(False), chunk_tokens=CHUNK_TOKENS, dma="host",
                        model="kvtier-pytest", log=boom)
        t.register_kv(groups=[kv_cache()])
        t.close()
        with pytest.raises(kvtier.KvtierError, match="log="):
            kvtier.Tier(segment=segname, role="client", log="stderr")
    finally:
        s.close()
    err = capfd.readouterr().err
    assert any(lv == 20 and m.startswith("arena on node") for lv, m in got), got
    assert any(lv == 20 and m.startswith("dma: ") for lv, m in got), got
    assert "kvtier: arena on node" not in err and "kvtier dma:" not in err, err
    # without a logger: stderr, as before
    with scheduler(segname) as s2:
        pass
    assert "kvtier: arena on node" in capfd.readouterr().err
