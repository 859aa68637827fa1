"""DeepSeek V4's KV caches through kvtier, with vLLM's hybrid KV cache
manager on: a real vLLM 0.32 CPU engine of a two-layer DeepSeek V4 (block
size 256, vLLM's fp8_ds_mla KV, every cache kind the model has: the
compressed MLA caches of 4 and 128 tokens a state, the indexer's keys, the
compressors' state caches of 4- and 8-token blocks, the sparse-SWA caches
of 64-token blocks -- five KV cache groups) and kvtier's connector.

What runs: vLLM's engine start (its model, the KV cache config it builds
with the hybrid allocator on, its KV tensors, the connector's both sides
registered by vLLM), its scheduler with the connector inside it, the
connector's worker side as vLLM's worker drives it, kvtier's copies.
What does not: the model's forward pass.  vLLM 0.32's DeepSeek V4 on a
CPU needs AMX (its attention and indexer kernels are AMX's) and
triton-cpu; with AVX-512 the first forward fails in the indexer's
metadata, and without it (vLLM's AVX2 kernel library) the engine does
not even start -- its weight loading packs the weights for that forward
with an op the AVX2 library lacks -- both quoted by
test_deepseek_v4_forward_cannot_run_here.  The driver stands a no-op in
for that packing op on such a CPU (hybrid_driver.py says so in its
output), so the engine starts and its KV caches are checked on any x86
CPU, CI's included.  So the
forward is hybrid_driver.py's stand-in: every block of every cache of
every group gets bytes that are a function of the prefix and the cache,
and every block vLLM still holds of a request's computed tokens is
checked against that function whenever the request is scheduled -- after
the whole KV cache was poisoned, so what a request reads of its prefix is
what kvtier loaded.  The next-smallest real thing: outputs cannot be
compared, bytes are."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bindings", "python"))
sys.path.insert(0, HERE)

import kvtier  # noqa: E402
import models  # noqa: E402


def run(args, timeout=900):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_ENABLE_V1_MULTIPROCESSING="0")
    p = subprocess.run([sys.executable] + args, capture_output=True, text=True, env=env,
                       timeout=timeout)
    return p.returncode, p.stdout, p.stderr


@pytest.fixture
def v4(tmp_path):
    return models.write_deepseek_v4(str(tmp_path / "dsv4"))


@pytest.fixture
def segment():
    name = "hybrid-%d" % os.getpid()
    yield name
    try:
        kvtier.unlink(name)
    except kvtier.KvtierError:
        pass


def drive(v4, segment, **more):
    o = dict(model=v4, segment=segment, blocks=1000, **more)
    rc, out, err = run([os.path.join(HERE, "hybrid_driver.py"), json.dumps(o)])
    lines = [x for x in out.splitlines() if x.startswith("{")]
    assert rc == 0 and lines, "driver exited %d:\n%s" % (rc, err[-4000:])
    return json.loads(lines[-1])


def test_deepseek_v4_forward_cannot_run_here(v4):
    """The real forward pass of vLLM 0.32's DeepSeek V4 on this CPU (no
    AMX, no triton-cpu), without kvtier: with AVX-512 it fails in the
    indexer's metadata (a triton kernel); without, vLLM's AVX2 kernel
    library lacks the op its weight loading packs weights with, and the
    engine does not start.  Should it run one day, this test fails:
    compare the engine's outputs with and without kvtier then."""
    code = ("import sys; from vllm import LLM, SamplingParams\n"
            "from vllm.inputs import TokensPrompt\n"
            "llm = LLM(model=sys.argv[1], load_format='dummy', skip_tokenizer_init=True, "
            "block_size=256, max_model_len=2048, enforce_eager=True, "
            "num_gpu_blocks_override=1000)\n"
            "llm.generate([TokensPrompt(prompt_token_ids=list(range(3, 600)))], "
            "SamplingParams(max_tokens=2))\nprint('FORWARD-RAN')\n")
    rc, out, err = run(["-c", code, v4])
    assert "FORWARD-RAN" not in out, "vLLM's DeepSeek V4 forward runs here now"
    if models.cpu_lacks_avx512():
        assert "object has no attribute 'convert_weight_packed'" in err, err[-3000:]
    else:
        assert "TypeError: Cannot inspect kernel parameters" in err, err[-3000:]


def test_deepseek_v4_caches_saved_and_loaded_exact(v4, segment):
    r = drive(v4, segment)
    assert r["hma"], "vLLM turned its hybrid KV cache manager off"
    assert r["standin_packing"] == bool(models.cpu_lacks_avx512())
    assert r["groups"] == [3, 2, 1, 1, 1], r["groups"]
    # the chunk: 256 tokens; per vLLM group (index, kind, block, blocks a
    # chunk, kept): the MLA group whole, each window's tail -- 2 blocks of
    # the 8-token window (4-token blocks), 2 of the 128-token SWA windows
    # (64-token blocks), 16 of the 128-token compressor window (8-token)
    assert r["chunk_tokens"] == 256
    assert r["vgroups"] == [[0, "mla", 256, 1, 1], [1, "sliding-mla", 4, 64, 2],
                            [2, "sliding-mla", 64, 4, 2], [3, "sliding-mla", 64, 4, 2],
                            [4, "sliding-mla", 8, 32, 16]], r["vgroups"]
    # every cache of the MLA group, each its own shape, largest first: the
    # 4-token-state cache (64 x 584 bytes, as halves), the indexer's keys
    # (64 states x 132 bytes), the 128-token-state one (2 x 584 = 1,168
    # bytes, copied as 1,280 into its 1,728-byte page's padding)
    assert r["kgroups"][:3] == [[0, 1, 2, 18688, 18688, 256], [0, 1, 1, 8448, 8448, 256],
                                [0, 1, 1, 1168, 1280, 256]], r["kgroups"]
    assert len(r["kgroups"]) == 8
    assert ";caches=" in r["model"] and "kv=fp8_ds_mla" in r["model"]
    assert r["n_wrong"] == 0, r["wrong"]
    assert r["finished"] == ["a", "b"]
    # b's 3-chunk prefix came from kvtier: kvtier's hits are vLLM's
    # external hits, and every block of it vLLM holds was checked: 3 x 3
    # MLA-group caches, and each window's tail of the last chunk (2 x 2,
    # 2, 2, 16)
    assert r["hit_tokens"] == r["external"] == 768, r
    assert r["loaded_blocks"] == 9 + 4 + 2 + 2 + 16, r


def test_deepseek_v4_a_cache_left_out_is_caught(v4, segment):
    """The mutated step: loads that leave one group's blocks unwritten --
    the check sees each of them."""
    r = drive(v4, segment, **{"break": "skip-cache"})
    assert r["n_wrong"] > 0
    assert all("group 4" in w for w in r["wrong"]), r["wrong"]


def test_glm5_caches_saved_and_loaded_exact(tmp_path, segment):
    """GLM-5.x / DeepSeek V3.2: vLLM's CPU build refuses the model
    ("NotImplementedError: Sparse Attention is not supported on CPU.", at
    its attention backend's selection), so no engine runs.  The next
    thing that does: its layers' KV cache specs as vLLM's code makes them
    (fp8_ds_mla MLA caches of 656 bytes a token, the indexer's 132-byte
    keys on the "full" layers), the KV cache config vLLM's
    get_kv_cache_configs builds from them with the hybrid allocator on
    (one group, its layers of two page sizes), the tensors vLLM's
    allocate_kv_cache makes, vLLM's Scheduler with the connector, and the
    connector's worker side -- every cache of every block saved and loaded
    through kvtier, checked byte for byte."""
    glm = models.write_glm5(str(tmp_path / "glm5"))
    rc, out, err = run([os.path.join(HERE, "hybrid_driver.py"),
                        json.dumps(dict(model=glm, segment=segment, kind="config"))])
    lines = [x for x in out.splitlines() if x.startswith("{")]
    assert rc == 0 and lines, err[-4000:]
    r = json.loads(lines[-1])
    assert r["groups"] == [6], r["groups"]          # 4 MLA caches + 2 indexer caches
    # the MLA caches (656 bytes a token, as halves), then the indexer's
    assert r["kgroups"] == [[0, 4, 2, 64 * 328, 64 * 328, 64],
                            [0, 2, 2, 64 * 66, 64 * 66, 64]], r["kgroups"]
    assert r["n_wrong"] == 0, r["wrong"]
    assert r["hit_tokens"] == r["external"] == 192, r
    assert r["loaded_blocks"] == 3 * 6, r              # 3 chunks x 6 caches
    # the scheduler saw one spec per group and joined its ranks' segment
    assert r["model"] != r["sched_model"] and ";caches=" in r["model"]
