"""The hot path: hash_keys into one contiguous key buffer, every token form
(zero-copy where the memory is 32-bit), lookup and save taking the buffer
straight, and the same keys as the Key-object path and the C library."""

import array
import ctypes

import numpy as np
import pytest

import kvtier
from kvt_testlib import CHUNK_TOKENS, WORLD, block_table, kv_cache, prompt, rank, scheduler

N = 6


def test_hash_keys_is_one_buffer_with_the_keys_of_hash_tokens(segname):
    with scheduler(segname) as s:
        toks = prompt(N, seed=40)
        k = s.hash_keys(toks)
        assert isinstance(k, np.ndarray) and k.dtype == np.uint64 and k.shape == (N, 2)
        assert k.flags.c_contiguous
        objs = s.hash_tokens(toks)
        assert [kvtier.Key(int(lo), int(hi)) for lo, hi in k] == objs
        # the same through the C library's own prototype, byte for byte
        out = (kvtier._lib.kvt_key * N)()
        r = kvtier._lib.lib().kvt_hash_tokens(
            s._h, toks.ctypes.data_as(ctypes.POINTER(ctypes.c_uint32)), toks.size, None, out, N)
        assert r == N and bytes(out) == k.tobytes()


def test_every_token_form_gives_the_same_keys(segname):
    with scheduler(segname) as s:
        toks = prompt(N, seed=41)
        ref = s.hash_keys(toks).tobytes()
        forms = [
            toks,                                   # uint32: read in place
            toks.astype(np.int32),                  # int32: the same bits, in place
            toks.astype(np.int64),                  # converted
            toks.astype(np.uint16 if toks.max() < 65536 else np.uint32),
            toks.tolist(),                          # list: through array.array
            tuple(toks.tolist()),
            array.array("I", toks.tolist()),        # in place
            array.array("i", toks.tolist()),
            memoryview(array.array("I", toks.tolist())),
            np.ascontiguousarray(np.stack([toks, toks], 1))[:, 0],  # strided: copied
        ]
        for f in forms:
            assert s.hash_keys(f).tobytes() == ref, type(f)


def test_uint32_memory_is_not_copied(segname):
    """The C code reads the caller's memory: a token changed between two
    calls on one array changes the keys (no stale copy)."""
    with scheduler(segname) as s:
        toks = prompt(N, seed=42)
        a = s.hash_keys(toks)
        toks[3 * CHUNK_TOKENS] ^= 1
        b = s.hash_keys(toks)
        assert (a[:3] == b[:3]).all() and (a[3:] != b[3:]).all(1).all()


def test_parent_forms_and_out(segname):
    with scheduler(segname) as s:
        toks = prompt(N, seed=43)
        k = s.hash_keys(toks)
        tail = toks[2 * CHUNK_TOKENS:]
        for parent in (k[1], kvtier.Key(int(k[1][0]), int(k[1][1])),
                       (int(k[1][0]), int(k[1][1])), k[1].tobytes(),
                       k.view(kvtier.KEY_DTYPE).reshape(-1)[1]):
            assert (s.hash_keys(tail, parent=parent) == k[2:]).all()
        out = np.zeros((10, 2), np.uint64)
        got = s.hash_keys(toks, out=out)
        assert got.base is out and (out[:N] == k).all() and not out[N:].any()
        small = np.zeros((2, 2), np.uint64)
        assert (s.hash_keys(toks, out=small) == k[:2]).all()
        with pytest.raises(kvtier.KvtierError) as e:
            s.hash_keys(toks, out=np.zeros((2, 2), np.uint32))
        assert "out" in e.value.message
        with pytest.raises(kvtier.KvtierError) as e:
            s.hash_keys(toks, parent=b"short")
        assert "16 bytes" in e.value.message


def test_bad_tokens_are_refused(segname):
    with scheduler(segname) as s:
        for bad, what in (([1, -1] * CHUNK_TOKENS, "uint32"),
                          ([1 << 32] * CHUNK_TOKENS, "uint32"),
                          (np.full(CHUNK_TOKENS, -1, np.int64), "uint32"),
                          (np.zeros((2, CHUNK_TOKENS), np.uint32), "one-dimensional"),
                          (np.zeros(CHUNK_TOKENS, np.float32), "integers")):
            with pytest.raises(kvtier.KvtierError) as e:
                s.hash_keys(bad)
            assert what in e.value.message and e.value.name == "EINVAL"
        with pytest.raises(TypeError):
            s.hash_keys(["a"] * CHUNK_TOKENS)
        with pytest.raises(TypeError):   # bytes are not ids (they were read as raw u32)
            s.hash_keys(bytes(4 * CHUNK_TOKENS))
        assert s.hash_keys([]).shape == (0, 2)
        assert s.hash_keys(prompt(0)).shape == (0, 2)


def test_key_buffers_through_lookup_and_save(segname):
    src = [kv_cache(seed=60 + r) for r in range(WORLD)]
    with scheduler(segname) as s:
        keys = s.hash_keys(prompt(N, seed=44))
        tab = block_table(N, seed=44)
        ranks = [rank(segname, r, src[r]) for r in range(WORLD)]
        try:
            for t in ranks:
                assert t.save(keys[:4], tab).wait()       # a row slice: still contiguous
        finally:
            for t in ranks:
                t.close()
        forms = [keys, keys.view(kvtier.KEY_DTYPE).reshape(-1), keys.tobytes(),
                 bytearray(keys.tobytes()), memoryview(keys.tobytes()),
                 np.asfortranarray(keys),                  # not contiguous: copied
                 s.hash_tokens(prompt(N, seed=44))]
        for f in forms:
            with s.lookup(f) as lease:
                assert lease.hits == 4, type(f)
        with s.lookup(keys[2:]) as lease:                 # keys 2.. (prefix chain broken
            assert lease.hits == 2                        # only by the lookup's start)
        with s.lookup(b"") as lease:
            assert lease.hits == 0
        assert s.stats()["leases_live"] == 0
        fk = memoryview(np.asfortranarray(np.zeros((2, 16), np.uint8)))
        with pytest.raises(kvtier.KvtierError) as e:   # not C-contiguous: refused
            s.lookup(fk)
        assert "C-contiguous" in e.value.message
        for bad, what in ((np.zeros((3, 3), np.uint64), "shape"),
                          (np.zeros((3, 2), np.int32), "dtype"),
                          (b"x" * 17, "16 bytes per key")):
            with pytest.raises(kvtier.KvtierError) as e:
                s.lookup(bad)
            assert what in e.value.message
