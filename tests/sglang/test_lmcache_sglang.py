"""kvtierd's LMCache front end serving SGLang: LMCache's own SGLang
connector (lmcache.integration.sglang's LMCacheMPConnector, the pinned
wheel unpacked beside SGLang's environment by tests/lmcache/setup-engine.sh
--sglang) over SGLang's own MHATokenToKVPool on the CPU, wired as SGLang's
LMCRadixCache wires it (the pool's k_buffer and v_buffer, the page size).

A writer process stores a prompt's pages; this process -- another SGLang
pool and connector -- looks the prompt up and retrieves it into other
pages: every layer's K and V byte-exact; a retrieve whose first chunk the
radix tree holds already leaves those slots alone.  The same for an MLA
model (DeepSeek's): SGLang's MLATokenToKVPool through LMCache's unified
connector (UnifiedLMCacheMPConnector, as SGLang 0.5.23's
LMCacheUnifiedRadixCache builds it over the pool's allocator), kept once
for every rank; a DeepSeek V3.2 pool (DSATokenToKVPool: its indexer pages
beside the latent) the same, the indexer a second group of the segment.  Not run: SGLang's scheduler, radix
tree (LMCRadixCache needs SGLang's whole runtime) and model.  Run by scripts/test.sh with SGLang's environment and
KVTIER_LMCACHE_TARGET (the unpacked wheel), after tests/sglang."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TARGET = os.environ.get("KVTIER_LMCACHE_TARGET", os.path.join(REPO, "build", "sglang-lmcache"))
if TARGET not in sys.path:
    sys.path.insert(0, TARGET)
sys.path.insert(0, os.path.join(REPO, "tests", "lmcache"))
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

PAGE, LAYERS, HEADS, HEAD_DIM = 8, 3, 2, 32
BPT = HEADS * HEAD_DIM * 2       # bf16: one plane (a layer's K or V) a token
SLOTS = 512
MODEL = "org/sglang-model"


def pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    return MHATokenToKVPool(SLOTS, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                            v_head_dim=HEAD_DIM, start_layer=0, end_layer=LAYERS - 1)


def connector(kv, port):
    from lmcache.integration.sglang.multi_process_adapter import LMCacheMPConnector
    return LMCacheMPConnector(types.SimpleNamespace(model_path=MODEL), 1, 0, PAGE,
                              "tcp://127.0.0.1", port, kv.k_buffer, kv.v_buffer)


RANK, ROPE = 48, 16               # MLA: the latent and its rope part, a row a token
MLA_BPT = (RANK + ROPE) * 2       # bf16: one plane (a layer's row) a token
MLA_MODEL = "org/sglang-mla"


def mla_pool(dsa=False):
    """SGLang's MLA pool; dsa: DeepSeek V3.2's (64-token pages, the
    indexer's fp8 keys and scales a page beside the latent)."""
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool, MLATokenToKVPool
    if dsa:
        return DSATokenToKVPool(1024, 64, RANK, torch.bfloat16, ROPE, LAYERS, "cpu", 128, False,
                                RANK + ROPE, index_buf_size=1024)
    return MLATokenToKVPool(SLOTS, PAGE, torch.bfloat16, RANK, ROPE, LAYERS, "cpu", False,
                            start_layer=0, end_layer=LAYERS - 1)


def unified(kv, port, tmp):
    """LMCache's unified connector over an MLA pool, built as SGLang's
    LMCacheUnifiedRadixCache builds it: the pool's paged allocator, the
    FULL tree component, the model's attention kind; its server in the
    LMCache config file (mp_host, mp_port), lmcache_driven copies."""
    from lmcache.integration.sglang.unified_lmcache_mp_connector import \
        UnifiedLMCacheMPConnector
    from sglang.srt.configs.model_config import AttentionArch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.unified_cache.components import ComponentType
    cfg = os.path.join(tmp, "lmcache.yaml")
    with open(cfg, "w") as f:
        f.write("mp_host: 127.0.0.1\nmp_port: %d\nextra_config:\n"
                "  lmcache.mp.mp_transfer_mode: lmcache_driven\n" % port)
    model = types.SimpleNamespace(model_path=MLA_MODEL, attention_arch=AttentionArch.MLA,
                                  hf_config=types.SimpleNamespace(
                                      architectures=["DeepseekV3ForCausalLM"]))
    alloc = PagedTokenToKVPoolAllocator(kv.size, kv.page_size, torch.bfloat16, "cpu", kv, False)
    c = UnifiedLMCacheMPConnector(
        config_file=cfg, model_config=model, tp_size=1, tp_rank=0, tp_group=None,
        page_size=kv.page_size, token_to_kv_pool_allocator=alloc, req_to_token_pool=None,
        tree_components=(ComponentType.FULL,), mamba_component=None, sliding_window_size=None)
    # On the CPU, LMCache's registration moves only the tensors it is
    # handed -- the connector's page views -- into shared memory
    # (migrate_to_shm_and_wrap: "only the tensors handed in are
    # re-pointed"); the pool's own tensors are pointed at the same bytes,
    # as a GPU pool and its views share their memory.
    for i, t in enumerate(mla_tensors(kv)):
        v = c._kv_caches["kv_%d" % i]
        t.set_(v.untyped_storage(), v.storage_offset(), t.shape, t.stride())
    return c


def unified_load(c, rid, toks, dst_slots, local):
    """SGLang's load through the unified connector: the lookup polled to
    its end (hit tokens), then the load of what the radix tree lacks."""
    import time
    op = c.submit_lookup(rid, toks, local_hit_tokens=local, cache_salt="")
    end = time.monotonic() + 60
    while (hit := c.poll_lookup(op)) is None:
        assert time.monotonic() < end, "no lookup result"
        time.sleep(0.01)
    ld = c.submit_load(op, dst_slots, local_hit_tokens=local)
    ld.future.result(timeout=60)
    return hit, c.complete_load(ld)


def planes(kv):
    return list(kv.k_buffer) + list(kv.v_buffer)


def contents(seed, like):
    """The writer's pool contents, a function of the seed."""
    out = []
    for i, t in enumerate(like):
        g = torch.Generator().manual_seed(seed * 100 + i)
        if t.dtype.is_floating_point:
            out.append(torch.randn(t.shape, generator=g).to(t.dtype))
        else:   # the DSA indexer's fp8 keys and scales: bytes
            out.append(torch.randint(0, 256, t.shape, generator=g, dtype=t.dtype))
    return out


def slots(pages, page=PAGE):
    return torch.tensor([p * page + j for p in pages for j in range(page)], dtype=torch.int64)


def mla_tensors(kv):
    """An MLA pool's tensors as the unified connector registers them: the
    latent's, then (DSA) the indexer's page-native buffers."""
    return list(kv.kv_buffer) + list(kv.index_k_with_scale_buffer if kv.use_dsa else [])


def mla_pages(kv, i, t, pages):
    """Tensor i's rows of these pages (the latent's are token rows)."""
    return t[slots(pages, kv.page_size)] if i < len(kv.kv_buffer) else t[pages]


def write(port, seed, tokens, pages):
    """The writer process: its pool filled after the registration (LMCache
    moves the pool's storage into shared memory at registration), then the
    prompt's pages stored."""
    from lmcache.integration.sglang.sglang_adapter import StoreMetadata
    kv = pool()
    c = connector(kv, port)
    for t, v in zip(planes(kv), contents(seed, planes(kv))):
        t.copy_(v)
    c.store_kv(StoreMetadata(last_node=None, token_ids=tokens, kv_indices=slots(pages),
                             offset=0, request_id="w1"))
    c.close()
    print("STORED", flush=True)


def write_mla(port, seed, tokens, pages, dsa):
    """The MLA writer: its pool filled after the registration, the
    prompt's pages stored through the unified connector."""
    import tempfile
    kv = mla_pool(dsa)
    with tempfile.TemporaryDirectory() as tmp:
        c = unified(kv, port, tmp)
        for t, v in zip(mla_tensors(kv), contents(seed, mla_tensors(kv))):
            t.copy_(v)
        op = c.submit_store("w1", tokens, slots(pages, kv.page_size), device_indices_start=0,
                            cache_salt="")
        op.future.result(timeout=60)
        assert c.complete_store(op)
        c.close()
    print("STORED", flush=True)


def write_in_child(d, n_chunks, mode, seed, toks, src, *more):
    """The writer (write or write_mla) in a process of its own: its
    prompt's n_chunks stored."""
    w = subprocess.run([sys.executable, __file__, mode, str(d.port), str(seed), json.dumps(toks),
                        json.dumps(src), *more], capture_output=True, text=True, timeout=600)
    assert w.returncode == 0 and "STORED" in w.stdout, (w.stdout + w.stderr)[-4000:]
    assert d.metric("kvtier_lmcache_stored_total") == n_chunks


def test_sglang_mla_pool_served_by_kvtierd(tmp_path):
    from test_lmcache_client import CHUNK, Daemon
    d = Daemon("sgl-mla%d" % os.getpid(), layers=LAYERS, bpt=MLA_BPT, extra=["--replicated"])
    c = None
    try:
        n_chunks = 5
        toks = list(range(9000, 9000 + n_chunks * CHUNK + 3))
        span = n_chunks * CHUNK
        src = list(range(10, 10 + span // PAGE))
        write_in_child(d, n_chunks, "write_mla", 7, toks, src, "0")

        kv = mla_pool()
        c = unified(kv, d.port, str(tmp_path))
        want = [t[slots(src)] for t in contents(7, kv.kv_buffer)]
        dst = list(range(30, 30 + span // PAGE))
        for i, t in enumerate(kv.kv_buffer):   # the comparison below can fail
            assert not torch.equal(t[slots(dst)], want[i]), "layer %d" % i
        assert unified_load(c, "r1", toks, slots(dst), 0) == (span, True)
        for i, t in enumerate(kv.kv_buffer):
            assert torch.equal(t[slots(dst)], want[i]), "layer %d" % i
        c.end_session("r1")
        # the radix tree holds a chunk and a page: LMCache asks from the
        # chunk's start with the page as padding (SGLang's page 0, its
        # padding sink) and skip_first_n_tokens; page 0 is left alone
        local = CHUNK + PAGE
        dst2 = list(range(2, 2 + (span - local) // PAGE))
        sink = [t[slots([0])].clone() for t in kv.kv_buffer]
        assert unified_load(c, "r2", toks, slots(dst2), local) == (span, True)
        for i, t in enumerate(kv.kv_buffer):
            assert torch.equal(t[slots([0])], sink[i]), "layer %d" % i
            assert torch.equal(t[slots(dst2)], want[i][local:]), "layer %d" % i
        c.end_session("r2")
        assert d.metric("kvtier_lmcache_misses_total") == 0
    finally:
        if c is not None:
            c.close()
        d.close()


def test_sglang_dsa_pool_served_by_kvtierd(tmp_path):
    """DeepSeek V3.2 / GLM-5 in SGLang (DSATokenToKVPool: 64-token pages,
    the indexer's fp8 keys and scales a page beside the latent): the
    unified connector registers the latent and, as a kernel group of
    their own, the indexer's page-native buffers; kvtierd keeps them as
    the segment's second group.  Both byte-exact across processes; on a
    segment without that group, refused with the line that fits."""
    from test_lmcache_client import Daemon
    page, idx_bpt = 64, (128 + 4)      # a token's fp8 index key and its scale
    d = Daemon("sgl-dsa%d" % os.getpid(), layers=LAYERS, bpt=MLA_BPT,
               extra=["--replicated", "--chunk-tokens", str(page)])
    try:
        with pytest.raises(Exception, match="--group %d:%d --group %d:%d --replicated" % (
                LAYERS, MLA_BPT, LAYERS, idx_bpt)):
            unified(mla_pool(dsa=True), d.port, str(tmp_path))
    finally:
        d.close()
    d = Daemon("sgl-dsb%d" % os.getpid(), layers=LAYERS, bpt=MLA_BPT,
               extra=["--group", "%d:%d" % (LAYERS, idx_bpt), "--replicated",
                      "--chunk-tokens", str(page)])
    c = None
    try:
        n_chunks = 4
        toks = list(range(9500, 9500 + n_chunks * page + 3))
        src, dst = list(range(1, 1 + n_chunks)), list(range(8, 8 + n_chunks))
        write_in_child(d, n_chunks, "write_mla", 8, toks, src, "1")
        kv = mla_pool(dsa=True)
        c = unified(kv, d.port, str(tmp_path))
        ts = mla_tensors(kv)
        assert len(ts) == 2 * LAYERS
        want = [mla_pages(kv, i, t, src) for i, t in enumerate(contents(8, ts))]
        for i, t in enumerate(ts):   # the comparison below can fail
            assert not torch.equal(mla_pages(kv, i, t, dst), want[i]), "tensor %d" % i
        assert unified_load(c, "d1", toks, slots(dst, page), 0) == (n_chunks * page, True)
        for i, t in enumerate(ts):
            assert torch.equal(mla_pages(kv, i, t, dst), want[i]), "tensor %d" % i
        c.end_session("d1")
        assert d.metric("kvtier_lmcache_misses_total") == 0
    finally:
        if c is not None:
            c.close()
        d.close()


def test_sglang_pool_served_by_kvtierd():
    from lmcache.integration.sglang.sglang_adapter import LoadMetadata
    from test_lmcache_client import CHUNK, Daemon
    d = Daemon("sgl-lmc%d" % os.getpid(), layers=2 * LAYERS, bpt=BPT)
    c = None
    try:
        n_chunks = 6
        toks = list(range(7000, 7000 + n_chunks * CHUNK + 5))
        span = n_chunks * CHUNK
        src = list(range(10, 10 + span // PAGE))
        write_in_child(d, n_chunks, "write", 5, toks, src)

        kv = pool()
        c = connector(kv, d.port)
        want = [t[slots(src)] for t in contents(5, planes(kv))]
        # the whole prompt: every layer's K and V of every page, exact
        dst = list(range(40, 40 + span // PAGE))
        for i, t in enumerate(planes(kv)):   # the comparison below can fail
            assert not torch.equal(t[slots(dst)], want[i]), "plane %d" % i
        assert c.lookup_kv(toks, "r1") == span
        assert c.retrieve_kv(LoadMetadata(token_ids=toks, slot_mapping=slots(dst), offset=0,
                                          request_id="r1")) == span
        for i, t in enumerate(planes(kv)):
            assert torch.equal(t[slots(dst)], want[i]), "plane %d" % i
        c.end_session("r1")
        # the radix tree holds the first chunk: its slots are left alone
        dst2 = list(range(2, 2 + span // PAGE))
        keep = [t[slots(dst2[:CHUNK // PAGE])].clone() for t in planes(kv)]
        assert c.lookup_kv(toks, "r2") == span
        assert c.retrieve_kv(LoadMetadata(token_ids=toks, slot_mapping=slots(dst2),
                                          offset=CHUNK, request_id="r2")) == span - CHUNK
        for i, t in enumerate(planes(kv)):
            assert torch.equal(t[slots(dst2[:CHUNK // PAGE])], keep[i]), "plane %d" % i
            assert torch.equal(t[slots(dst2[CHUNK // PAGE:])], want[i][CHUNK:]), "plane %d" % i
        c.end_session("r2")
        assert d.metric("kvtier_lmcache_retrieved_total") == 2 * n_chunks - 1
        assert d.metric("kvtier_lmcache_misses_total") == 0
    finally:
        if c is not None:
            c.close()
        d.close()


if __name__ == "__main__":
    if sys.argv[1] == "write_mla":
        write_mla(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]),
                  json.loads(sys.argv[5]), sys.argv[6] == "1")
    elif sys.argv[1] == "write":
        write(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]),
              json.loads(sys.argv[5]))
