"""kvtier.sglang's page copies against the CPU's own ceiling.

SGLang's HiCache hands its storage backend batches of host-pool pages
(batch_set_v1 after a backup, batch_get_v1 for a prefetch).  This times
those two calls on SGLang's own host pool classes (CPU tensors), at the
page shapes of the models the tier is for, against memcpy of the same
pieces of the same pages into a buffer of their size (ctypes.memmove on
one thread: what a backend that copies page by page pays) and against the
CPU's ceiling, torch's copy of one contiguous buffer of the same bytes
(on every thread torch uses), and prints the ratios.  Run in SGLang's environment (tests/sglang/setup-venv.sh):

    PYTHONPATH=bindings/python KVTIER_LIBRARY=build/tier/libkvtier.so \\
      build/sglang-venv/bin/python bench/sglang_hicache.py [--repeat 5]
"""
import argparse
import ctypes
import os
import statistics
import time
import uuid

import torch

import kvtier

# (name, layout, mla, layers, heads, head_dim (or kv_lora + rope), page)
SHAPES = [
    ("Llama-3.1-70B TP8", "page_first", False, 80, 1, 128, 64),
    ("Llama-3.1-70B TP8", "layer_first", False, 80, 1, 128, 64),
    ("Llama-3.1-8B TP1", "page_first", False, 32, 8, 128, 64),
    ("DeepSeek-V3 MLA", "page_first", True, 61, 1, 576, 64),
]


def pool(layout, mla, layers, heads, dim, page, tokens):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    if mla:
        kv = MLATokenToKVPool(tokens, page, torch.bfloat16, 512, dim - 512, layers, "cpu",
                              False, start_layer=0, end_layer=layers - 1)
        return MLATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 1, 0, page,
                                    layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=tokens, start_layer=0,
                                    end_layer=layers - 1, target_layer_num=layers)
    kv = MHATokenToKVPool(tokens, page, torch.bfloat16, heads, dim, layers, "cpu", False,
                          v_head_dim=dim, start_layer=0, end_layer=layers - 1)
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 1, 0, page,
                                layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=tokens, start_layer=0,
                                end_layer=layers - 1)


def backend(host, segment, mla, tier_gib):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    cfg = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True,
        model_name="bench", extra_config={
            "backend_name": "kvtier", "module_path": "kvtier.sglang",
            "class_name": "KvtierStorage", "kvtier_segment": segment,
            "kvtier_tier_gib": tier_gib})
    b = StorageBackendFactory.create_backend("dynamic", cfg, host)
    b.register_mem_pool_host(host)
    b.on_host_pools_registered()
    return b


from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo  # noqa: E402


def memcpy_pieces(host, idx, n, page, scratch):
    """One thread's memmove of every piece of n pages into scratch."""
    ptrs, sizes = host.get_page_buffer_meta(idx[:n * page])
    dst = scratch.data_ptr()
    off = 0
    for p, s in zip(ptrs, sizes):
        ctypes.memmove(dst + off, p, s)
        off += s
    return off


def run(shape, batch, repeat):
    name, layout, mla, layers, heads, dim, page = shape
    tokens = batch * page * 2
    host = pool(layout, mla, layers, heads, dim, page, tokens)
    seg = "bench-sgl-" + uuid.uuid4().hex[:8]
    page_bytes = host.get_dummy_flat_data_page().numel() * 2
    b = backend(host, seg, mla, max(1.0, 4 * batch * page_bytes / 2 ** 30))
    try:
        src = host.alloc(batch * page)
        dst = host.alloc(batch * page)
        host.kv_buffer.view(torch.uint8).random_(0, 255)
        scratch = torch.empty(batch * page_bytes, dtype=torch.uint8)
        nbytes = batch * page_bytes
        flat = host.kv_buffer.view(torch.uint8).flatten()[:nbytes]
        info = HiCacheStorageExtraInfo(prefix_keys=[])
        sets, gets, refs, ceil = [], [], [], []
        for r in range(repeat + 1):
            keys = [uuid.uuid4().hex * 2 for _ in range(batch)]
            t0 = time.perf_counter()
            assert all(b.batch_set_v1(keys, src, info))
            t1 = time.perf_counter()
            assert all(b.batch_get_v1(keys, dst, info))
            t2 = time.perf_counter()
            assert memcpy_pieces(host, src, batch, page, scratch) == nbytes
            t3 = time.perf_counter()
            scratch.copy_(flat)
            t4 = time.perf_counter()
            if r:  # the first round faults the arena and the scratch in
                sets.append(nbytes / (t1 - t0) / 1e9)
                gets.append(nbytes / (t2 - t1) / 1e9)
                refs.append(nbytes / (t3 - t2) / 1e9)
                ceil.append(nbytes / (t4 - t3) / 1e9)
        for i in range(batch):  # what the get brought is what the set took
            assert torch.equal(host.get_data_page(int(src[i * page])).view(torch.uint8),
                               host.get_data_page(int(dst[i * page])).view(torch.uint8))
        s, g, m, c = (statistics.median(x) for x in (sets, gets, refs, ceil))
        print("%-18s %-11s %5.2f %5d  %6.2f  %6.2f  %6.2f  %6.2f  %5.2f  %5.2f  %5.2f" % (
            name, layout, page_bytes / 2 ** 20, len(host.get_page_buffer_meta(src[:page])[0]),
            s, g, m, c, s / m, g / m, min(s, g) / c))
    finally:
        b.close()
        kvtier.unlink(seg)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32, help="pages per call (SGLang: <= 128)")
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    print("kvtier.sglang, %d pages a call, medians of %d; GB/s (1e9 B/s); memcpy: one "
          "thread's memmove of the same pieces; %d CPUs" % (a.batch, a.repeat,
                                                            os.cpu_count()))
    print("%-18s %-11s %5s %5s  %6s  %6s  %6s  %6s  %5s  %5s  %5s" % (
        "shape", "layout", "MiB", "parts", "set", "get", "memcpy", "ceil", "set/m", "get/m",
        "min/c"))
    for shape in SHAPES:
        run(shape, a.batch, a.repeat)


if __name__ == "__main__":
    main()
