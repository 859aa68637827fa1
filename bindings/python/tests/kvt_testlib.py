"""Geometry and helpers shared by the tests and their spawned workers."""

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
PKG_ROOT = os.path.dirname(HERE)            # bindings/python
REPO_ROOT = os.path.dirname(os.path.dirname(PKG_ROOT))

if os.environ.get("KVTIER_TEST_INSTALLED") != "1" and PKG_ROOT not in sys.path:
    sys.path.insert(0, PKG_ROOT)

import numpy as np  # noqa: E402

import kvtier  # noqa: E402

# The geometry of the tests: a TP4 model whose per-rank KV cache is laid out
# like vLLM's, one [num_blocks, block_size, heads, head_dim] array per layer
# (K and V of a layer are two such arrays).
WORLD = 4
CHUNK_TOKENS = 64
BLOCK_SIZE = 16                      # tokens per block: 4 blocks per chunk
HEADS = 2                            # KV heads per rank (8 in all, TP4)
HEAD_DIM = 32
DTYPE = np.float16
N_LAYERS = 6                         # 3 transformer layers x (K, V)
N_BLOCKS = 64
BYTES_PER_TOKEN = HEADS * HEAD_DIM * np.dtype(DTYPE).itemsize
BLOCKS_PER_CHUNK = CHUNK_TOKENS // BLOCK_SIZE


def groups(replicated=False):
    return [kvtier.Group(N_LAYERS, BYTES_PER_TOKEN, BLOCK_SIZE, replicated)]


def kv_cache(seed=None):
    """Per-layer arrays; random bytes when seeded, zeros otherwise."""
    shape = (N_BLOCKS, BLOCK_SIZE, HEADS, HEAD_DIM)
    if seed is None:
        return [np.zeros(shape, DTYPE) for _ in range(N_LAYERS)]
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 1 << 16, size=shape, dtype=np.uint16).view(DTYPE)
            for _ in range(N_LAYERS)]


def blocks_equal(a_layers, a_blocks, b_layers, b_blocks):
    for a, b in zip(a_layers, b_layers):
        if a[np.asarray(a_blocks)].tobytes() != b[np.asarray(b_blocks)].tobytes():
            return False
    return True


def segment_paths(name):
    """Where a segment named `name` may live: POSIX shm, or a hugetlbfs
    mount (the library puts a segment it creates on huge pages when a
    mount has enough free ones)."""
    dirs = ["/dev/shm"]
    try:
        with open("/proc/mounts") as f:
            dirs += [ln.split()[1] for ln in f if len(ln.split()) > 2
                     and ln.split()[2] == "hugetlbfs"]
    except OSError:
        pass
    return [os.path.join(d, "kvtier." + name) for d in dirs]


def remove_segment(name):
    for p in segment_paths(name):
        try:
            os.unlink(p)
        except FileNotFoundError:
            pass


def scheduler(name, replicated=False, n_slots=256, create=True):
    """The scheduler of instance 0; with create, the segment's owner."""
    return kvtier.Tier(segment=name, role="scheduler", world=WORLD, instance=0,
                       groups=groups(replicated), chunk_tokens=CHUNK_TOKENS,
                       create=create, replace=create, n_slots=n_slots if create else 0,
                       model="kvtier-pytest")


def rank(name, r, kv, replicated=False):
    """Rank r of instance 0 with its KV cache registered (host DMA)."""
    t = kvtier.Tier(segment=name, role="rank", rank=r, world=WORLD, instance=0,
                    groups=groups(replicated), chunk_tokens=CHUNK_TOKENS, dma="host",
                    model="kvtier-pytest")
    try:
        t.register_kv(groups=[kv])
    except BaseException:
        t.close()
        raise
    return t


def prompt(n_chunks, seed=0, tail=17):
    """A token sequence of n_chunks full chunks plus a partial tail."""
    rng = np.random.default_rng(1000 + seed)
    return rng.integers(0, 150000, size=n_chunks * CHUNK_TOKENS + tail).astype(np.uint32)


def block_table(n_chunks, seed, half=0):
    """Scattered, distinct block ids, as an engine's block table is, from the
    first (half=0) or the second (half=1) half of the cache, so a save table
    and a load table into the same cache never overlap."""
    rng = np.random.default_rng(2000 + seed)
    h = N_BLOCKS // 2
    assert n_chunks * BLOCKS_PER_CHUNK <= h
    return (half * h + rng.permutation(h)[: n_chunks * BLOCKS_PER_CHUNK]).astype(np.uint32)
