"""Every KV cache layout vLLM resolves (KVCacheLayout: LBHNC, LBNHC, LHBNC,
BLHNC, BLNHC, BHLNC), against vLLM's own code: its layout resolution from
the attention backends' supported sets (the ROCm backends', the CPU
backend's, FlashInfer's, and a MultiConnector with NIXL beside kvtier),
and its own per-layer cache views (create_kv_cache_views over a
KVCacheTensor, as the model runner makes them), saved and loaded through
the connector's description of their blocks and the host backend, every
byte compared.  No engine is started."""
import os
import sys
import uuid

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bindings", "python"))

import kvtier  # noqa: E402
from kvtier.vllm import _layout  # noqa: E402

from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.kv_cache_interface import (FullAttentionSpec, MLAAttentionSpec,  # noqa: E402
                                        create_kv_cache_views)

LAYOUTS = [m.name for m in KVCacheLayout]
BLOCK = 16
NUM_BLOCKS = 12
LAYERS = 3


def specs():
    yield "gqa", FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=64,
                                   dtype=torch.bfloat16)
    yield "mla", MLAAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=576,
                                  dtype=torch.bfloat16)


def views(spec, layout):
    """The per-layer caches vLLM's engine makes for LAYERS layers of spec in
    layout: its KV cache config (get_kv_cache_config_from_groups: one
    allocation, the layers' strides from the layout), then each layer's
    strided [B, H, N, C] view of it (create_kv_cache_views), as the model
    runner does."""
    from vllm.config import CacheConfig, VllmConfig
    try:  # 0.33 moved it
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_interface import KVCacheGroupSpec
    names = ["layer.%d" % i for i in range(LAYERS)]
    cc = CacheConfig(block_size=BLOCK)
    cc.kv_cache_layout = layout
    cfg = VllmConfig(cache_config=cc)
    kcc = get_kv_cache_config_from_groups(
        cfg, [KVCacheGroupSpec(names, spec)],
        spec.page_size_bytes * LAYERS * NUM_BLOCKS + spec.page_size_bytes // 2)
    assert kcc.num_blocks == NUM_BLOCKS
    (t,) = kcc.kv_cache_tensors
    raw = torch.zeros(t.size, dtype=torch.int8)
    return raw, create_kv_cache_views(raw, spec, NUM_BLOCKS, KVCacheLayout[layout], t)


def block_bytes(view, b):
    """Block b of a layer's view, its bytes in logical order."""
    return view[b].contiguous().view(torch.uint8).flatten().clone()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["gqa", "mla"])
def test_every_layout_saved_and_loaded_byte_exact(layout, kind):
    spec = dict(specs())[kind]
    page = spec.page_size_bytes
    pieces = _layout.pieces_per_block(spec, layout, LAYERS)
    heads = spec.num_kv_heads
    # a head-outer layout's block is one run per KV head; the rest one run
    assert pieces == (heads if layout in _layout.HEAD_OUTER and heads > 1 else 2)
    raw, vs = views(spec, layout)
    raw.view(torch.uint8).copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8))
    spans = []
    for i, v in enumerate(vs):
        spans.extend(_layout.block_runs(v, NUM_BLOCKS, page, pieces, "layer.%d" % i, layout))
    strides = {s for _, s in spans}
    assert len(strides) == 1
    group = kvtier.Group(pieces * LAYERS, page // (pieces * BLOCK), BLOCK, kind == "mla")
    name = "lay-" + uuid.uuid4().hex[:10]
    try:
        with kvtier.Tier(segment=name, role="rank", rank=0, world=1, groups=[group],
                         chunk_tokens=BLOCK, create=True, dma="host", no_env=True,
                         model="layout-test;layout=%s" % layout) as t:
            t.register_kv(groups=[([b for b, _ in spans], strides.pop(), NUM_BLOCKS)])
            keys = np.array([[i + 1, 7] for i in range(4)], dtype=np.uint64)
            src, dst = [1, 2, 3, 4], [8, 9, 10, 11]
            want = {(i, b): block_bytes(v, b) for i, v in enumerate(vs) for b in src}
            t.save(keys, np.array(src, dtype=np.uint32)).wait()
            with t.lookup(keys) as lease:
                assert lease.hits == 4
                t.load(lease, np.array(dst, dtype=np.uint32)).wait()
            for i, v in enumerate(vs):
                for s, d in zip(src, dst):
                    assert torch.equal(block_bytes(v, d), want[(i, s)]), \
                        "layer %d block %d (from %d) differs in %s" % (i, d, s, layout)
            # the other blocks were not written
            for i, v in enumerate(vs):
                for b in (0, 5, 6, 7):
                    assert not torch.equal(block_bytes(v, b), want[(i, 1)])
    finally:
        kvtier.unlink(name)


def test_a_tensor_whose_blocks_are_elsewhere_is_refused():
    """A worker's tensor that the resolved layout does not describe (here
    head-outer caches given to a segment geometry of block-contiguous
    halves) is refused, naming the layer and the layout."""
    spec = dict(specs())["gqa"]
    _, vs = views(spec, "LHBNC")
    with pytest.raises(ValueError, match=r"layer layer.0: .* LBHNC layout"):
        _layout.block_runs(vs[0], NUM_BLOCKS, spec.page_size_bytes, 2, "layer.0", "LBHNC")


def _resolve(backends, connector_config=None):
    """vLLM's own resolution: the workers' supported lists
    (get_supported_kv_cache_layouts of their backends), then the engine
    core's resolve_kv_cache_layout with the connector's request."""
    from vllm.config import CacheConfig, KVTransferConfig, VllmConfig
    from vllm.v1.attention.backends.utils import (get_supported_kv_cache_layouts,
                                                  resolve_kv_cache_layout)
    names = [m.name for m in get_supported_kv_cache_layouts(backends)]
    cfg = VllmConfig(cache_config=CacheConfig(block_size=BLOCK),
                     kv_transfer_config=KVTransferConfig(**connector_config)
                     if connector_config else None)
    return resolve_kv_cache_layout(cfg, [names]).name


KVTIER = {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.vllm",
          "kv_role": "kv_both"}


def _rocm_backends():
    from vllm.v1.attention.backends.rocm_aiter_fa import AiterFlashAttentionBackend
    from vllm.v1.attention.backends.rocm_aiter_unified_attn import \
        RocmAiterUnifiedAttentionBackend
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
    return [RocmAttentionBackend, AiterFlashAttentionBackend,
            RocmAiterUnifiedAttentionBackend]


class FlashInferDeclared:
    """FlashInfer's declared set (vllm/v1/attention/backends/flashinfer.py,
    supported_kv_cache_layouts, on a GPU with its HND kernels): the
    flashinfer package does not install here, so its backend class does not
    import; its declaration is this tuple."""
    @classmethod
    def supported_kv_cache_layouts(cls):
        return (KVCacheLayout.LBHNC, KVCacheLayout.BLHNC)


@pytest.mark.parametrize("backend", ["RocmAttentionBackend", "AiterFlashAttentionBackend",
                                     "RocmAiterUnifiedAttentionBackend", "CPUAttentionBackend",
                                     "FlashInferDeclared"])
def test_vllms_resolution_gives_a_layout_the_connector_describes(backend):
    """Each backend alone, with kvtier as the connector: the layout vLLM
    resolves is one whose blocks the connector describes (no request of
    kvtier's changes it: the connector asks for none)."""
    from kvtier.vllm import KvtierConnector
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend
    classes = {c.__name__: c for c in _rocm_backends() + [CPUAttentionBackend,
                                                           FlashInferDeclared]}
    cls = classes[backend]
    assert KvtierConnector.get_required_kvcache_layout(None) is None
    got = _resolve([cls], KVTIER)
    assert got == cls.supported_kv_cache_layouts()[0].name
    spec = dict(specs())["gqa"]
    want = 4 if got in _layout.HEAD_OUTER else 2
    assert _layout.pieces_per_block(spec, got, LAYERS) == want


def test_rocm_native_backend_resolves_head_outer():
    """ROCm's native backend (rocm_attn) puts LHBNC first: the layout
    kvtier used to refuse; the connector now takes it, one run per head."""
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
    got = _resolve([RocmAttentionBackend], KVTIER)
    assert got == "LHBNC"
    assert _layout.pieces_per_block(dict(specs())["gqa"], got, LAYERS) == 4


def test_beside_nixl_in_a_multiconnector():
    """kvtier first and NIXL second in a MultiConnector: NIXL's own
    requirement decides (vLLM asks the MultiConnector, which asks its
    children), and kvtier describes what comes out."""
    multi = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
             "kv_connector_extra_config": {"connectors": [
                 dict(KVTIER), {"kv_connector": "NixlConnector", "kv_role": "kv_both"}]}}
    from vllm.v1.attention.backends.rocm_attn import RocmAttentionBackend
    try:
        got = _resolve([RocmAttentionBackend], multi)
    except (ImportError, ModuleNotFoundError) as e:  # pragma: no cover
        pytest.skip("vLLM's NIXL connector does not import here: %s" % e)
    assert got in ("LHBNC", "LBHNC")
    assert _layout.pieces_per_block(dict(specs())["gqa"], got, LAYERS) in (2, 4)
