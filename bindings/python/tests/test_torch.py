"""CPU torch tensors as the KV cache (through data_ptr()); skipped where
torch is not installed (Debian's python3-torch is optional)."""

import os

import pytest

import kvtier
from kvt_testlib import (BLOCK_SIZE, CHUNK_TOKENS, HEAD_DIM, HEADS, N_BLOCKS, N_LAYERS,
                         WORLD, block_table, groups, prompt, rank, scheduler)

torch = pytest.importorskip("torch")


def _cache(seed=None):
    shape = (N_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    if seed is None:
        return [torch.zeros(shape, dtype=torch.float16) for _ in range(N_LAYERS)]
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=g).to(torch.float16) for _ in range(N_LAYERS)]


def test_torch_cycle(segname):
    src = [_cache(seed=r) for r in range(WORLD)]
    dst = [_cache() for _ in range(WORLD)]
    with scheduler(segname) as s:
        toks = torch.from_numpy(prompt(3, seed=11).astype("int64"))
        keys = s.hash_tokens(toks)
        assert keys == s.hash_tokens(toks.numpy())
        save_tab = torch.from_numpy(block_table(3, seed=11).astype("int32"))
        ranks = [rank(segname, r, src[r]) for r in range(WORLD)]
        try:
            for t in ranks:
                assert t.save(keys, save_tab).wait()
        finally:
            for t in ranks:
                t.close()
        load_tab = block_table(3, seed=12, half=1)
        ranks = [rank(segname, r, dst[r]) for r in range(WORLD)]
        try:
            with s.lookup(keys) as lease:
                assert lease.hits == 3
                for t in ranks:
                    t.load(lease, load_tab).wait()
        finally:
            for t in ranks:
                t.close()
        si = save_tab.long()
        li = torch.from_numpy(load_tab.astype("int64"))
        for r in range(WORLD):
            for a, b in zip(src[r], dst[r]):
                assert torch.equal(a[si].view(torch.int16), b[li].view(torch.int16))


def test_torch_views_like_vllm(segname):
    """vLLM's flash-attention cache is one [2, num_blocks, block_size, heads,
    head_dim] tensor per layer: K and V are its two views, registered as
    two 'layers' with the tensor's block stride."""
    layers = [torch.zeros((2, N_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM), dtype=torch.float16)
              for _ in range(N_LAYERS // 2)]
    views = [kv[i] for kv in layers for i in (0, 1)]
    with scheduler(segname):
        with rank(segname, 0, views) as t:
            assert t.stats()["chunk_tokens"] == CHUNK_TOKENS
    assert groups()[0].n_layers == len(views)
    with pytest.raises(kvtier.KvtierError, match="contiguous"):
        bad = [torch.zeros((N_BLOCKS, HEADS, BLOCK_SIZE, HEAD_DIM),
                           dtype=torch.float16).transpose(1, 2) for _ in range(N_LAYERS)]
        with scheduler(segname, create=False):
            rank(segname, 0, bad)


def test_torch_tokens_and_key_buffers(segname):
    """Token ids as vLLM keeps them (int64 tensors) and as int32 tensors
    (read in place) give the same keys; the key buffer of hash_keys goes
    straight into lookup."""
    with scheduler(segname) as s:
        ids = prompt(4, seed=13)
        ref = s.hash_keys(ids)
        t32 = torch.from_numpy(ids.astype("int32"))
        t64 = torch.from_numpy(ids.astype("int64"))
        assert (s.hash_keys(t32) == ref).all() and (s.hash_keys(t64) == ref).all()
        assert (s.hash_keys(t64[::1]) == ref).all()
        assert (s.hash_keys(torch.from_numpy(ids.astype("int64"))[: 2 * CHUNK_TOKENS])
                == ref[:2]).all()
        with s.lookup(s.hash_keys(t32)) as lease:
            assert lease.hits == 0


def test_torch_without_numpy(segname, tmp_path):
    """A CUDA image's torch may come without numpy (bench/gpu/engine_check.py
    runs there): token and block tensors then go through lists, giving the
    same keys and the same copies (torch's .numpy() raised before)."""
    import subprocess
    import sys
    code = """
import sys, torch
sys.modules["numpy"] = None          # torch imported first: it may use it
sys.path.insert(0, %r)
import kvtier
from kvtier import _tier
assert _tier._np is None
s = kvtier.Tier(segment=%r, role="scheduler", world=1, instance=0,
                groups=[kvtier.Group(2, 64, 16)], chunk_tokens=16, create=True,
                replace=True, n_slots=16, model="kvtier-pytest")
toks = list(range(1000, 1064))
ref = s.hash_tokens(toks)
assert s.hash_tokens(torch.tensor(toks)) == ref
assert s.hash_tokens(torch.tensor(toks, dtype=torch.int32)) == ref
kv = [torch.arange(8 * 512, dtype=torch.int16).view(8, 16, 32) + i for i in range(2)]
r = kvtier.Tier(segment=%r, role="rank", rank=0, world=1, instance=0,
                groups=[kvtier.Group(2, 64, 16)], chunk_tokens=16, dma="host",
                model="kvtier-pytest")
r.register_kv(layers=kv)
r.save(ref, torch.tensor([1, 2, 3, 4])).wait()
with s.lookup(ref) as lease:
    assert lease.hits == 4
    r.load(lease, torch.tensor([5, 6, 7, 0], dtype=torch.int64)).wait()
for t in kv:
    assert torch.equal(t[[5, 6, 7, 0]], t[[1, 2, 3, 4]])
r.close()
s.close()
print("ok")
""" % (os.path.dirname(os.path.dirname(kvtier.__file__)), segname, segname)
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]
