"""Tiny models with real, randomly initialised weights for the vLLM engine
tests, one per KV cache group type vLLM's CPU build runs: written by
transformers (safetensors) into a directory the test owns.

Why not vLLM's load_format="dummy": it fills every weight with uniform
noise of +-1e-3, and a model that small ignores its context (changing
tokens 0-99 or 150-299 of a 340-token prompt leaves all 8 output tokens the
same), so "the outputs with kvtier equal the outputs without" could not
see wrong KV.  transformers' own initialisation (normal, std 0.02) gives a
model whose greedy output follows its context; test_vllm_kvtier.py checks
that for every model before it trusts a comparison (sensitive()).

Kinds, and the KV cache group vLLM makes of them (with the kvtier
connector, which turns vLLM's hybrid allocator off):
  llama      full attention, GQA (4 query heads, 2 KV heads, head_dim 64)
  mistral    sliding window of 128 tokens on every layer: SlidingWindowSpec
  deepseek   MLA (kv_lora_rank 512 + rope 64: the 576-byte latent the CPU
             MLA backend takes); vLLM's CPU build forces 16-token blocks
             and turns prefix caching off for it
  gemma2     hybrid: sliding-window and full layers alternating; promoted
             to one full-attention group
"""

import os

BASE = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=1024, max_position_embeddings=1536,
            rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, initializer_range=0.02)

KINDS = ("llama", "mistral", "deepseek", "gemma2")
SLIDING_WINDOW = 128


def config(kind):
    from transformers import AutoConfig
    b = dict(BASE)
    if kind == "llama":
        return AutoConfig.for_model("llama", **b)
    if kind == "mistral":
        return AutoConfig.for_model("mistral", sliding_window=SLIDING_WINDOW, **b)
    if kind == "deepseek":
        b.pop("head_dim")
        b["num_key_value_heads"] = 4
        # two dense layers (first_k_dense_replace): no MoE kernels needed
        return AutoConfig.for_model(
            "deepseek_v2", kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
            qk_nope_head_dim=32, v_head_dim=32, n_routed_experts=4, num_experts_per_tok=2,
            n_shared_experts=1, moe_intermediate_size=128, first_k_dense_replace=2,
            moe_layer_freq=1, **b)
    if kind == "gemma2":
        b["tie_word_embeddings"] = True   # vLLM's Gemma2 has no separate lm_head
        return AutoConfig.for_model("gemma2", sliding_window=SLIDING_WINDOW,
                                    query_pre_attn_scalar=64, **b)
    raise ValueError("unknown model kind %r (%s)" % (kind, ", ".join(KINDS)))


def make(kind, path, seed=0, tokenizer=False):
    """Writes model `kind` with weights drawn from `seed` to path (a
    config.json and model.safetensors; with tokenizer, a word-level
    tokenizer too: token i is the word "t<i>", for the OpenAI server);
    returns path."""
    import torch
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    m = AutoModelForCausalLM.from_config(config(kind), torch_dtype=torch.bfloat16)
    os.makedirs(path, exist_ok=True)
    m.save_pretrained(path, safe_serialization=True)
    if tokenizer:
        write_tokenizer(path, BASE["vocab_size"])
    return path


def write_tokenizer(path, vocab_size):
    """A word-level tokenizer: "t5 t17" is [5, 17]; ids 0-2 are <unk>,
    <s>, </s> (the models' bos 1, eos 2)."""
    from tokenizers import Tokenizer, decoders, models as tm, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    vocab.update({"t%d" % i: i for i in range(3, vocab_size)})
    tok = Tokenizer(tm.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>",
                                   eos_token="</s>")
    fast.save_pretrained(path)


def text(ids):
    """Token ids as the word-level tokenizer's text."""
    return " ".join("t%d" % i for i in ids)
