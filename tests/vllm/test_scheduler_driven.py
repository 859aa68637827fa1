"""kvtier's connector driven by a vLLM release's own code, with no model:
its Scheduler (schedule / update_from_output, the connector's scheduler
side inside it) and its own worker-side driver of the connector
(vllm.v1.worker.gpu.kv_connector.ActiveKVConnector: pre_forward,
post_forward -- handle_preemptions, bind_connector_metadata,
start_load_kv, wait_for_save, get_transfer_results, as its GPU model
runner calls them).  A stand-in forward pass writes each token's K and V
in its block as a function of the tokens up to it; every time the
scheduler schedules a request, the K and V of the tokens it says are
computed -- from vLLM's prefix cache or loaded from kvtier -- are checked
against that function, byte for byte.

Through a finish (saved), a prompt sharing its prefix after the prefix
cache was reset (kvtier's hits, loaded exact), an abort while loading
(nothing pinned after), and preemptions (a KV cache too small for the
prompts at once: the scheduler preempts, the requests resume and finish,
every check exact).  The three finishes and an abort are also checked in
the connector's own state: nothing is left of any request.

Why this test: vLLM's CUDA package (0.33, 0.34) has no CPU build, so no
engine of it runs here.  This drives those releases' own scheduler and
connector code: tests/vllm/other-releases.sh unpacks their wheel without
its compiled parts and puts it first on PYTHONPATH, beside the CPU torch
of tests/vllm's environment (what runs then: vllm/ from that wheel; torch,
transformers and the rest from the 0.32 environment).  Not run on them:
the attention kernels, the GPU model runner's own bookkeeping around the
driver, CUDA copies.  Otherwise it runs on the installed release, with the
rest of tests/vllm."""

import hashlib
import os
import socket
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bindings", "python"))
sys.path.insert(0, HERE)

import pytest  # noqa: E402
import torch  # noqa: E402

import kvtier  # noqa: E402
import models  # noqa: E402
from standin import request, runner_output, sampled_token, settle, tokens  # noqa: E402

BLOCK = 16          # vLLM's block, tokens
CHUNK = 32          # kvtier's chunk: two blocks
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, DIM = 2, 64  # tests/vllm/models.py's llama


def _free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def kv_value(tokens, layer, half):
    """A token's K (half 0) or V (1) in a layer: a function of the tokens
    up to and including it, small integers that bfloat16 holds exactly."""
    h = hashlib.blake2b(bytes(str(tokens), "ascii"), digest_size=8).digest()
    return float((h[half] + 7 * layer) % 251)


class Harness:
    """One vLLM scheduler and one worker-side connector on a segment of its
    own, the stand-in forward pass, and the checks."""

    def __init__(self, tmp_path, segment, num_blocks, max_tokens_step=256, **extra):
        # vLLM's platform and config set process-wide variables (LD_PRELOAD,
        # the worker start method, thread counts) as an engine process of
        # its own would: put back at close, so that no engine a later test
        # starts inherits them
        self._environ = dict(os.environ)
        import vllm
        from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                                 SchedulerConfig, VllmConfig, set_current_vllm_config)
        from vllm.distributed import (ensure_model_parallel_initialized,
                                      init_distributed_environment)
        from vllm.distributed.kv_transfer import (ensure_kv_transfer_initialized,
                                                  get_kv_transfer_group)
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.gpu.kv_connector import ActiveKVConnector

        self.version = vllm.__version__
        expect = os.environ.get("KVTIER_VLLM_EXPECT")   # other-releases.sh's
        assert not expect or self.version == expect, (self.version, vllm.__file__)
        model_dir = str(tmp_path / "llama")
        os.makedirs(model_dir, exist_ok=True)
        models.config("llama").save_pretrained(model_dir)   # config.json: no weights needed
        cfg = dict(kvtier_segment=segment, kvtier_tier_gib=0.0625, kvtier_chunk_tokens=CHUNK)
        cfg.update(extra)
        self.vllm_config = VllmConfig(
            model_config=ModelConfig(model=model_dir, dtype="bfloat16", max_model_len=1024,
                                     skip_tokenizer_init=True, seed=0),
            cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
            scheduler_config=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=max_tokens_step,
                                             max_model_len=1024, enable_chunked_prefill=True,
                                             is_encoder_decoder=False),
            kv_transfer_config=KVTransferConfig(kv_connector="KvtierConnector",
                                                kv_connector_module_path="kvtier.vllm",
                                                kv_role="kv_both", kv_connector_extra_config=cfg),
            device_config=DeviceConfig("cpu"))
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        # what the engine core resolves from the attention backend: this
        # stand-in's tensors are [K/V, block, token, head, dim]
        self.vllm_config.cache_config.kv_cache_layout = "LBNHC"
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=DIM,
                                 dtype=torch.bfloat16)
        self.kv_cache_config = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                                             kv_cache_groups=[KVCacheGroupSpec(list(LAYERS),
                                                                               spec)])
        self.kv_cache_config.kv_cache_layout = "LBNHC"
        self._ctx = set_current_vllm_config(self.vllm_config)
        self._ctx.__enter__()
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method="tcp://127.0.0.1:%d" % _free_port())
        ensure_model_parallel_initialized(1, 1)
        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.sched = Scheduler(vllm_config=self.vllm_config, kv_cache_config=self.kv_cache_config,
                               structured_output_manager=StructuredOutputManager(self.vllm_config),
                               block_size=BLOCK, log_stats=True)
        ensure_kv_transfer_initialized(self.vllm_config, self.kv_cache_config)
        self.worker_connector = get_kv_transfer_group()
        # vLLM's flash-attention layout: K and V apart, [2, blocks, block, heads, dim]
        self.kv = {n: torch.zeros((2, num_blocks, BLOCK, HEADS, DIM), dtype=torch.bfloat16)
                   for n in LAYERS}
        self.driver = ActiveKVConnector(self.vllm_config, self.kv)
        self.checked = 0          # token positions whose K and V were checked
        self.preempted = 0
        self.finished = {}        # req_id -> output tokens

    def close(self):
        from vllm.distributed import destroy_distributed_environment, destroy_model_parallel
        from vllm.distributed.kv_transfer import kv_transfer_state
        self.sched.shutdown()
        self.worker_connector.shutdown()
        kv_transfer_state._KV_CONNECTOR_AGENT = None
        destroy_model_parallel()
        destroy_distributed_environment()
        self._ctx.__exit__(None, None, None)
        os.environ.clear()
        os.environ.update(self._environ)

    def add(self, req_id, prompt, max_tokens):
        r = request(req_id, prompt, max_tokens, self.hasher)
        self.sched.add_request(r)
        return r

    def abort(self, req_id):
        from vllm.v1.request import RequestStatus
        self.sched.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def _blocks(self, req_id):
        return self.sched.kv_cache_manager.get_block_ids(req_id)[0]

    def _forward(self, out):
        """The stand-in model: checks the K and V of each scheduled request's
        computed tokens, writes those of the tokens it computes now, and
        samples a token for each request whose prompt is done."""
        sampled = {}
        for rid, n in out.num_scheduled_tokens.items():
            r = self.sched.requests[rid]
            toks = r.all_token_ids
            start = r.num_computed_tokens - n   # schedule() advanced it already
            blocks = self._blocks(rid)
            for p in range(start + n):
                b, o = blocks[p // BLOCK], p % BLOCK
                for li, name in enumerate(LAYERS):
                    for half in (0, 1):
                        want = kv_value(toks[:p + 1], li, half)
                        if p < start:
                            got = self.kv[name][half, b, o]
                            if not bool((got == want).all()):
                                raise AssertionError(
                                    "vLLM %s: request %s token %d (block %d) layer %d %s: "
                                    "%s, not %s -- wrong KV" % (
                                        self.version, rid, p, b, li, "KV"[half],
                                        got.flatten()[0].item(), want))
                        else:
                            self.kv[name][half, b, o] = want
                if p < start:
                    self.checked += 1
            if start + n >= r.num_prompt_tokens:
                sampled[rid] = [sampled_token(toks[:start + n])]
        return sampled

    def step(self):
        out = self.sched.schedule()
        self.preempted += len(getattr(out, "preempted_req_ids", None) or ())
        self.driver.pre_forward(out)
        sampled = self._forward(out)
        self.driver.finish_forward()
        kvo = self.driver.post_forward(out.finished_req_ids)
        eco = self.sched.update_from_output(
            out, runner_output(list(out.num_scheduled_tokens), sampled, kvo))
        settle(out, self.worker_connector)
        for o in eco.values():
            for ro in o.outputs:
                if ro.finish_reason is not None:
                    self.finished[ro.request_id] = ro
        return out

    def run(self, steps=400):
        for _ in range(steps):
            if not self.sched.has_requests():
                return
            self.step()
        raise AssertionError("vLLM %s: requests still running after %d steps" % (self.version,
                                                                                   steps))


@pytest.fixture
def segment():
    name = "vllm-sched-%d" % os.getpid()
    yield name
    try:
        kvtier.unlink(name)
    except kvtier.KvtierError:
        pass


def no_pins(segment):
    with kvtier.Tier(segment=segment, role="client") as t:
        st = t.stats()
    assert st["leases_live"] == 0, st
    assert st["slots_pinned"] == 0, st
    return st


def test_scheduler_driven(tmp_path, segment):
    h = Harness(tmp_path, segment, num_blocks=64)
    try:
        # a finish: prefilled in steps, decoded, saved through the worker side
        a = tokens(8 * CHUNK + 5, 1)
        h.add("a", a, max_tokens=4)
        h.run()
        assert "a" in h.finished
        # the prefix cache forgotten: the same prefix is kvtier's hits now
        assert h.sched.reset_prefix_cache()
        b = a[:8 * CHUNK] + tokens(40, 2)
        h.add("b", b, max_tokens=3)
        before = h.checked
        h.run()
        assert "b" in h.finished
        assert h.checked - before >= 8 * CHUNK, (h.checked, before)   # loaded, then checked
        # an abort while loading
        assert h.sched.reset_prefix_cache()
        c = a[:6 * CHUNK] + tokens(9, 3)
        h.add("c", c, max_tokens=2)
        h.step()
        h.abort("c")
        h.run()
        assert "c" not in h.sched.requests
        no_pins(segment)
    finally:
        h.close()


def test_scheduler_driven_preemption(tmp_path, segment):
    """A KV cache of 24 blocks and four prompts of 9-10 blocks each: vLLM
    preempts; every resume, from kvtier or recomputed, checks exact."""
    h = Harness(tmp_path, segment, num_blocks=24, max_tokens_step=128)
    try:
        shared = tokens(4 * CHUNK, 9)
        for i in range(4):
            h.add("p%d" % i, shared + tokens(CHUNK + 7 * i, 10 + i), max_tokens=24)
        h.run(2000)
        assert sorted(h.finished) == ["p0", "p1", "p2", "p3"]
        assert h.preempted > 0, "no preemption: the test proves nothing"
        no_pins(segment)
    finally:
        h.close()
