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


def cpu_lacks_avx512():
    """Why vLLM's CPU build cannot run what needs its AVX-512 kernels on
    this machine, or "" when it can.  vLLM picks its kernel library by
    torch.cpu._is_avx512_supported() (vllm/platforms/cpu.py): without
    AVX-512 it loads the AVX2 one, which has no fp8 KV cache ("FP8 KV
    cache on CPU requires x86 with AVX-512 or AMX") and no
    convert_weight_packed (DeepSeek V4's weights).  Such a test is
    skipped there, never passed."""
    import torch
    if torch.cpu._is_avx512_supported():
        return ""
    return ("this CPU has no AVX-512: vLLM's CPU build runs its AVX2 kernels, without "
            "fp8 KV caches or DeepSeek V4's packed weights")


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


# DeepSeek V4 (vLLM 0.32's vllm/models/deepseek_v4): the public
# DeepSeek-V4-Flash config.json's fields, with a model small enough for a
# CPU: two layers -- layer 0 compressed-sparse (a state per 4 tokens, the
# indexer), layer 1 heavily compressed (a state per 128 tokens); the
# trailing 0 is the MTP layer's place, as in Flash's compress_ratios.  The
# attention's shapes (head_dim 512, rope 64, window 128, the indexer's 128
# x n heads) are Flash's: they are what the KV caches are made of.
DEEPSEEK_V4_FLASH = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", attention_bias=False,
    hc_eps=1e-06, hc_mult=4, hc_sinkhorn_iters=20, head_dim=512, hidden_act="silu",
    index_head_dim=128, index_topk=512, initializer_range=0.02, n_shared_experts=1,
    norm_topk_prob=True, num_key_value_heads=1, qk_rope_head_dim=64, rms_norm_eps=1e-06,
    rope_theta=10000, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus",
    sliding_window=128, swiglu_limit=10.0, tie_word_embeddings=False, torch_dtype="bfloat16",
    compress_rope_theta=160000, topk_method="noaux_tc")


def write_deepseek_v4(path, compress_ratios=(4, 128, 0)):
    """config.json of a small DeepSeek V4 (see DEEPSEEK_V4_FLASH); vLLM
    makes its weights (load_format dummy)."""
    import json
    c = dict(DEEPSEEK_V4_FLASH, hidden_size=256, num_attention_heads=8, q_lora_rank=64,
             o_groups=2, o_lora_rank=64, n_routed_experts=4, num_experts_per_tok=2,
             moe_intermediate_size=128, num_hash_layers=0, num_nextn_predict_layers=0,
             index_n_heads=4, index_topk=64, vocab_size=1024, max_position_embeddings=4096,
             bos_token_id=1, eos_token_id=2, num_hidden_layers=len(compress_ratios) - 1,
             compress_ratios=list(compress_ratios))
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    return path


def write_glm5(path):
    """config.json of a small GLM-5.x (glm_moe_dsa, the DeepSeek V3.2
    architecture): GLM-5's attention shapes (kv_lora_rank 512, rope 64,
    the indexer's 128-wide keys) on four layers, two of which own an
    indexer cache (indexer_types, as GLM-5.2's 21 of 78)."""
    from transformers import AutoConfig
    c = AutoConfig.for_model(
        "glm_moe_dsa", hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=4,
        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=4, kv_lora_rank=512,
        q_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        index_head_dim=128, index_n_heads=4, index_topk=64, vocab_size=1024,
        max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
        indexer_types=["full", "shared", "full", "shared"])
    c.save_pretrained(path)
    return path
