"""Drives vLLM's own scheduler and kvtier's connector over a real KV cache
of several cache groups (test_hybrid_caches.py runs it in a process of its
own).  Usage: hybrid_driver.py JSON, JSON's keys:

  model      the model directory (config.json)
  kind       "engine": a real vLLM CPU engine in this process (its model,
             its KV cache config with the hybrid allocator on, its KV
             tensors, its scheduler, its worker's connector); the forward
             pass alone is this script's stand-in (vLLM's DeepSeek V4 CPU
             forward cannot run here: test_hybrid_caches.py quotes why).
             On a CPU without AVX-512, vLLM's AVX2 kernel library has no
             convert_weight_packed, which DeepSeek V4's weight loading
             calls to pack weights for that forward: a stand-in returning
             the weight as it is is registered then (standin_packing in
             the output), so the engine starts -- its KV caches, which
             are what this script checks, are vLLM's own either way
  segment    kvtier's segment
  kv_cache_dtype, blocks, chunk_tokens   the engine's and the connector's
  break      "": exact; "skip-cache": a mutated step -- the connector's plan
             leaves one cache of each vLLM group out (the check must fail)

The stand-in forward writes, into every block of every cache of every
group, a byte pattern that is a function of the tokens up to that block's
last one and the cache's name, for the tokens the step computes; whenever
the scheduler schedules a request, every block of its computed tokens that
vLLM still holds (not its null block) is checked against that function --
the blocks vLLM computed, and the blocks kvtier loaded.  Prints one JSON
line: the checks made, the tokens loaded from kvtier, vLLM's external hits,
the connector's stats, the plan."""

import hashlib
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bindings", "python"))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

import torch  # noqa: E402

import kvtier  # noqa: E402
from standin import request, runner_output, sampled_token, settle, tokens  # noqa: E402


def pattern(tokens, name, like):
    """The stand-in's content of a block: small integers every dtype holds
    exactly, seeded by the tokens up to the block's end and the cache."""
    h = hashlib.blake2b(bytes(str(tokens), "ascii") + name.encode(), digest_size=4).digest()
    seed = int.from_bytes(h, "little") % 251
    n = like.numel()
    return ((torch.arange(n, dtype=torch.int64) * 131 + seed) % 251).to(like.dtype) \
        .reshape(like.shape)


class Driver:
    def __init__(self, sched, worker_connector, kv, vllm_config):
        self.sched = sched
        self.wc = worker_connector
        self.kv = kv                  # layer name -> [B, ...] tensor view
        self.vllm_config = vllm_config
        self.groups = sched.kv_cache_config.kv_cache_groups
        self.checked = 0              # blocks checked
        self.expect_loaded = {}       # req_id -> its prefix tokens kvtier loads
        self.loaded_blocks = set()    # (req, group, block, cache) checked in that prefix
        self.external = 0             # vLLM's external hit tokens
        self.finished = {}
        self.preempted = 0
        self.wrong = []

    def _forward(self, out):
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            r = self.sched.requests[rid]
            toks = list(r.all_token_ids)
            start = r.num_computed_tokens - n
            ext = self.expect_loaded.get(rid, 0)
            tables = self.sched.kv_cache_manager.get_block_ids(rid)
            for gi, g in enumerate(self.groups):
                bs = g.kv_cache_spec.block_size
                for i, b in enumerate(tables[gi]):
                    lo, hi = i * bs, (i + 1) * bs
                    if b == 0 or lo >= start + n:
                        continue
                    for name in g.layer_names:
                        blk = self.kv[name][b]
                        if hi <= start:
                            want = pattern(toks[:hi], name, blk)
                            self.checked += 1
                            if hi <= ext:
                                self.loaded_blocks.add((rid, gi, i, name))
                            if not bool((blk == want).all()):
                                self.wrong.append("request %s group %d block %d (id %d) "
                                                  "cache %s" % (rid, gi, i, b, name))
                        elif hi > start:
                            blk.copy_(pattern(toks[:min(hi, start + n)], name, blk))
            if start + n >= r.num_prompt_tokens:
                sampled[rid] = [sampled_token(toks[:start + n])]
        return sampled

    def step(self):
        from vllm.forward_context import set_forward_context
        from vllm.v1.outputs import KVConnectorOutput
        out = self.sched.schedule()
        st = getattr(self.sched, "connector_prefix_cache_stats", None)
        if st is not None:
            self.external += st.hits
            st.hits = 0
        self.preempted += len(getattr(out, "preempted_req_ids", None) or ())
        # vLLM's worker-side driver (v1/worker/gpu/kv_connector.py), its order
        meta = out.kv_connector_metadata
        self.wc.handle_preemptions(meta)
        self.wc.bind_connector_metadata(meta)
        sync = getattr(out, "has_sync_kv_loads", True)
        with set_forward_context(None, self.vllm_config):
            if sync:                    # before the forward pass
                self.wc.start_load_kv(None)
            sampled = self._forward(out)
            if not sync:                # after it, off its critical path
                self.wc.start_load_kv(None)
        self.wc.wait_for_save()
        tr = self.wc.get_transfer_results(out.finished_req_ids)
        kvo = KVConnectorOutput(finished_sending=tr.finished_sending or None,
                                finished_recving=tr.finished_recving or None,
                                failed_recving=tr.failed_recving,
                                invalid_block_ids=self.wc.get_block_ids_with_load_errors(),
                                kv_connector_stats=self.wc.get_kv_connector_stats())
        self.wc.clear_connector_metadata()
        eco = self.sched.update_from_output(
            out, runner_output(list(out.num_scheduled_tokens), sampled, kvo))
        settle(out, self.wc)
        for o in eco.values():
            for ro in o.outputs:
                if ro.finish_reason is not None:
                    self.finished[ro.request_id] = list(ro.new_token_ids)

    def run(self, steps=300):
        for _ in range(steps):
            if not self.sched.has_requests():
                return
            self.step()
        raise AssertionError("requests still running after %d steps" % steps)

    def add(self, rid, prompt, max_tokens):
        self.sched.add_request(request(rid, prompt, max_tokens, self.hasher))

    @property
    def hasher(self):
        """vLLM's block hasher where prefix caching is on (a CPU with AMX
        runs DeepSeek V4 so); elsewhere vLLM's CPU build turns it off for
        these MLA models, and the connector keys chunks by kvtier's own
        token hash."""
        cc = self.vllm_config.cache_config
        if not cc.enable_prefix_caching:
            return None
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        fn = get_hash_fn_by_name(cc.prefix_caching_hash_algo)
        init_none_hash(fn)
        return get_request_block_hasher(
            self.sched.kv_cache_config.hash_block_size or cc.block_size, fn)


_packing_lib = None


def standin_weight_packing():
    """convert_weight_packed where vLLM's kernel library lacks it (its
    AVX2 build): True when the stand-in was registered.  The weights it
    packs feed only the forward pass, which never runs here."""
    global _packing_lib
    import vllm._custom_ops  # noqa: F401  (loads vLLM's _C ops)
    try:
        torch.ops._C.convert_weight_packed
        return False
    except (AttributeError, RuntimeError):
        pass
    _packing_lib = torch.library.Library("_C", "FRAGMENT")
    _packing_lib.define("convert_weight_packed(Tensor weight) -> Tensor")
    _packing_lib.impl("convert_weight_packed", lambda w: w.clone(), "CPU")
    return True


def engine(o):
    """A real vLLM engine in this process: its scheduler, worker connector
    and KV tensors (the connector holds the dict vLLM registered)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer import get_kv_transfer_group
    kw = dict(model=o["model"], load_format="dummy", skip_tokenizer_init=True,
              block_size=o.get("block_size", 256), max_model_len=o.get("max_model_len", 2048),
              enforce_eager=True, max_num_seqs=4, max_num_batched_tokens=2048,
              num_gpu_blocks_override=o.get("blocks", 400), disable_log_stats=False,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
                  kv_role="kv_both", kv_connector_extra_config=dict(
                      kvtier_segment=o["segment"], kvtier_tier_gib=o.get("tier_gib", 0.5))))
    if o.get("kv_cache_dtype"):
        kw["kv_cache_dtype"] = o["kv_cache_dtype"]
    llm = LLM(**kw)
    core = llm.llm_engine.engine_core.engine_core
    wc = get_kv_transfer_group()
    kv = {n: t for n, t in wc._kv_caches.items()}
    return llm, core.scheduler, wc, kv, core.vllm_config


def _free_port():
    import socket
    with socket.socket() as so:
        so.bind(("127.0.0.1", 0))
        return so.getsockname()[1]


def glm_specs(o, vc):
    """The KV cache specs vLLM 0.32's GLM-5.x / DeepSeek V3.2 layers give
    (vllm/model_executor/layers/attention/mla_attention.py's
    get_kv_cache_spec for the MLA cache, deepseek_v2.py's
    DeepseekV32IndexerCache for the indexer's keys), per layer of the
    config: an indexer cache on the layers indexer_types calls "full"."""
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SparseCacheRole, get_kv_quant_mode
    hf = vc.model_config.hf_config
    bs = vc.cache_config.block_size
    cd = o.get("kv_cache_dtype", "fp8_ds_mla")
    types = getattr(hf, "indexer_types", None) or ["full"] * hf.num_hidden_layers
    specs = {}
    for i in range(hf.num_hidden_layers):
        specs["model.layers.%d.self_attn.attn" % i] = MLAAttentionSpec(
            block_size=bs, num_kv_heads=1, max_tp_shards=1,
            head_size=hf.kv_lora_rank + hf.qk_rope_head_dim,
            dtype=torch.uint8 if cd == "fp8_ds_mla" else torch.bfloat16,
            cache_dtype_str=cd, kv_quant_mode=get_kv_quant_mode(cd),
            state_content_bytes=656 if cd == "fp8_ds_mla" else None,
            is_index_group_leader=types[i] == "full")
        if types[i] == "full":
            specs["model.layers.%d.self_attn.indexer.k_cache" % i] = MLAAttentionSpec(
                block_size=bs, num_kv_heads=1, max_tp_shards=1,
                head_size=hf.index_head_dim + hf.index_head_dim // 128 * 4, dtype=torch.uint8,
                cache_role=SparseCacheRole.INDEXER)
    return specs


def from_config(o):
    """No engine (vLLM's CPU build refuses sparse attention): the KV cache
    config vLLM's own get_kv_cache_configs builds from the model's specs,
    the tensors its allocate_kv_cache makes, its Scheduler, the connector's
    worker side as vLLM initialises it -- workers first, as in an engine."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                             SchedulerConfig, VllmConfig, set_current_vllm_config)
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
    from vllm.distributed.kv_transfer import (ensure_kv_transfer_initialized,
                                              get_kv_transfer_group)
    from vllm.v1.core.kv_cache_utils import (generate_scheduler_kv_cache_config,
                                             get_kv_cache_configs)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.structured_output import StructuredOutputManager
    from vllm.v1.worker.utils import allocate_kv_cache
    bs = o.get("block_size", 64)
    vc = VllmConfig(
        model_config=ModelConfig(model=o["model"], dtype="bfloat16", max_model_len=2048,
                                 skip_tokenizer_init=True, seed=0),
        cache_config=CacheConfig(block_size=bs, enable_prefix_caching=False),
        scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=2048,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both", kv_connector_extra_config=dict(
                kvtier_segment=o["segment"], kvtier_tier_gib=o.get("tier_gib", 0.25))),
        device_config=DeviceConfig("cpu"))
    vc.cache_config.block_size = bs
    vc.cache_config.num_gpu_blocks_override = o.get("blocks", 400)
    vc.scheduler_config.disable_hybrid_kv_cache_manager = False
    ctx = set_current_vllm_config(vc)
    ctx.__enter__()
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method="tcp://127.0.0.1:%d" % _free_port())
    ensure_model_parallel_initialized(1, 1)
    layout = o.get("layout", "LBNHC")
    vc.cache_config.kv_cache_layout = layout
    specs = glm_specs(o, vc)
    worker_cfg = get_kv_cache_configs(vc, [specs], [1 << 30])[0]
    worker_cfg.kv_cache_layout = layout
    sched_cfg = generate_scheduler_kv_cache_config([worker_cfg])
    vc.cache_config.num_gpu_blocks = worker_cfg.num_blocks
    ensure_kv_transfer_initialized(vc, worker_cfg)
    wc = get_kv_transfer_group()
    kv = allocate_kv_cache(worker_cfg, torch.device("cpu"), KVCacheLayout[layout])
    wc.register_kv_caches(kv)
    sched = Scheduler(vllm_config=vc, kv_cache_config=sched_cfg,
                      structured_output_manager=StructuredOutputManager(vc),
                      block_size=bs, log_stats=True)
    return None, sched, wc, kv, vc


def main():
    o = json.loads(sys.argv[1])
    packing = o.get("kind", "engine") == "engine" and standin_weight_packing()
    llm, sched, wc, kv, vc = engine(o) if o.get("kind", "engine") == "engine" else from_config(o)
    d = Driver(sched, wc, kv, vc)
    hits = {"hit_tokens": 0}
    stat = sched.connector._stat

    def count(name, v=1):
        if name in hits:
            hits[name] += v
        stat(name, v)
    sched.connector._stat = count
    if o.get("break") == "skip-cache":
        # the mutated step: the last vLLM group's blocks are left out of
        # every load (the check must see them unwritten)
        from kvtier.vllm import _scheduler
        real = _scheduler._load_tables

        def skip_last(*a):
            tables, error = real(*a)
            tables[-1] = [kvtier.BLOCK_SKIP] * len(tables[-1])
            return tables, error
        _scheduler._load_tables = skip_last
    chunk = wc._s.chunk_tokens
    a = tokens(3 * chunk + 40, 1)
    d.add("a", a, 2)
    d.run()
    # every block poisoned: what b reads of its prefix is what kvtier loaded
    # (a's freed blocks would otherwise still hold the same bytes)
    for t in kv.values():
        t.fill_(253)
    b = a[:3 * chunk] + tokens(50, 2)
    d.expect_loaded["b"] = 3 * chunk
    d.add("b", b, 2)
    d.run()
    plan = wc._s.plan
    print(json.dumps({
        "finished": sorted(d.finished), "checked": d.checked,
        "loaded_blocks": len(d.loaded_blocks), "external": d.external,
        "wrong": d.wrong[:5], "n_wrong": len(d.wrong),
        "hit_tokens": hits["hit_tokens"],
        "worker_stats": wc._stats.data if wc._stats else {},
        "hma": not vc.scheduler_config.disable_hybrid_kv_cache_manager,
        "chunk_tokens": chunk,
        "vgroups": [[v.index, v.kind, v.block_size, v.bpc, v.tail] for v in plan.vgroups],
        "kgroups": [[k.vg, len(k.layers), k.pieces, k.data, k.run, k.tpb] for k in plan.kgroups],
        "model": wc._s.model, "sched_model": sched.connector._s.model,
        "standin_packing": packing,
        "groups": [len(g.layer_names) for g in sched.kv_cache_config.kv_cache_groups],
    }), file=sys.__stdout__, flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
