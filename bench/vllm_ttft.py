"""Time to first token of a long prompt re-sent after it left vLLM's own
prefix cache, on one model in one run: recomputed (an engine without a
tier) and loaded from kvtier (an engine with the connector), both after
vLLM's prefix cache was reset.  A Llama-shaped model with dummy weights
(config.json only), vLLM's CPU build.

  KVTIER_LIBRARY=build/tier/libkvtier.so VLLM_CPU_KVCACHE_SPACE=2 \\
      build/vllm-venv/bin/python bench/vllm_ttft.py [--tokens 3000] [--repeat 5]

Prints the median of --repeat measurements of each (generate with
max_tokens=1, timed inside the engine process)."""

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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    a = ap.parse_args()
    d = tempfile.mkdtemp(prefix="kvtier-ttft-")
    heads = a.hidden // 128
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
           "hidden_size": a.hidden, "intermediate_size": a.hidden * 11 // 4,
           "num_hidden_layers": a.layers, "num_attention_heads": heads,
           "num_key_value_heads": heads, "head_dim": 128, "vocab_size": 32000,
           "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "torch_dtype": "bfloat16", "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    kv_bytes = a.layers * 2 * heads * 128 * 2
    seg = "ttft-%d" % os.getpid()
    prompt = tokens(a.tokens, 11)
    common = dict(blocks=None, max_num_seqs=1, max_model_len=a.tokens + 64)
    print("model: %d layers, hidden %d, %d KV heads x 128 (bf16): %d KiB of KV per token, "
          "%.1f MiB for the %d-token prompt" % (a.layers, a.hidden, heads, kv_bytes // 1024,
                                               kv_bytes * a.tokens / 2**20, a.tokens))
    res = {}
    for name, kvc in (("recomputed (no tier)", None),
                      ("loaded from kvtier", {"kvtier_segment": seg, "kvtier_tier_gib": 2})):
        e = Engine(d, kvc, env={"VLLM_CPU_KVCACHE_SPACE": "2"}, **common)
        try:
            out0 = e.cmd(cmd="generate", prompts=[prompt], max_tokens=1)  # warm-up; saves
            times = []
            for _ in range(a.repeat):
                e.cmd(cmd="reset_prefix_cache")
                r = e.cmd(cmd="generate", prompts=[prompt], max_tokens=1)
                assert r["outputs"] == out0["outputs"], "outputs differ"
                times.append(r["seconds"])
            res[name] = times
            print("%-22s TTFT median %7.1f ms  (%s)" % (name, 1000 * statistics.median(times),
                                                       ", ".join("%.1f" % (1000 * t) for t in times)),
                  flush=True)
        finally:
            e.close()
    try:
        with kvtier.Tier(segment=seg, role="client") as t:
            st = t.stats()
        print("kvtier: %d lookups, %d hit tokens, %d chunks loaded" %
              (st["lookups"], st["hit_tokens"], st["loaded_chunks"]))
        kvtier.unlink(seg)
    except kvtier.KvtierError:
        pass
    r, k = (statistics.median(v) for v in res.values())
    print("speed-up: %.1fx (recomputed / loaded)" % (r / k))


if __name__ == "__main__":
    main()
