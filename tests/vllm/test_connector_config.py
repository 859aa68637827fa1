"""The connector's refusals, against vLLM's own config and KV-cache classes
(no engine): a process-seeded block hash, a worker whose process groups
disagree with the parallel config, bad settings."""

import os
import sys
from types import SimpleNamespace

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bindings", "python"))
import kvtier.vllm as kv  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig,  # noqa: E402
                                        KVCacheGroupSpec, MLAAttentionSpec)


def kv_cache_config(mla=False, layers=2):
    if mla:
        spec = MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576, dtype=torch.bfloat16)
    else:
        spec = FullAttentionSpec(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    return KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(["l%d" % i for i in range(layers)],
                                                           spec)])


def vllm_config(tp=1, pp=1, algo="sha256", caching=True, extra=None):
    return SimpleNamespace(
        kv_transfer_config=SimpleNamespace(kv_connector_extra_config=extra or {}),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        data_parallel_rank=0, data_parallel_size=1),
        cache_config=SimpleNamespace(block_size=32, prefix_caching_hash_algo=algo,
                                     enable_prefix_caching=caching),
        model_config=SimpleNamespace(model="tiny", dtype=torch.bfloat16))


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
