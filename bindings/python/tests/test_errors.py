"""Errors from Python: KvtierError carries the code and the library's
message naming the field or variable that was wrong."""

import errno
import pickle

import numpy as np
import pytest

import kvtier
from kvt_testlib import (BLOCK_SIZE, BYTES_PER_TOKEN, CHUNK_TOKENS, N_LAYERS, WORLD,
                         block_table, groups, kv_cache, prompt, rank, scheduler)


def _open_rank(name, **kw):
    args = dict(segment=name, role="rank", rank=0, world=WORLD, groups=groups(),
                chunk_tokens=CHUNK_TOKENS, dma="host", model="kvtier-pytest")
    args.update(kw)
    return kvtier.Tier(**args)


def test_no_segment(segname):
    with pytest.raises(kvtier.KvtierError) as ei:
        _open_rank(segname)
    e = ei.value
    assert e.code == -errno.ENOENT and e.errno == errno.ENOENT and e.name == "ENOENT"
    assert e.func == "kvt_open_v" and e.message and e.strerror
    assert segname in str(e) or "attach" in str(e)


def test_rank_out_of_range_names_the_field(segname):
    with scheduler(segname):
        with pytest.raises(kvtier.KvtierError) as ei:
            _open_rank(segname, rank=WORLD)
        assert ei.value.code == -errno.EINVAL
        assert "RANK" in ei.value.message.upper()
        assert "world" in ei.value.message.lower()


def test_world_mismatch_names_the_field(segname):
    with scheduler(segname):
        with pytest.raises(kvtier.KvtierError) as ei:
            _open_rank(segname, world=2)
        assert ei.value.code in (-errno.EINVAL, -errno.ESTALE)
        assert "world" in ei.value.message.lower()


def test_binding_side_checks(segname):
    with pytest.raises(kvtier.KvtierError) as ei:
        _open_rank(segname, rank=-1)
    assert ei.value.code == -errno.EINVAL and "rank=-1" in ei.value.message
    with pytest.raises(kvtier.KvtierError) as ei:
        _open_rank(segname, world=0)
    assert "world=0" in ei.value.message
    with pytest.raises(kvtier.KvtierError) as ei:
        _open_rank(segname, role="leader")
    assert "role" in ei.value.message
    with pytest.raises(kvtier.KvtierError):
        _open_rank(segname, replace=True)              # replace without create


def test_bad_env_values_name_the_variable(segname, monkeypatch):
    with scheduler(segname):
        monkeypatch.setenv("KVTIER_WORLD", "four")
        with pytest.raises(kvtier.KvtierError) as ei:
            _open_rank(segname, world=None)
        assert ei.value.code == -errno.EINVAL and "KVTIER_WORLD" in ei.value.message
        assert "four" in ei.value.message
        monkeypatch.setenv("KVTIER_WORLD", "4")
        monkeypatch.setenv("KVTIER_DMA", "gpu")
        with pytest.raises(kvtier.KvtierError) as ei:
            _open_rank(segname, world=None, dma=None)
        assert "KVTIER_DMA" in ei.value.message
        monkeypatch.delenv("KVTIER_DMA")
        monkeypatch.setenv("KVTIER_RANK", "-3")
        with pytest.raises(kvtier.KvtierError) as ei:
            _open_rank(segname, rank=None)
        assert "KVTIER_RANK" in ei.value.message
        monkeypatch.delenv("KVTIER_RANK")
        for bad in ("0", "65", "many", ""):
            monkeypatch.setenv("KVTIER_COPY_THREADS", bad)
            with pytest.raises(kvtier.KvtierError) as ei:
                _open_rank(segname)
            assert "KVTIER_COPY_THREADS" in ei.value.message, bad
        monkeypatch.setenv("KVTIER_COPY_THREADS", "2")
        with _open_rank(segname) as t:
            assert t.world == WORLD
        monkeypatch.delenv("KVTIER_COPY_THREADS")
        # the copy kernel's crossover: auto, off, or a page size
        for bad in ("", "on", "0", "28X", "2G", "-1", "K"):
            monkeypatch.setenv("KVTIER_COPY_KERNEL", bad)
            with pytest.raises(kvtier.KvtierError) as ei:
                _open_rank(segname)
            assert "KVTIER_COPY_KERNEL" in ei.value.message, bad
        for good in ("auto", "off", "28K", "64k", "1M", "4096"):
            monkeypatch.setenv("KVTIER_COPY_KERNEL", good)
            with _open_rank(segname) as t:
                assert t.world == WORLD
        monkeypatch.delenv("KVTIER_COPY_KERNEL")
        for bad in ("0", "1025", "x"):
            monkeypatch.setenv("KVTIER_COPY_KERNEL_CTAS", bad)
            with pytest.raises(kvtier.KvtierError) as ei:
                _open_rank(segname)
            assert "KVTIER_COPY_KERNEL_CTAS" in ei.value.message, bad
        monkeypatch.delenv("KVTIER_COPY_KERNEL_CTAS")
        # registration and close settings
        for var, bads, goods in (
                ("KVTIER_REGISTER", ("", "bg", "Background"), ("background", "foreground")),
                ("KVTIER_REGISTER_PIECE", ("", "0", "65G", "1T", "x"), ("1G", "256M", "64G")),
                ("KVTIER_CLOSE_TIMEOUT", ("0", "86401", "soon"), ("1", "600"))):
            for bad in bads:
                monkeypatch.setenv(var, bad)
                with pytest.raises(kvtier.KvtierError) as ei:
                    _open_rank(segname)
                assert var in ei.value.message, (var, bad)
            for good in goods:
                monkeypatch.setenv(var, good)
                with _open_rank(segname) as t:
                    assert t.world == WORLD
            monkeypatch.delenv(var)
        # no_env: the same variables are ignored
        monkeypatch.setenv("KVTIER_WORLD", "nonsense")
        with _open_rank(segname, no_env=True) as t:
            assert t.world == WORLD
        # and from the environment when they are right
        monkeypatch.setenv("KVTIER_WORLD", "4")
        monkeypatch.setenv("KVTIER_RANK", "2")
        monkeypatch.setenv("KVTIER_SEGMENT", segname)
        monkeypatch.setenv("KVTIER_ROLE", "rank")
        with kvtier.Tier(groups=groups(), chunk_tokens=CHUNK_TOKENS, dma="host",
                         model="kvtier-pytest") as t:
            assert t.role == "rank" and t.world == WORLD


def test_second_attach_of_a_rank_is_busy(segname):
    with scheduler(segname), _open_rank(segname):
        with pytest.raises(kvtier.KvtierError) as ei:
            _open_rank(segname)
        assert ei.value.code == -errno.EBUSY


def test_other_model_is_stale(segname):
    with scheduler(segname):
        with pytest.raises(kvtier.KvtierError) as ei:
            _open_rank(segname, model="another-model")
        assert ei.value.code == -errno.ESTALE
        # the message names the field and both sides' model descriptions:
        # the segment's (its header keeps its creator's) and this process's
        msg = str(ei.value)
        assert "model name: the segment's 'kvtier-pytest', this process's 'another-model'" in msg, msg
        assert "chunk_tokens" not in msg, msg


def test_other_layout_names_the_fields(segname):
    """A rank whose chunk size and layer shape differ from the segment's (an
    engine started with another block size or model than kvtierd): each
    differing field, with both values."""
    with scheduler(segname):
        with pytest.raises(kvtier.KvtierError) as ei:
            kvtier.Tier(segment=segname, role="rank", rank=0, world=WORLD, instance=0,
                        groups=[kvtier.Group(N_LAYERS, 2 * BYTES_PER_TOKEN, BLOCK_SIZE)],
                        chunk_tokens=2 * CHUNK_TOKENS, model="kvtier-pytest")
        msg = str(ei.value)
        assert ei.value.code == -errno.ESTALE
        assert "chunk_tokens: the segment's %d, this process's %d" % (
            CHUNK_TOKENS, 2 * CHUNK_TOKENS) in msg, msg
        assert "group 0 bytes per token: the segment's %d, this process's %d" % (
            BYTES_PER_TOKEN, 2 * BYTES_PER_TOKEN) in msg, msg
        assert "model:" not in msg and "layers:" not in msg, msg


def test_operation_errors(segname):
    with scheduler(segname) as s:
        keys = s.hash_tokens(prompt(2))
        with _open_rank(segname) as t:
            # nothing registered yet
            with pytest.raises(kvtier.KvtierError) as ei:
                t.save(keys, block_table(2, 0))
            assert ei.value.code == -errno.EPERM
            kv = kv_cache(seed=1)
            t.register_kv(groups=[kv])
            with pytest.raises(kvtier.KvtierError) as ei:
                t.register_kv(groups=[kv])
            assert ei.value.code == -errno.EALREADY
            # a short block table is refused before C reads past it
            with pytest.raises(kvtier.KvtierError) as ei:
                t.save(keys, block_table(1, 0))
            assert "block table" in ei.value.message
            # a block id past the cache: refused by the library
            bad = block_table(2, 0).copy()
            bad[3] = 10_000
            with pytest.raises(kvtier.KvtierError):
                t.save(keys, bad).wait()
            # not a lease id; a lease no longer live; more chunks than it holds
            with pytest.raises(kvtier.KvtierError) as ei:
                t.load(12345, block_table(1, 0), n=1)
            assert ei.value.code in (-errno.EINVAL, -errno.ESTALE)
            with kvtier.Tier(segment=segname, role="client", world=WORLD, groups=groups(),
                             chunk_tokens=CHUNK_TOKENS, dma="host", model="kvtier-pytest") as c:
                c.register_kv(groups=[kv_cache(seed=2)])
                assert c.save(keys[:1], block_table(1, 0)).wait()
            for r in range(1, WORLD):
                with rank(segname, r, kv_cache(seed=3)) as other:
                    assert other.save(keys[:1], block_table(1, 0)).wait()
            lease = s.lookup(keys)
            assert lease.hits == 1
            with pytest.raises(kvtier.KvtierError) as ei:
                t.load(lease, block_table(2, 0), n=2)
            assert ei.value.code == -errno.EINVAL
            assert lease.release()
            with pytest.raises(kvtier.KvtierError) as ei:
                t.load(lease, block_table(1, 0))
            assert ei.value.code == -errno.ESTALE
            with pytest.raises(kvtier.KvtierError):
                t.load(12345, block_table(1, 0))          # n needed with an id
        with pytest.raises(kvtier.KvtierError) as ei:
            s.register_kv(groups=[kv_cache()])
        assert ei.value.code == -errno.EPERM
    with pytest.raises(kvtier.KvtierError) as ei:
        s.stats()                                         # closed
    assert ei.value.code == -errno.ESTALE


def test_register_shape_checks(segname):
    with scheduler(segname), _open_rank(segname) as t:
        kv = kv_cache()
        with pytest.raises(kvtier.KvtierError, match="layers"):
            t.register_kv(groups=[kv[:-1]])
        wrong = [np.zeros((64, 16, 4, 32), np.float16)] * len(kv)
        with pytest.raises(kvtier.KvtierError, match="bytes"):
            t.register_kv(groups=[wrong])
        strided = [np.zeros((64, 16, 2, 64), np.float16)[..., ::2] for _ in kv]
        with pytest.raises(kvtier.KvtierError, match="contiguous"):
            t.register_kv(groups=[strided])
        ro = [a.copy() for a in kv]
        ro[0].flags.writeable = False
        with pytest.raises(kvtier.KvtierError, match="read-only"):
            t.register_kv(groups=[ro])
        with pytest.raises(TypeError):
            t.register_kv(groups=[["not an array"] * len(kv)])
        t.register_kv(groups=[kv])                       # and the right one works


def test_error_object():
    e = kvtier.KvtierError(-errno.EINVAL, "config.world: 0", kvtier.strerror(-errno.EINVAL),
                           "kvt_open_v")
    assert e.code == -22 and e.errno == 22 and e.name == "EINVAL"
    assert "config.world: 0" in str(e) and "EINVAL" in str(e) and "kvt_open_v" in str(e)
    e2 = pickle.loads(pickle.dumps(e))                  # crosses multiprocessing queues
    assert (e2.code, e2.message, e2.strerror, e2.func) == (e.code, e.message, e.strerror,
                                                           e.func)
    assert kvtier.strerror(-errno.ENOSPC)
    assert kvtier.strerror(0)


def test_tier_is_not_picklable(segname):
    with scheduler(segname) as s:
        with pytest.raises(TypeError):
            pickle.dumps(s)


def test_rank_save_and_load_through_context_managers(segname):
    """Closing a tier with an op in flight is safe (kvt_close waits)."""
    with scheduler(segname) as s:
        keys = s.hash_tokens(prompt(2, seed=9))
        kv = kv_cache(seed=9)
        t = rank(segname, 0, kv)
        t.save(keys, block_table(2, 9))                  # not waited
        t.close()
        assert t.closed
        t.close()                                        # idempotent
        # the copies landed before close returned: rank 0's shards are
        # written (a new rank 0 has nothing to save) and wait for the others
        with rank(segname, 0, kv) as t:
            assert t.save(keys, block_table(2, 9)).count == 0
        st = s.stats()
        assert st["saved_chunks"] == 2 and st["slots_filling"] == 2


def test_attach_names_the_path_and_the_variable(segname, monkeypatch):
    monkeypatch.setenv("KVTIER_SEGMENT_DIR", "/nonexistent-kvtier-dir")
    with pytest.raises(kvtier.KvtierError) as ei:
        kvtier.Tier(segment=segname, role="scheduler", world=WORLD)
    m = ei.value.message
    assert "/nonexistent-kvtier-dir/kvtier.%s" % segname in m
    assert "KVTIER_SEGMENT_DIR=/nonexistent-kvtier-dir" in m and ei.value.name == "ENOENT"


def test_unlink(segname):
    with scheduler(segname):
        pass
    kvtier.unlink(segname)
    with pytest.raises(kvtier.KvtierError) as ei:
        kvtier.Tier(segment=segname, role="scheduler", world=WORLD)
    assert ei.value.name == "ENOENT"
    with pytest.raises(kvtier.KvtierError) as ei:
        kvtier.unlink(segname)
    assert ei.value.name == "ENOENT" and segname in ei.value.message
    with pytest.raises(kvtier.KvtierError) as ei:
        kvtier.unlink("a/b")
    assert ei.value.name == "EINVAL"


def test_names_with_nul_are_refused(segname):
    """C reads a string up to its NUL: "a\\0b" would have opened "a"."""
    for kw in (dict(segment=segname + "\0x"), dict(model="m\0odel"),
               dict(segment_dir="/dev/shm\0/x")):
        with pytest.raises(kvtier.KvtierError) as ei:
            _open_rank(segname, **kw)
        assert "NUL" in ei.value.message and ei.value.name == "EINVAL"


def test_warnings_name_what_is_ignored(segname, monkeypatch, capfd, tmp_path):
    # KVTIER_RANK for a scheduler: not an error, but not silent either
    monkeypatch.setenv("KVTIER_RANK", "3")
    with scheduler(segname):
        pass
    assert "KVTIER_RANK=3 is ignored" in capfd.readouterr().err
    monkeypatch.delenv("KVTIER_RANK")
    # a segment directory on a disk filesystem (the test's tmp dir is one
    # here; skipped where it is tmpfs)
    import subprocess
    fs = subprocess.run(["stat", "-f", "-c", "%T", str(tmp_path)], capture_output=True,
                        text=True).stdout.strip()
    if fs in ("tmpfs", "hugetlbfs", "ramfs"):
        pytest.skip("the tmp dir is on %s" % fs)
    with kvtier.Tier(segment=segname, role="scheduler", world=WORLD, groups=groups(),
                     chunk_tokens=CHUNK_TOKENS, create=True, replace=True, n_slots=16,
                     model="kvtier-pytest", segment_dir=str(tmp_path)):
        pass
    assert "is not tmpfs or hugetlbfs" in capfd.readouterr().err


def test_directory_at_the_name_is_named_with_its_path(segname, monkeypatch):
    """A directory squatting the segment's name in /dev/shm: the messages
    give its full path (create with replace printed '/kvtier.<name>')."""
    import os
    monkeypatch.setenv("KVTIER_HUGEPAGES", "off")
    monkeypatch.delenv("KVTIER_SEGMENT_DIR", raising=False)
    path = "/dev/shm/kvtier." + segname
    os.mkdir(path)
    try:
        for kw in (dict(create=True), dict(create=True, replace=True), {}):
            with pytest.raises(kvtier.KvtierError) as ei:
                _open_rank(segname, role="scheduler", rank=None, **kw)
            assert path in ei.value.message, (kw, ei.value.message)
    finally:
        os.rmdir(path)
