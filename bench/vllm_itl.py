"""Decode step time of 4 requests decoding while a long prompt is loaded
from kvtier, and while long new prompts are saved to it: the vLLM
connector's loads and saves waited for in the step (kvtier_async off)
against off the step (the default), on one model in one run; and the time
to first token of the loaded prompt.  A Llama-shaped model with dummy
weights (config.json only) whose KV is large for its compute (few, narrow
layers, 8 KV heads x 128), so that the copies are visible next to the
forward pass on a CPU.  vLLM's CPU build.

  KVTIER_LIBRARY=build/tier/libkvtier.so \\
      build/vllm-venv/bin/python bench/vllm_itl.py [--tokens 4000] [--repeat 3]

For each mode and scenario, --repeat runs; the inter-token gaps of the 4
decoders from the moment the long prompt(s) are added until they are done
(and --after-gaps gaps after: an asynchronous copy may slow the steps
that follow), pooled over the runs: p50, p90, p99, max and mean; and the
long prompts' TTFT (median).  In the save scenario the window holds the
long prompts' prefill step, the same in both modes."""

import argparse
import json
import os
import statistics
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "vllm"))
sys.path.insert(0, os.path.join(HERE, "..", "bindings", "python"))
from test_vllm_kvtier import Engine, tokens  # noqa: E402
import kvtier  # noqa: E402


def pct(v, q):
    v = sorted(v)
    return v[min(len(v) - 1, int(round(q * (len(v) - 1))))]


def gaps(res, after):
    """Inter-token gaps of the decoders over the window the long prompts
    were in the engine (from their adding to their end, + `after` gaps)."""
    t = res["times"]
    end = max(v[-1] for k, v in t.items() if k.startswith("long"))
    out = []
    for k, v in t.items():
        if not k.startswith("dec"):
            continue
        extra = 0
        for a, b in zip(v, v[1:]):
            if b <= 0:
                continue
            if a > end:
                extra += 1
                if extra > after:
                    break
            out.append(b - max(a, 0.0))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--saves", type=int, default=2, help="long new prompts in the save scenario")
    ap.add_argument("--after-gaps", type=int, default=20)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="kvtier-itl-")
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": a.hidden, "intermediate_size": a.hidden * 2,
           "num_hidden_layers": a.layers, "num_attention_heads": 8,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 4096,
           "max_position_embeddings": 16384, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    kv_bytes = a.layers * 2 * 8 * 128 * 2
    seg = "itl-%d" % os.getpid()
    long_prompt = tokens(a.tokens, 11)
    decoders = [tokens(128, 20 + i) for i in range(4)]
    print("model: %d layers, hidden %d, 8 KV heads x 128 (bf16): %d KiB of KV per token, "
          "%.1f MiB for a %d-token prompt; 4 decoders of 128 tokens"
          % (a.layers, a.hidden, kv_bytes // 1024, kv_bytes * a.tokens / 2**20, a.tokens))
    common = dict(blocks=None, max_num_seqs=8, max_model_len=a.tokens + 512,
                  env={"VLLM_CPU_KVCACHE_SPACE": "3"})
    rows = []
    seed = 1000
    for mode, asyn in (("synchronous", False), ("asynchronous", True)):
        e = Engine(d, {"kvtier_segment": seg, "kvtier_tier_gib": 3, "kvtier_async": asyn},
                   **common)
        try:
            e.cmd(cmd="generate", prompts=[long_prompt], max_tokens=1)  # in the tier
            e.cmd(cmd="generate", prompts=decoders, max_tokens=4)       # warm-up
            for scen in ("load", "save"):
                g, ttft = [], []
                for _ in range(a.repeat):
                    if scen == "load":
                        e.cmd(cmd="reset_prefix_cache")   # the long prompt: kvtier's only
                        longs = [long_prompt]
                    else:
                        longs = [tokens(a.tokens, seed + i) for i in range(a.saves)]
                        seed += a.saves
                    r = e.cmd(cmd="itl", decoders=decoders, decode_tokens=200, long=longs,
                              after=4)
                    g.extend(gaps(r, a.after_gaps))
                    ttft.append(min(v[0] for k, v in r["times"].items()
                                    if k.startswith("long")))
                rows.append((mode, scen, g, ttft))
                print("%-12s %-4s ITL p50 %6.1f  p90 %6.1f  p99 %6.1f  max %6.1f  mean %6.1f ms "
                      "(%d gaps)  %s %7.1f ms" % (mode, scen, 1000 * pct(g, 0.5),
                                                 1000 * pct(g, 0.9), 1000 * pct(g, 0.99),
                                                 1000 * max(g), 1000 * statistics.mean(g),
                                                 len(g),
                                       "TTFT of the loaded prompt" if scen == "load"
                                       else "TTFT of the new prompts",
                                       1000 * statistics.median(ttft)), flush=True)
            m = e.metrics()
            print("  connector: %s" % ", ".join(
                "%s %s" % (k.split("kvtier_")[1], round(v, 3)) for k, v in sorted(m.items())
                if k.startswith("vllm:kvtier_") and v), flush=True)
        finally:
            e.close()
    try:
        kvtier.unlink(seg)
    except kvtier.KvtierError:
        pass


if __name__ == "__main__":
    main()
