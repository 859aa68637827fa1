"""The connector's refusals, against vLLM's own config and KV-cache classes
(no engine): a process-seeded block hash, a worker whose process groups
disagree with the parallel config, bad settings."""

import errno
import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bindings", "python"))
import kvtier  # noqa: E402
import kvtier.vllm as kv  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, MLAAttentionSpec)


def kv_cache_config(mla=False, layers=2, layout="LBHNC"):
    if mla:
        spec = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    cfg = KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l%d" % i for i in range(layers)],
                                                          spec)])
    cfg.kv_cache_layout = layout   # what vLLM's engine core resolved
    return cfg


def vllm_config(tp=1, pp=1, algo="sha256", caching=True, extra=None, model="tiny",
                dtype=torch.bfloat16, cache_dtype="auto", **mc):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {}),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        data_parallel_rank=0, data_parallel_size=1),
        cache_config=SimpleNamespace(block_size=32, prefix_caching_hash_algo=algo,
                                     enable_prefix_caching=caching, cache_dtype=cache_dtype),
        model_config=SimpleNamespace(model=model, dtype=dtype, **mc))


ENGINE = ";dtype=bfloat16;kv=bfloat16;layout=LBHNC"   # the defaults' engine fields
# a stand-in settings' plan: one kvtier group on vLLM group 0
ONE_GROUP = SimpleNamespace(kgroups=[SimpleNamespace(vg=0)])


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    for k in list(os.environ):
        if k.startswith("KVTIER_") and k != "KVTIER_LIBRARY" or k == "PYTHONHASHSEED":
            monkeypatch.delenv(k)


def test_process_seeded_hash_is_refused(monkeypatch):
    with pytest.raises(ValueError) as e:
        kv._Settings(vllm_config(algo="xxhash"), kv_cache_config())
    assert "--prefix-caching-hash-algo sha256" in str(e.value)
    assert "PYTHONHASHSEED" in str(e.value)
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    kv._Settings(vllm_config(algo="xxhash"), kv_cache_config())  # deterministic now
    kv._Settings(vllm_config(algo="sha256_cbor"), kv_cache_config())


def test_key_identity_in_the_model(monkeypatch):
    """What the keys depend on besides the tokens, when it is not every
    engine's default, is in the model identity: engines that would compute
    other keys for the same tokens are refused at attach with both values
    (test_engines_with_other_hash_seeds_are_told), not kept apart silently."""
    s = kv._Settings(vllm_config(), kv_cache_config())
    assert s.model == "tiny" + ENGINE                      # no config.json: no file fields
    assert kv._Settings(vllm_config(extra={"kvtier_model": "m"}),
                        kv_cache_config()).model == "m" + ENGINE
    assert kv._Settings(vllm_config(algo="sha256_cbor"), kv_cache_config()).model == \
        "tiny" + ENGINE + ";prefix-hash=sha256_cbor"
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert kv._Settings(vllm_config(), kv_cache_config()).model == "tiny" + ENGINE + ";hashseed=7"
    assert kv._Settings(vllm_config(algo="xxhash"), kv_cache_config()).model == \
        "tiny" + ENGINE + ";prefix-hash=xxhash;hashseed=7"
    # prefix caching off: kvtier's own hash of the tokens, no seed in it
    assert kv._Settings(vllm_config(caching=False), kv_cache_config()).model == "tiny" + ENGINE


def _model(vc, kc=None):
    return kv._Settings(vc, kc or kv_cache_config()).model


def test_what_the_bytes_mean_is_in_the_model(monkeypatch):
    """Every engine-side fact that gives a chunk's bytes their meaning is a
    field of the model identity, from vLLM's own configuration: engines that
    differ in one get different fingerprints (refused at attach, other L3
    keys)."""
    base = _model(vllm_config())
    # the model's dtype
    assert ";dtype=float16;kv=float16;" in _model(vllm_config(dtype=torch.float16))
    # the KV cache's dtype, fp8 spelled one way for its two names
    e4m3 = _model(vllm_config(cache_dtype="fp8"))
    assert ";kv=fp8_e4m3/ocp;" in e4m3 and e4m3 != base
    assert _model(vllm_config(cache_dtype="fp8_e4m3")) == e4m3
    assert ";kv=fp8_e5m2/ocp;" in _model(vllm_config(cache_dtype="fp8_e5m2"))
    # MI300's FNUZ fp8 is another number in the same byte
    from vllm.platforms import current_platform
    monkeypatch.setattr(type(current_platform), "is_fp8_fnuz", classmethod(lambda c: True))
    assert ";kv=fp8_e4m3/fnuz;" in _model(vllm_config(cache_dtype="fp8"))
    monkeypatch.undo()
    # layers kept unquantized
    vc = vllm_config(cache_dtype="fp8")
    vc.cache_config.kv_cache_dtype_skip_layers = ["3", "1"]
    assert ";kv-skip=1,3;" in _model(vc)
    # the layout vLLM resolved
    assert ";layout=BLHNC" in _model(vllm_config(), kv_cache_config(layout="BLHNC"))
    # online quantization, dummy weights
    assert ";quant=fp8" in _model(vllm_config(quantization="fp8"))
    assert ";weights=dummy" in _model(vllm_config(load_config=SimpleNamespace(
        load_format="dummy")))
    # what cannot be told apart is refused
    with pytest.raises(ValueError, match="calculate_kv_scales"):
        vc = vllm_config(cache_dtype="fp8")
        vc.cache_config.calculate_kv_scales = True
        _model(vc)
    with pytest.raises(ValueError, match="not resolved the KV cache layout"):
        _model(vllm_config(), kv_cache_config(layout=None))
    with pytest.raises(ValueError, match="contains ';'"):
        _model(vllm_config(extra={"kvtier_model": "a;b"}))


def _write_model(d, config=b'{"model_type": "llama"}'):
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "config.json"), "wb") as f:
        f.write(config)
    for n in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        with open(os.path.join(d, n), "wb") as f:
            f.write(b"w" * 64)
        os.utime(os.path.join(d, n), (1700000000, 1700000000))
    return d


def test_the_models_files_are_in_the_model(tmp_path):
    """The model's config and weights: a config.json digest, and the
    snapshot's commit (Hugging Face cache) or the weight files' names,
    sizes and mtimes (a checkpoint rewritten in place is another model)."""
    d = _write_model(str(tmp_path / "m"))
    a = _model(vllm_config(model=d))
    assert a.startswith(d + ENGINE + ";weights=") and ";config=" in a
    # the same files elsewhere (a copy that keeps mtimes) and a name given:
    # the same file fields
    e = _write_model(str(tmp_path / "copy"))
    b = _model(vllm_config(model=e, extra={"kvtier_model": d}))
    assert b == a
    # the config changed
    _write_model(e, b'{"model_type": "llama", "rope_theta": 1e6}')
    assert _model(vllm_config(model=e, extra={"kvtier_model": d})).split(";config=")[1] != \
        a.split(";config=")[1]
    # the weights rewritten in place
    _write_model(e)
    os.utime(os.path.join(e, "model-00002-of-00002.safetensors"), (1700000001, 1700000001))
    c = _model(vllm_config(model=e, extra={"kvtier_model": d}))
    assert c.split(";weights=")[1] != a.split(";weights=")[1]
    assert c.split(";config=")[1] == a.split(";config=")[1]
    # a Hugging Face snapshot: its commit
    snap = str(tmp_path / "hub" / "models--org--m" / "snapshots" / ("ab12" * 10))
    _write_model(snap)
    assert ";rev=" + "ab12" * 10 + ";config=" in _model(vllm_config(model=snap))


def test_layout_and_world():
    s = kv._Settings(vllm_config(tp=4, pp=2), kv_cache_config(layers=3))
    assert s.world == 8 and not s.replicated
    g = s.groups[0]
    # each layer's block is two kvtier layers: its halves
    assert g.n_layers == 6 and g.bytes_per_token == 2 * 64 * 2 and g.tokens_per_block == 32
    m = kv._Settings(vllm_config(tp=8), kv_cache_config(mla=True))
    assert m.replicated and m.groups[0].replicated   # MLA: one copy for every rank


def test_bad_settings(monkeypatch):
    with pytest.raises(ValueError, match="multiple of vLLM's block size"):
        kv._Settings(vllm_config(extra={"kvtier_chunk_tokens": 48}), kv_cache_config())
    monkeypatch.setenv("KVTIER_INSTANCE", "")
    with pytest.raises(ValueError, match="KVTIER_INSTANCE is set but empty"):
        kv._Settings(vllm_config(), kv_cache_config())
    monkeypatch.setenv("KVTIER_INSTANCE", "two")
    with pytest.raises(ValueError, match="KVTIER_INSTANCE='two': expected int"):
        kv._Settings(vllm_config(), kv_cache_config())
    monkeypatch.delenv("KVTIER_INSTANCE")
    with pytest.raises(ValueError, match="kvtier_create"):
        kv._Settings(vllm_config(extra={"kvtier_create": "maybe"}), kv_cache_config())


def test_worker_with_the_wrong_world_fails_loudly(monkeypatch):
    """A TP 4 engine whose worker's process groups say world 1."""
    import vllm.distributed.parallel_state as ps
    monkeypatch.setattr(ps, "get_tensor_model_parallel_world_size", lambda: 1)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: 0)
    monkeypatch.setattr(ps, "get_pp_group", lambda: SimpleNamespace(world_size=1, rank_in_group=0))
    c = kv.KvtierConnector.__new__(kv.KvtierConnector)
    c._s = kv._Settings(vllm_config(tp=4), kv_cache_config())
    with pytest.raises(RuntimeError, match="world 1.*TP 4 x PP 1 = 4.*nobody reads"):
        c._worker_init()


# ---- KV cache group types: what is stored, what is refused ----

def spec_config(spec, layers=2):
    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(["l%d" % i for i in range(layers)],
                                                          spec)])
    cfg.kv_cache_layout = "LBHNC"
    return cfg


def test_group_types():
    from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, CrossAttentionSpec,
                                            SlidingWindowSpec)
    kw = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    s = kv._Settings(vllm_config(), kv_cache_config())
    assert s.windows == [None]
    s = kv._Settings(vllm_config(), spec_config(SlidingWindowSpec(sliding_window=128, **kw)))
    assert s.windows == [("sliding", 128)] and not s.replicated
    s = kv._Settings(vllm_config(), spec_config(ChunkedLocalAttentionSpec(
        attention_chunk_size=256, **kw)))
    assert s.windows == [("chunked", 256)]
    with pytest.raises(ValueError) as e:
        kv._Settings(vllm_config(), spec_config(CrossAttentionSpec(**kw)))
    assert "CrossAttentionSpec" in str(e.value) and "cannot store exactly" in str(e.value)


def test_skipped_tokens_are_vllms():
    """The connector's rule for what vLLM frees is vLLM's own
    get_num_skipped_tokens (called on its managers' code), for every n."""
    from vllm.v1.core.single_type_kv_cache_manager import (ChunkedLocalAttentionManager,
                                                           SlidingWindowManager)
    sw = SimpleNamespace(sliding_window=128, extra_retained_tokens=0)
    ch = SimpleNamespace(attention_chunk_size=96)
    for n in range(0, 700):
        assert kv._skipped_tokens(("sliding", 128), n) == \
            SlidingWindowManager.get_num_skipped_tokens(sw, n), n
        assert kv._skipped_tokens(("chunked", 96), n) == \
            ChunkedLocalAttentionManager.get_num_skipped_tokens(ch, n), n
        assert kv._skipped_tokens(None, n) == 0


class FakeTier:
    def __init__(self):
        self.steps = 0

    def step(self, live):
        self.steps += 1
        return 0

    def reap(self):
        return 0

    def release(self, lid):
        return True


def sched_connector(spec, chunk_tokens=32):
    from vllm.v1.kv_cache_interface import SlidingWindowSpec  # noqa: F401
    c = kv.KvtierConnector.__new__(kv.KvtierConnector)
    c._s = kv._Settings(vllm_config(extra={"kvtier_chunk_tokens": chunk_tokens}),
                        spec_config(spec))
    c._tier = FakeTier()
    c._stats = kv.KvtierConnectorStats()
    c._sched_state()
    c._next_reap = float("inf")
    return c


def request(rid, n):
    return SimpleNamespace(request_id=rid, num_tokens=n, all_token_ids=list(range(n)),
                           block_hashes=[bytes([i % 256]) * 32 for i in range(n // 32)])


def step_output(new=(), cached=(), scheduled=None):
    """new: (req_id, block_ids, num_computed); cached: (req_id, new_block_ids,
    num_computed)."""
    return SimpleNamespace(
        preempted_req_ids=(),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(list(b),), num_computed_tokens=n)
                            for r, b, n in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached], resumed_req_ids=(),
            new_block_ids=[(list(b),) for _, b, _ in cached],
            num_computed_tokens=[n for _, _, n in cached]),
        num_scheduled_tokens=scheduled or {})


def saved_chunks(meta, bpc=1):
    """(first chunk, its block ids) of every save in meta."""
    out = []
    for sv in meta.saves:
        n = len(sv.keys) // 16
        for i in range(n):
            out.append((sv.first_depth + i, sv.block_ids[0][i * bpc:(i + 1) * bpc]))
    return out


def test_sliding_window_saves_only_its_own_blocks():
    """The rule that fixed wrong KV on sliding-window models, step by step
    against scheduler outputs shaped as vLLM makes them: a new request's
    local hit whose blocks before the window are the null block (0) saves
    none of those; a chunked prefill saves each chunk in the step it fills
    while vLLM still holds its blocks, and a chunk whose first block vLLM
    freed (its table still names the old id) is not saved."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    spec = SlidingWindowSpec(sliding_window=128, block_size=32, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)
    c = sched_connector(spec)
    # a local hit of 320 tokens: blocks 0-5 null, 6-9 real; 64 more to compute
    req = request("a", 384)
    c._reqs["a"] = req
    meta = c.build_connector_meta(step_output(
        new=[("a", [0] * 6 + [16, 17, 18, 19, 20, 21], 320)], scheduled={"a": 64}))
    got = saved_chunks(meta)
    assert [d for d, _ in got] == [6, 7, 8, 9, 10, 11], got
    assert all(0 not in b for _, b in got)
    assert c._stats.data["save_holes"] == 6
    # 128-token chunks (4 blocks), prefill in 100-token steps: chunk 0
    # fills in step 2 (done 100: vLLM freed nothing); chunk 1 in step 3
    # (done 200: skipped 73, blocks 0-1 freed, chunk 1's 4-7 kept)
    c = sched_connector(spec, chunk_tokens=128)
    c._reqs["b"] = request("b", 500)
    tabs = list(range(40, 56))
    m1 = c.build_connector_meta(step_output(new=[("b", tabs[:4], 0)], scheduled={"b": 100}))
    assert saved_chunks(m1, 4) == []
    m2 = c.build_connector_meta(step_output(cached=[("b", tabs[4:7], 100)], scheduled={"b": 100}))
    assert saved_chunks(m2, 4) == [(0, tabs[0:4])]
    m3 = c.build_connector_meta(step_output(cached=[("b", tabs[7:10], 200)], scheduled={"b": 100}))
    assert saved_chunks(m3, 4) == [(1, tabs[4:8])]
    # one step of 400 tokens: chunks 0-2 fill in it, nothing freed before
    c = sched_connector(spec, chunk_tokens=128)
    c._reqs["d"] = request("d", 500)
    m = c.build_connector_meta(step_output(new=[("d", tabs[:13], 0)], scheduled={"d": 400}))
    assert [d for d, _ in saved_chunks(m, 4)] == [0, 1, 2]
    # 256-token chunks (8 blocks) in 100-token steps: chunk 0 fills in step
    # 3, when vLLM has already freed blocks 0-1 (skipped(200) = 73) and may
    # have given them to another request.  A hit ending at a chunk's end
    # needs only the window's tail, ceil(127 / 32) = 4 blocks (_caches.py):
    # kvtier keeps blocks 4-7 of each chunk, still the request's, and saves
    # them -- never the freed 0-1
    c = sched_connector(spec, chunk_tokens=256)
    assert [v.tail for v in c._s.plan.vgroups] == [4]
    c._reqs["e"] = request("e", 500)
    c.build_connector_meta(step_output(new=[("e", tabs[:4], 0)], scheduled={"e": 100}))
    c.build_connector_meta(step_output(cached=[("e", tabs[4:7], 100)], scheduled={"e": 100}))
    m = c.build_connector_meta(step_output(cached=[("e", tabs[7:10], 200)], scheduled={"e": 100}))
    assert saved_chunks(m, 4) == [(0, tabs[4:8])] and c._stats.data["save_holes"] == 0
    # a window longer than the part of the chunk vLLM kept: 512-token
    # chunks of a 300-token window keep all 16 blocks, and the old rule
    # (a hole where vLLM freed a block) holds
    spec = SlidingWindowSpec(sliding_window=300, block_size=32, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)
    c = sched_connector(spec, chunk_tokens=512)
    assert [v.tail for v in c._s.plan.vgroups] == [16]
    c._reqs["f"] = request("f", 900)
    tabs = list(range(40, 70))
    c.build_connector_meta(step_output(new=[("f", tabs[:13], 0)], scheduled={"f": 400}))
    m = c.build_connector_meta(step_output(cached=[("f", tabs[13:20], 400)],
                                           scheduled={"f": 200}))
    assert saved_chunks(m, 16) == [] and c._stats.data["save_holes"] == 1


def test_full_attention_saves_every_chunk():
    """Full attention: a local hit's blocks are real and kept; every full
    chunk is saved, from chunk 0, and in later steps only the new ones."""
    c = sched_connector(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                          dtype=torch.bfloat16))
    c._reqs["a"] = request("a", 384)
    meta = c.build_connector_meta(step_output(new=[("a", list(range(1, 13)), 320)],
                                              scheduled={"a": 64}))
    assert [d for d, _ in saved_chunks(meta)] == list(range(12))
    meta = c.build_connector_meta(step_output(cached=[("a", [], 384)], scheduled={"a": 1}))
    assert saved_chunks(meta) == []
    # a null block anywhere (whatever put it there) is never saved from:
    # the chunks around it go in two saves, with their own depths
    c._reqs["b"] = request("b", 384)
    meta = c.build_connector_meta(step_output(
        new=[("b", [1, 2, 3, 4, 5, 0, 7, 8, 9, 10, 11, 12], 0)], scheduled={"b": 384}))
    assert [(sv.first_depth, len(sv.keys) // 16) for sv in meta.saves] == [(0, 5), (6, 6)]
    assert all(0 not in b for _, b in saved_chunks(meta))


def test_loads_skip_the_null_block():
    """A load's table: vLLM's null block (0) becomes BLOCK_SKIP, real blocks
    stay."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    c = sched_connector(SlidingWindowSpec(sliding_window=128, block_size=32, num_kv_heads=2,
                                          head_size=64, dtype=torch.bfloat16))
    c._reqs["a"] = request("a", 740)
    blocks = [0] * 16 + [30, 31, 32, 33] + [34, 35, 36]
    c._to_load["a"] = (7, 0, 20, 0, [blocks])    # lease 7, from chunk 0, 20 chunks
    meta = c.build_connector_meta(step_output(new=[("a", blocks, 0)], scheduled={"a": 100}))
    assert len(meta.loads) == 1
    tab = meta.loads[0].block_ids[0]
    assert tab == [kv.kvtier.BLOCK_SKIP] * 16 + [30, 31, 32, 33]


class _Blocks:
    """vLLM's KVCacheBlocks as update_state_after_alloc sees them."""

    def __init__(self, *groups):
        self.groups = [list(g) for g in groups]

    def get_block_ids(self):
        return tuple(self.groups)


def test_local_hit_inside_a_chunk():
    """Chunks of 4 blocks and a local hit of 5 blocks (160 tokens): the
    lookup starts at chunk 1, vLLM is told the tokens after its own hit,
    and the load skips block 4 (vLLM's) and writes blocks 5-7 onwards."""
    class LookupTier(FakeTier):
        def lookup_ex(self, keys, first_depth=None):
            self.asked, self.depth = len(keys), first_depth
            return SimpleNamespace(hits=len(keys), pending=0, hand_off=lambda: 9,
                                   release=lambda: None)

        def hash_keys(self, toks):
            return np.zeros((len(toks) // 128, 2), np.uint64)

    c = sched_connector(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                          dtype=torch.bfloat16), chunk_tokens=128)
    c._tier = LookupTier()
    req = request("a", 1200)
    ext, is_async = c.get_num_new_matched_tokens(req, 160)
    assert c._tier.asked == 8 and ext == 8 * 128 - 32 and is_async   # chunks 1..8
    assert c._tier.depth == 1   # the L3 is asked for them at their depth in the prompt
    c.update_state_after_alloc(req, _Blocks(range(100, 138)), ext)
    assert c._to_load["a"] == (9, 1, 8, 32, [list(range(100, 138))])
    # an asynchronous load: the request is not scheduled in this step
    meta = c.build_connector_meta(step_output())
    tab = meta.loads[0].block_ids[0]
    assert tab[0] == kv.kvtier.BLOCK_SKIP and tab[1:] == list(range(105, 136))
    # a hit that is not whole blocks (never from vLLM): nothing added
    assert c.get_num_new_matched_tokens(request("b", 1200), 100) == (0, False)


class _Stream:
    def __init__(self, log):
        self.cuda_stream, self.log = 0xabc0, log

    def synchronize(self):
        self.log.append("sync")


class _Op:
    count = 1

    def wait(self):
        return 0


class _Tier:
    """Records the connector's calls; order_after fails with `fail`."""

    def __init__(self, log, fail=None):
        self.log, self.fail = log, fail

    def order_after(self, stream):
        self.log.append(("order_after", stream))
        if self.fail:
            raise kvtier.KvtierError(self.fail, "no ordering here", func="kvt_order_after")

    def save(self, keys, tables, first_depth=0):
        self.log.append("save")
        return _Op()


def _saving_connector(monkeypatch, log, fail=None, device="cuda"):
    c = kv.KvtierConnector.__new__(kv.KvtierConnector)
    c._tier = _Tier(log, fail)
    c._s = SimpleNamespace(async_io=False, plan=ONE_GROUP)
    c._save_order = "stream" if device == "cuda" else None
    c._kv_device = SimpleNamespace(type=device)
    c._stat = lambda *a: None
    meta = kv.KvtierConnectorMetadata(saves=[kv._Save("r", bytes(16), 0, [[1, 2]])])
    c._get_connector_metadata = lambda: meta
    monkeypatch.setattr(torch.cuda, "current_stream", lambda dev=None: _Stream(log))
    return c


def test_saves_wait_for_the_forward_pass(monkeypatch):
    """vLLM asks for the saves once it launched the forward pass: on a GPU
    cache the tier is ordered after the engine's stream before any save;
    a backend that cannot (hsa without HIP: ENOTSUP) gets the stream synchronized on
    the host, from then on without asking again; a CPU cache: nothing."""
    import errno
    log = []
    c = _saving_connector(monkeypatch, log)
    c.wait_for_save()
    assert log == [("order_after", 0xabc0), "save"]
    log.clear()
    c = _saving_connector(monkeypatch, log, fail=-errno.ENOTSUP)
    c.wait_for_save()
    c.wait_for_save()
    assert log == [("order_after", 0xabc0), "sync", "save", "sync", "save"]
    log.clear()
    c = _saving_connector(monkeypatch, log, fail=-errno.EIO)
    with pytest.raises(kvtier.KvtierError):
        c.wait_for_save()
    assert "save" not in log
    log.clear()
    c = _saving_connector(monkeypatch, log, device="cpu")
    c.wait_for_save()
    assert log == ["save"]


# ---- loads and saves off the step (kvtier_async, the default) ----

class _AsyncOp:
    """A kvtier Op whose completion the test decides: poll() is False until
    finish(); fail() makes it raise as a failed copy does."""

    def __init__(self, log, name, count=1):
        self.log, self.name, self.count = log, name, count
        self.state = "running"

    def finish(self):
        self.state = "done"

    def fail(self):
        self.state = "failed"

    def poll(self):
        if self.state == "failed":
            raise kvtier.KvtierError(-5, "the copy failed", func="kvt_poll")
        return self.state == "done"

    def wait(self):
        self.log.append(("wait", self.name))
        if self.state == "running":
            self.state = "done"
        return self.poll()


class _AsyncTier:
    def __init__(self, log):
        self.log, self.ops = log, {}

    def _op(self, name):
        op = self.ops[name] = _AsyncOp(self.log, name)
        return op

    def save(self, keys, tables, first_depth=0):
        self.log.append(("save", first_depth))
        return self._op("save%d" % first_depth)

    def load(self, lease, tables, n):
        self.log.append(("load", lease))
        return self._op("load%d" % lease)


def worker_connector(log):
    c = kv.KvtierConnector.__new__(kv.KvtierConnector)
    c._s = SimpleNamespace(async_io=True, plan=ONE_GROUP)
    c._tier = _AsyncTier(log)
    c._stats = kv.KvtierConnectorStats()
    c._save_order = None
    c._worker_state()
    return c


def bind(c, meta):
    c._get_connector_metadata = lambda: meta


def test_async_save_holds_the_blocks_until_copied():
    """Scheduler: a request that had saves is finished with its blocks held
    (request_finished -> True), one without is not.  Worker: it reports the
    request in finished_sending only once vLLM said it finished AND its
    saves completed, and only once."""
    c = sched_connector(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                          dtype=torch.bfloat16))
    c._reqs["a"] = request("a", 100)
    c._reqs["b"] = request("b", 20)
    meta = c.build_connector_meta(step_output(new=[("a", [1, 2, 3, 4], 0), ("b", [5], 0)],
                                              scheduled={"a": 100, "b": 20}))
    assert [sv.req_id for sv in meta.saves] == ["a"]
    assert c.request_finished(c._reqs["a"], [1, 2, 3, 4]) == (True, None)
    assert c.request_finished(c._reqs["b"], [5]) == (False, None)

    log = []
    w = worker_connector(log)
    bind(w, meta)
    w.wait_for_save()
    assert log == [("save", 0)]                        # submitted, not waited for
    r = w.get_transfer_results(set())
    assert not r.finished_sending                      # still running, not finished
    r = w.get_transfer_results({"a", "b"})             # vLLM: a and b finished
    assert not r.finished_sending                      # a's save still reads its blocks
    w._tier.ops["save0"].finish()
    assert w.get_transfer_results(set()).finished_sending == {"a"}
    assert not w.get_transfer_results(set()).finished_sending  # reported once
    assert ("wait", "save0") not in log


def test_preemption_flushes_the_saves_reading_freed_blocks():
    """vLLM frees a preempted request's blocks at once: its running saves
    end in handle_preemptions, before the forward pass that may write the
    blocks; another request's save runs on.  A windowed group (blocks
    freed as the window moves) flushes every running save."""
    log = []
    w = worker_connector(log)
    saves = [kv._Save("a", bytes(16), 0, [[1]]), kv._Save("b", bytes(16), 1, [[2]])]
    bind(w, kv.KvtierConnectorMetadata(saves=saves))
    w.wait_for_save()
    w.handle_preemptions(kv.KvtierConnectorMetadata(flush=["a"]))
    assert ("wait", "save0") in log and ("wait", "save1") not in log
    assert list(w._saves) == ["b"]
    w.handle_preemptions(kv.KvtierConnectorMetadata(flush_all=True))
    assert ("wait", "save1") in log and not w._saves

    # the scheduler asks for those flushes
    c = sched_connector(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                          dtype=torch.bfloat16))
    c._reqs["a"] = request("a", 100)
    c.build_connector_meta(step_output(new=[("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}))
    out = step_output()
    out.preempted_req_ids = {"a"}
    meta = c.build_connector_meta(out)
    assert meta.flush == ["a"] and not meta.flush_all
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    c = sched_connector(SlidingWindowSpec(sliding_window=128, block_size=32, num_kv_heads=2,
                                          head_size=64, dtype=torch.bfloat16))
    c._reqs["a"] = request("a", 100)
    c.build_connector_meta(step_output(new=[("a", [1, 2, 3, 4], 0)], scheduled={"a": 100}))
    assert c.build_connector_meta(step_output()).flush_all


def test_async_load_reported_and_its_failure_recomputed():
    """Worker: a load is submitted, never waited for in the step, and
    reported in finished_recving when it ended; a failed one also in
    failed_recving (vLLM then recomputes its tokens).  Scheduler: the
    request's load is in the metadata although it is not scheduled, and
    its lease stays live in the stale sweep until the ranks reported it."""
    log = []
    w = worker_connector(log)
    bind(w, kv.KvtierConnectorMetadata(loads=[kv._Load("x", 5, 2, [[1, 2]], True),
                                              kv._Load("y", 6, 1, [[3]], True)]))
    w.start_load_kv(None)
    assert log == [("load", 5), ("load", 6)]
    r = w.get_transfer_results(set())
    assert not r.finished_recving and not r.failed_recving
    w._tier.ops["load5"].finish()
    w._tier.ops["load6"].fail()
    r = w.get_transfer_results(set())
    assert r.finished_recving == {"x", "y"} and r.failed_recving == {"y"}
    assert w._stats.data["load_errors"] == 1 and w._stats.data["loaded_chunks"] == 2
    assert not w.get_transfer_results(set()).finished_recving
    assert not [e for e in log if e[0] == "wait"]

    class StepTier(FakeTier):
        def lookup_ex(self, keys, first_depth=None):
            return SimpleNamespace(hits=len(keys), pending=0, hand_off=lambda: 9,
                                   release=lambda: None)

        def step(self, live):
            self.live = list(live)

    c = sched_connector(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                          dtype=torch.bfloat16))
    c._tier = StepTier()
    req = request("a", 200)
    ext, is_async = c.get_num_new_matched_tokens(req, 0)
    assert ext == 192 and is_async
    c.update_state_after_alloc(req, _Blocks(range(10, 17)), ext)
    meta = c.build_connector_meta(step_output())
    assert [(ld.req_id, ld.lease, ld.n_chunks, ld.is_async) for ld in meta.loads] == \
        [("a", 9, 6, True)]
    assert meta.loads[0].block_ids == [list(range(10, 16))]
    c.build_connector_meta(step_output())
    assert c._tier.live == [9]                     # still loading: not swept
    c.update_connector_output(SimpleNamespace(finished_recving={"a"}))
    c.build_connector_meta(step_output())
    assert c._tier.live == []


def test_windowed_finish_ends_its_saves_before_the_next_forward():
    """A sliding-window request that finishes while its saves run: vLLM
    0.32's _connector_finished frees its blocks below the window
    (remove_skipped_blocks) before request_finished, so request_finished's
    True does not hold them, and the next step's forward pass may write
    them for a new request.  Deterministic: the save is held until the next
    step has begun; the rank must end it in that step's handle_preemptions
    (before the forward pass), although no request is saving any more in
    the scheduler's view.  (Failed before the fix: flush_all was
    "bool(self._saving) and windows", False once the finished request left
    _saving, and the copy ran on into the next forward pass.)"""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    c = sched_connector(SlidingWindowSpec(sliding_window=128, block_size=32, num_kv_heads=2,
                                          head_size=64, dtype=torch.bfloat16))
    c._reqs["a"] = request("a", 200)
    m1 = c.build_connector_meta(step_output(new=[("a", [1, 2, 3, 4, 5, 6, 7], 0)],
                                            scheduled={"a": 200}))
    assert [sv.req_id for sv in m1.saves] == ["a"]
    log = []
    w = worker_connector(log)
    bind(w, m1)
    w.wait_for_save()                                 # a's copies start, and run on
    assert c.request_finished(c._reqs["a"], [5, 6, 7]) == (True, None)  # max_tokens=1
    c._reqs["b"] = request("b", 100)
    m2 = c.build_connector_meta(step_output(new=[("b", [1, 2, 3, 4], 0)], scheduled={"b": 100}))
    assert m2.flush_all
    w.handle_preemptions(m2)                          # before b's forward pass
    assert ("wait", "save0") in log and not w._saves
    w.get_transfer_results({"a"})
    # an aborted request whose save is still running: the same
    c._reqs["d"] = request("d", 200)
    m3 = c.build_connector_meta(step_output(new=[("d", [8, 9, 10, 11, 12, 13, 14], 0)],
                                            scheduled={"d": 200}))
    bind(w, m3)
    w.wait_for_save()
    c.request_finished(c._reqs["d"], [12, 13, 14])
    w.handle_preemptions(c.build_connector_meta(step_output()))
    assert not w._saves
    # full attention: request_finished's True holds every block, nothing
    # to flush
    c = sched_connector(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                          dtype=torch.bfloat16))
    c._reqs["a"] = request("a", 200)
    c.build_connector_meta(step_output(new=[("a", list(range(1, 8)), 0)], scheduled={"a": 200}))
    c.request_finished(c._reqs["a"], list(range(1, 8)))
    assert not c.build_connector_meta(step_output()).flush_all


def test_failed_load_of_a_finished_request_is_forgotten():
    """A request aborted while its asynchronous load fails: vLLM finishes it
    (request_finished) before the ranks report the failure; the scheduler
    must not remember it as failed for the life of the process.  A live
    request's failure is remembered (it is recomputed, not asked again)."""
    c = sched_connector(FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64,
                                          dtype=torch.bfloat16))
    c._reqs["x"] = request("x", 200)
    c._reqs["y"] = request("y", 200)
    c.request_finished(c._reqs["x"], [])
    c.update_connector_output(SimpleNamespace(finished_recving={"x", "y"},
                                              failed_recving={"x", "y"}))
    assert c._failed == {"y"}
    c.request_finished(c._reqs["y"], [])
    assert not c._failed


# ---- the model identity at attach: vLLM's own layout resolution, kvtierd ----

def _resolved_layout(monkeypatch, supported, env=None):
    """The layout vLLM's engine core resolves (resolve_kv_cache_layout) for
    workers whose backends support `supported`, most preferred first."""
    from vllm.config import CacheConfig
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    import vllm.envs as envs
    if env is None:
        monkeypatch.delenv("VLLM_KV_CACHE_LAYOUT", raising=False)
    else:
        monkeypatch.setenv("VLLM_KV_CACHE_LAYOUT", env)
    if hasattr(envs, "__getattr__") and hasattr(envs, "disable_envs_cache"):
        envs.disable_envs_cache()
    vc = SimpleNamespace(cache_config=CacheConfig(), kv_transfer_config=None)
    return resolve_kv_cache_layout(vc, [list(supported)]).name


def test_engines_of_other_layouts_are_refused(monkeypatch):
    """Two engines whose backends make vLLM resolve other KV layouts (the
    bytes of a block in another order): the second is refused at attach,
    the field named on each side; the same layout attaches."""
    flashinfer_b200 = ("LBHNC", "BLHNC")       # flashinfer.py on capability 10
    flex = ("LBNHC",)                           # flex_attention.py
    a = _resolved_layout(monkeypatch, flashinfer_b200)
    b = _resolved_layout(monkeypatch, flex)
    c = _resolved_layout(monkeypatch, flashinfer_b200, env="BLHNC")
    assert (a, b, c) == ("LBHNC", "LBNHC", "BLHNC")
    name = "cfg-layout-%d" % os.getpid()
    first = kv._Settings(vllm_config(extra={"kvtier_segment": name, "kvtier_instances": 2}),
                         kv_cache_config(layout=a)).open("scheduler")
    second = {"kvtier_segment": name, "kvtier_create": False, "kvtier_instance": 1}
    try:
        for other in (b, c):
            s = kv._Settings(vllm_config(extra=second), kv_cache_config(layout=other))
            with pytest.raises(kvtier.KvtierError) as e:
                s.open("scheduler")
            assert "model layout: the segment's '%s', this process's '%s'" % (a, other) \
                in str(e.value)
        kv._Settings(vllm_config(extra=second), kv_cache_config(layout=a)) \
            .open("scheduler").close()
    finally:
        first.close()
        kvtier.unlink(name)


def _kvtierd(line, name, tmp_path):
    """kvtierd started from a connector's logged line (its flags, this
    test's segment, a small tier): the process, and its first output when
    it exited."""
    import shlex
    import subprocess
    import time
    build = os.environ.get("KVTIER_BUILD", os.path.join(os.path.dirname(os.path.dirname(HERE)),
                                                         "build"))
    args = shlex.split(line)
    args[0] = os.path.join(build, "tier", "daemon", "kvtierd")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / ("%s.log" % name)
    args += ["--slots", "16", "--http", "127.0.0.1:%d" % port, "--unlink", "--no-lock",
             "--log", str(log)]
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return p, p.stdout.read() + (log.read_text() if log.exists() else "")
        try:
            with kvtier.Tier(segment=name, role="client"):
                return p, ""
        except kvtier.KvtierError:
            time.sleep(0.05)
    p.kill()
    raise AssertionError("kvtierd did not make segment %s" % name)


def test_kvtierd_computes_the_same_identity(tmp_path):
    """The kvtierd line the connector logs, run: kvtierd appends the model
    files' fields from --model-config itself, and the engine attaches.  A
    kvtierd given another config.json (the model updated on disk) makes a
    segment the engine is refused, the field named."""
    import signal
    m = _write_model(str(tmp_path / "model"))
    name = "cfg-kvtierd-%d" % os.getpid()
    vc = vllm_config(model=m, extra={"kvtier_segment": name, "kvtier_create": False})
    c = kv.KvtierConnector.__new__(kv.KvtierConnector)
    c._s = kv._Settings(vc, kv_cache_config())
    line = c._kvtierd_line()
    import shlex
    assert "--model-config %s --model %s" % (shlex.quote(m + "/config.json"),
                                             shlex.quote(m + ENGINE)) in line
    p, out = _kvtierd(line, name, tmp_path)
    try:
        assert p.poll() is None, out
        c._s.open("scheduler").close()
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    # the model's config changed under kvtierd: the engine's is the old one
    other = _write_model(str(tmp_path / "model2"), b'{"model_type": "llama", "x": 1}')
    p, out = _kvtierd(line.replace(m + "/config.json", other + "/config.json"), name, tmp_path)
    try:
        assert p.poll() is None, out
        with pytest.raises(kvtier.KvtierError) as e:
            c._s.open("scheduler")
        assert "model config: the segment's '" in str(e.value)
        assert "model weights" not in str(e.value)   # the weights are the same files' figures
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=30)
    # a --model that names other files than --model-config's is refused by kvtierd
    bad = line.replace("--model %s" % shlex.quote(m + ENGINE),
                       "--model %s" % shlex.quote(c._s.model)) \
        .replace(m + "/config.json", other + "/config.json")
    p, out = _kvtierd(bad, name, tmp_path)
    assert p.wait(timeout=30) == 2 and "names other model files than --model-config" in out, out


def test_engines_differing_in_each_field_are_refused(monkeypatch, tmp_path):
    """On one segment, an engine that differs from its creator in one field
    of the model identity at a time is refused at attach, that field named
    on each side -- and only that field."""
    from vllm.platforms import current_platform
    m = _write_model(str(tmp_path / "model"))
    other_cfg = _write_model(str(tmp_path / "cfg"), b'{"model_type": "llama", "y": 2}')
    name = "cfg-fields-%d" % os.getpid()
    base = dict(model=m, extra={"kvtier_segment": name, "kvtier_instances": 2,
                                "kvtier_model": "m"}, cache_dtype="fp8")
    first = kv._Settings(vllm_config(**base), kv_cache_config()).open("scheduler")

    def variant(field, **kw):
        b = dict(base, **kw)
        b["extra"] = dict(base["extra"], kvtier_create=False, kvtier_instance=1,
                          **kw.pop("extra", {}))
        vc = vllm_config(**{k: v for k, v in b.items() if k not in ("skip", "layout")})
        if "skip" in kw:
            vc.cache_config.kv_cache_dtype_skip_layers = kw["skip"]
        return field, vc, kv_cache_config(layout=kw.get("layout", "LBHNC"))

    cases = [variant("name", extra={"kvtier_model": "m2"}),
             variant("dtype", dtype=torch.float16),
             variant("kv", cache_dtype="fp8_e5m2"),
             variant("kv-skip", skip=["0"]),
             variant("layout", layout="LBNHC"),
             variant("quant", quantization="fp8"),
             variant("weights", load_config=SimpleNamespace(load_format="dummy")),
             variant("prefix-hash", algo="sha256_cbor"),
             variant("config", model=other_cfg)]
    try:
        for field, vc, kc in cases:
            with pytest.raises(kvtier.KvtierError) as e:
                kv._Settings(vc, kc).open("scheduler")
            msg = str(e.value)
            named = [f for f in ("name", "dtype", "kv", "kv-skip", "layout", "quant", "weights",
                                 "prefix-hash", "config") if "model %s: the segment's" % f in msg]
            assert named == [field], (field, msg)
        # the platform's fp8 variant
        monkeypatch.setattr(type(current_platform), "is_fp8_fnuz", classmethod(lambda c: True))
        _, vc, kc = variant("kv")
        vc.cache_config.cache_dtype = "fp8"
        with pytest.raises(kvtier.KvtierError) as e:
            kv._Settings(vc, kc).open("scheduler")
        assert "model kv: the segment's 'fp8_e4m3/ocp', this process's 'fp8_e4m3/fnuz'" \
            in str(e.value)
        monkeypatch.undo()
        # the hash seed
        monkeypatch.setenv("PYTHONHASHSEED", "3")
        _, vc, kc = variant("hashseed")
        with pytest.raises(kvtier.KvtierError) as e:
            kv._Settings(vc, kc).open("scheduler")
        assert "model hashseed: the segment's '(none)', this process's '3'" in str(e.value)
        monkeypatch.delenv("PYTHONHASHSEED")
        # and the same settings attach
        _, vc, kc = variant("none")
        kv._Settings(vc, kc).open("scheduler").close()
    finally:
        first.close()
        kvtier.unlink(name)


def test_versions(monkeypatch):
    """The vLLM running here is one of the tested releases (this suite runs
    without KVTIER_VLLM_ANY_VERSION on each of them); another is refused
    with the tested ones named, unless the variable says to try it."""
    import vllm
    from kvtier.vllm import _versions
    expect = os.environ.get("KVTIER_VLLM_EXPECT")   # tests/vllm/other-releases.sh's
    monkeypatch.delenv("KVTIER_VLLM_ANY_VERSION", raising=False)
    assert not expect or vllm.__version__ == expect, (vllm.__version__, vllm.__file__)
    assert any(vllm.__version__.startswith(v) for v in _versions.VLLM_VERSIONS), vllm.__version__
    for v in ("0.31.0", "0.31.1", "0.32.0", "0.33.0", "0.34.0"):
        _versions.check(v)
    for v in ("0.30.0", "0.35.0", "1.31.0"):
        with pytest.raises(ImportError, match=r"vLLM 0\.31\.x / 0\.32\.x / 0\.33\.x / "
                           r"0\.34\.x; this is vLLM " + v.replace(".", r"\.")):
            _versions.check(v)
    monkeypatch.setenv("KVTIER_VLLM_ANY_VERSION", "1")
    _versions.check("0.35.0")


def test_sleep_mode_is_refused(tmp_path):
    """vLLM's sleep mode replaces the KV cache's bytes under kvtier's block
    records: refused by the connector's settings on every release, and by
    vLLM's own configuration from 0.33 (it asks supports_sleep_mode), with
    the connector named."""
    with pytest.raises(ValueError, match="sleep mode is on"):
        kv._Settings(vllm_config(enable_sleep_mode=True), kv_cache_config())
    kv._Settings(vllm_config(enable_sleep_mode=False), kv_cache_config())
    from kvtier.vllm import KvtierConnector
    assert KvtierConnector.supports_sleep_mode(None) is False
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
    if not hasattr(KVConnectorBase_V1, "supports_sleep_mode"):
        return   # 0.31, 0.32: vLLM does not ask
    import models
    from vllm.config import DeviceConfig, KVTransferConfig, ModelConfig, VllmConfig
    models.config("llama").save_pretrained(str(tmp_path))
    mc = ModelConfig(model=str(tmp_path), dtype="bfloat16", skip_tokenizer_init=True)
    mc.enable_sleep_mode = True   # the CPU platform refuses it in ModelConfig itself
    with pytest.raises(ValueError, match="KvtierConnector does not support sleep mode"):
        VllmConfig(model_config=mc, device_config=DeviceConfig("cpu"),
                   kv_transfer_config=KVTransferConfig(kv_connector="KvtierConnector",
                                                       kv_connector_module_path="kvtier.vllm",
                                                       kv_role="kv_both"))


# ---- caches of several shapes (DeepSeek V3.2 / V4, GLM-5.x; _caches.py) ----

def test_a_rounded_run_never_reaches_another_layers_data():
    """A block copied rounded up into its page's padding (1,168 bytes of
    data copied as 1,280) is refused when those bytes would reach another
    layer's data, or past the block stride; where the padding holds them,
    it is registered."""
    from kvtier.vllm._worker import _check_rounded_runs
    plan = SimpleNamespace(kgroups=[
        SimpleNamespace(vg=0, run=1280, data=1168, pieces=1, layers=["c128"]),
        SimpleNamespace(vg=0, run=8448, data=8448, pieces=1, layers=["indexer"]),
        SimpleNamespace(vg=1, run=4096, data=4096, pieces=1, layers=["other-group"])])
    stride = 1728 + 8448
    # c128's page is 1,728 bytes: the indexer's data starts after it
    _check_rounded_runs(plan, [([0], stride, 8), ([1728], stride, 8), ([0], 4096, 8)])
    with pytest.raises(ValueError) as e:      # no padding: the next layer's data
        _check_rounded_runs(plan, [([0], stride, 8), ([1168], stride, 8), ([0], 4096, 8)])
    assert "c128" in str(e.value) and "indexer" in str(e.value)
    with pytest.raises(ValueError) as e:      # the run passes the block stride
        _check_rounded_runs(plan, [([0], 1200, 8), ([600], 1200, 8), ([0], 4096, 8)])
    assert "block stride" in str(e.value)


class ReleasingTier(FakeTier):
    def __init__(self):
        super().__init__()
        self.released = []

    def release(self, lid):
        self.released.append(lid)
        return True


def test_a_load_vllm_would_read_unkept_blocks_of_is_failed():
    """Of a 128-token window in 32-token blocks a 256-token chunk keeps the
    last 4 blocks.  A load into a table whose other blocks are vLLM's null
    block writes those 4; a table with a real block where kvtier keeps none
    (vLLM would read it) is not loaded: its lease is released by the
    scheduler and the ranks report the load failed (vLLM recomputes)."""
    from vllm.v1.kv_cache_interface import SlidingWindowSpec
    spec = SlidingWindowSpec(sliding_window=128, block_size=32, num_kv_heads=2, head_size=64,
                             dtype=torch.bfloat16)
    c = sched_connector(spec, chunk_tokens=256)
    c._tier = ReleasingTier()
    c._to_load["ok"] = (7, 0, 1, 0, [[0, 0, 0, 0, 5, 6, 7, 8]])
    c._to_load["bad"] = (9, 0, 1, 0, [[1, 2, 3, 4, 5, 6, 7, 8]])
    meta = c.build_connector_meta(step_output())
    ok, bad = sorted(meta.loads, key=lambda ld: ld.req_id != "ok")
    assert (ok.lease, ok.block_ids, ok.error) == (7, [[5, 6, 7, 8]], "")
    assert bad.lease == 0 and "real block 1" in bad.error and c._tier.released == [9]


def _two_shape_config(layers_spec, name):
    """A KV cache config of one group holding two caches of other pages (a
    UniformTypeKVCacheSpecs, as vLLM's workers get it), and the scheduler's
    form of it (vLLM's generate_scheduler_kv_cache_config: the first
    layer's spec for the group)."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config
    from vllm.v1.kv_cache_interface import UniformTypeKVCacheSpecs
    group = KVCacheGroupSpec([n for n, _ in layers_spec], UniformTypeKVCacheSpecs(
        block_size=32, kv_cache_specs=dict(layers_spec)))
    worker = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[group])
    worker.kv_cache_layout = "LBHNC"
    sched = generate_scheduler_kv_cache_config([worker])
    return worker, sched


def test_the_scheduler_joins_its_ranks_segment_only_when_it_is_this_engines():
    """vLLM gives the scheduler one spec per group: its geometry and caches
    field differ from the ranks' (who describe every cache and make the
    segment).  It joins their segment when the identity is the same but
    for the caches field, and is refused, the ranks' refusal standing, for
    another model's."""
    from vllm.v1.kv_cache_interface import SparseCacheRole
    mla = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.uint8,
                           cache_dtype_str="fp8_ds_mla", state_content_bytes=656)
    idx = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=132, dtype=torch.uint8,
                           cache_role=SparseCacheRole.INDEXER)
    name = "cfg-adopt-%d" % os.getpid()
    worker, sched = _two_shape_config([("l0.attn", mla), ("l0.indexer", idx)], name)
    extra = {"kvtier_segment": name, "kvtier_tier_gib": 0.0625}
    rank = kv._Settings(vllm_config(extra=extra), worker)
    assert rank.plan.caches and [k.data for k in rank.plan.kgroups] == [32 * 328, 32 * 66]
    r = rank.open("rank", rank=0)
    try:
        s = kv._Settings(vllm_config(extra=extra), sched)
        assert s.model != rank.model                   # its caches field: one spec's
        t = s.open("scheduler")
        assert t.segment_model == rank.model
        t.close()
        other = kv._Settings(vllm_config(extra=extra, dtype=torch.float16), sched)
        with pytest.raises(kvtier.KvtierError) as e:
            other.open("scheduler")
        assert e.value.errno == errno.ESTALE
    finally:
        r.close()
        kvtier.unlink(name)
