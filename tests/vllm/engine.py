"""One real vLLM engine (CPU) in its own process, driven over stdin/stdout
by tests/vllm/test_vllm_kvtier.py: a JSON command per line, a JSON answer
per line.  argv[1] is a JSON object of options:

  model        the model directory (config.json and safetensors weights;
               a config.json alone: vLLM's dummy weights)
  kvtier       null (no connector) or kv_connector_extra_config for kvtier
  transfer     instead of kvtier: a whole kv_transfer_config (MultiConnector)
  blocks       num_gpu_blocks_override (a small KV cache forces evictions)
  tp           tensor_parallel_size
  batched_tokens  max_num_batched_tokens (chunked prefill), default vLLM's
  attention_backend  vLLM's attention backend by name (CPU_MLA), default
               the platform's choice
  kv_cache_dtype  vLLM's --kv-cache-dtype (the CPU build: auto, fp8,
               fp8_e4m3, fp8_e5m2), default auto

Commands: {"cmd": "generate", "prompts": [[ids]], "max_tokens": n}
-> {"outputs": [[ids]]};  {"cmd": "metrics"} -> vLLM's counters;
{"cmd": "abort", "prompts": [[ids]], "steps": k} (adds them, runs k steps,
aborts them, runs until idle) -> {};  {"cmd": "reset_prefix_cache"};
{"cmd": "itl", ...} (bench/vllm_itl.py: token times of decoders while long
prompts are added, see itl()); {"cmd": "exit"}.
"""

import json
import os
import sys
import time


def zero_kv_caches(worker):
    """Zeroes a worker's KV cache (collective_rpc).  vLLM's CPU attention
    reads the slots of a block that no token of the request wrote and
    masks them arithmetically: a NaN bit pattern there (never-written
    memory) turns every output into token 0 -- shown by filling the cache
    with 0xffff before a request (finite values there change nothing).
    Two CI runs saw an engine part from its baseline on a request kvtier
    had no chunk of; with the caches zeroed at start both engines of a
    comparison start from the same bytes."""
    import torch

    def walk(x):
        if isinstance(x, torch.Tensor):
            x.zero_()
            return 1
        if isinstance(x, dict):
            return sum(walk(v) for v in x.values())
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        return 0
    return walk(getattr(worker.model_runner, "kv_caches", None))


def main():
    o = json.loads(sys.argv[1])
    # the zeroing function reaches the workers by value (cloudpickle)
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    weights = any(f.endswith(".safetensors") for f in os.listdir(o["model"]))
    kw = dict(model=o["model"], load_format="auto" if weights else "dummy",
              skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=o.get("max_model_len", 1536), enforce_eager=True,
              max_num_seqs=o.get("max_num_seqs", 4), block_size=o.get("block_size", 32),
              seed=0, disable_log_stats=False, tensor_parallel_size=o.get("tp", 1))
    if o.get("prefix_caching") is not None:
        kw["enable_prefix_caching"] = o["prefix_caching"]
    if o.get("batched_tokens"):   # chunked prefill in steps of this many tokens
        kw["max_num_batched_tokens"] = o["batched_tokens"]
        kw["enable_chunked_prefill"] = True
    if o.get("blocks"):
        kw["num_gpu_blocks_override"] = o["blocks"]
    if o.get("attention_backend"):
        kw["attention_config"] = {"backend": o["attention_backend"]}
    if o.get("kv_cache_dtype"):
        kw["kv_cache_dtype"] = o["kv_cache_dtype"]
    if o.get("transfer") is not None:   # a whole kv_transfer_config (MultiConnector)
        kw["kv_transfer_config"] = KVTransferConfig(**o["transfer"])
    elif o.get("kvtier") is not None:
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.vllm",
            kv_role="kv_both", kv_connector_extra_config=o["kvtier"])
    t0 = time.time()
    llm = LLM(**kw)
    assert all(llm.collective_rpc(zero_kv_caches)), "no KV cache to zero"
    out = sys.__stdout__
    print(json.dumps({"ready": True, "pid": os.getpid(), "start_s": time.time() - t0}),
          file=out, flush=True)

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, detokenize=False)

    for line in sys.stdin:
        m = json.loads(line)
        c = m["cmd"]
        if c == "exit":
            break
        if c == "generate":
            t = time.perf_counter()
            res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in m["prompts"]],
                               params(m.get("max_tokens", 8)), use_tqdm=False)
            ans = {"outputs": [list(r.outputs[0].token_ids) for r in res],
                   "seconds": time.perf_counter() - t}
        elif c == "metrics":
            ans = {}
            for x in llm.get_metrics():
                v = getattr(x, "value", None)
                if isinstance(v, (int, float)):
                    ans[x.name] = ans.get(x.name, 0) + v
        elif c == "reset_prefix_cache":
            ans = {"ok": bool(llm.reset_prefix_cache())}
        elif c == "abort":
            eng = llm.llm_engine
            ids = []
            for i, p in enumerate(m["prompts"]):
                rid = "abort-%d-%d" % (time.monotonic_ns(), i)
                eng.add_request(rid, TokensPrompt(prompt_token_ids=p), params(64))
                ids.append(rid)
            for _ in range(m.get("steps", 1)):
                eng.step()
            eng.abort_request(ids)
            while eng.has_unfinished_requests():
                eng.step()
            # The abort reaches the engine-core process as a message; a
            # request sent after it completes only once the core has
            # processed it (and run the connector's request_finished).
            llm.generate([TokensPrompt(prompt_token_ids=[5, 6, 7])], params(1), use_tqdm=False)
            ans = {"aborted": len(ids)}
        elif c == "itl":
            ans = itl(llm, m, params, TokensPrompt)
        else:
            ans = {"error": "unknown command %r" % c}
        print(json.dumps(ans), file=out, flush=True)


def itl(llm, m, params, TokensPrompt):
    """Decoders, and long prompts added once they decode: each request's
    token times (seconds since the long prompts were added), for
    bench/vllm_itl.py.  {"cmd": "itl", "decoders": [[ids]], "decode_tokens":
    n, "long": [[ids]], "after": k (steps before the long prompts)}"""
    eng = llm.llm_engine
    tag = time.monotonic_ns()
    for i, p in enumerate(m["decoders"]):
        eng.add_request("d%d-%d" % (tag, i), TokensPrompt(prompt_token_ids=p),
                        params(m["decode_tokens"]))
    times, seen, t_add, steps = {}, {}, None, 0
    while eng.has_unfinished_requests():
        if steps == m.get("after", 4):
            t_add = time.perf_counter()
            for i, p in enumerate(m["long"]):
                eng.add_request("L%d-%d" % (tag, i), TokensPrompt(prompt_token_ids=p),
                                params(1))
        outs = eng.step()
        now = time.perf_counter()
        steps += 1
        for o in outs:
            n = len(o.outputs[0].token_ids) if o.outputs else 0
            if n > seen.get(o.request_id, 0):
                seen[o.request_id] = n
                times.setdefault(o.request_id, []).append(now)
    base = t_add or 0.0
    return {"times": {("long" if k.startswith("L") else "dec") + k.split("-", 1)[1]:
                      [t - base for t in v] for k, v in times.items()},
            "steps": steps}


if __name__ == "__main__":
    # vLLM and its engine-core and worker processes (which inherit fd 1)
    # print on stdout: the answers get a descriptor of their own, and fd 1
    # becomes stderr for everything else
    answers = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sys.__stdout__ = answers
    main()
