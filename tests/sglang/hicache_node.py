"""One SGLang "node process" for the kvtier.sglang tests: SGLang's own
device pool (on the CPU), its own host pool and HostPoolGroup, and its own
HybridCacheController -- constructed as the engine constructs it, with
the storage backend attached through its real attach path (the backend
factory's dynamic loading, interface_v1, the four storage threads) --
for each rank of one instance.  The test plays the radix tree's part
only: it hands operations to the controller's queues and takes its acks,
as UnifiedRadixCache does.

Importable (the pytest process runs instance 1 here) and a command:

    python hicache_node.py '{"action": "write", ...}'   # prints one JSON line

Page contents are a function of (seed, shard, page), so a process that
never saw the writer's pages knows what each page must hold.
"""
import json
import os
import queue
import sys
import threading

import torch

PAGE = 64  # DSA requires 64-token pages; the others take it too
LAYERS = 3
HEADS = 2        # KV heads of one rank
HEAD_DIM = 32
KV_LORA, ROPE = 64, 16
INDEX_DIM = 128  # DSA's index key (fp8) and its fp32 scale: 132 bytes a token


def publish(world):
    """SGLang's runtime context for a scheduler process of a TP=world
    engine (what the engine's launcher publishes)."""
    from sglang.srt import runtime_context as rc
    from sglang.srt.server_args import ServerArgs
    here = os.path.dirname(os.path.abspath(__file__))
    sa = ServerArgs(model_path=os.path.join(here, "tiny"), device="cpu", page_size=PAGE,
                    tp_size=world, enable_hierarchical_cache=True,
                    hicache_storage_backend="dynamic", skip_tokenizer_init=True)
    rc.publish(sa, role="scheduler")
    return rc


def extra_config(segment, **kw):
    cfg = {"backend_name": "kvtier", "module_path": "kvtier.sglang",
           "class_name": "KvtierStorage", "kvtier_segment": segment,
           "kvtier_instances": 2, "kvtier_tier_gib": 0.05}
    cfg.update(kw)
    return cfg


def host_pool(layout, kind, pools=("kv",)):
    """(allocator, HostPoolGroup) of one rank, SGLang's classes.  kind:
    "mha" (GQA, sharded), "mla", or "dsa" (DeepSeek V3.2 / GLM-5: MLA with
    the indexer's host pool beside it, riding on the KV pages)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.memory_pool import (DSATokenToKVPool, MHATokenToKVPool,
                                                  MLATokenToKVPool)
    from sglang.srt.mem_cache.pool_host.dsa import (DSAIndexerPoolHost,
                                                    make_dsa_indexer_pool_decl)
    from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    entries = []
    if kind == "dsa":
        kv = DSATokenToKVPool(1024, PAGE, KV_LORA, torch.bfloat16, ROPE, LAYERS, "cpu",
                              INDEX_DIM, False, KV_LORA + ROPE, start_layer=0,
                              end_layer=LAYERS - 1)
        host = MLATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE,
                                    layout, pin_memory=False, device="cpu",
                                    device_capacity_tokens=kv.size, start_layer=0,
                                    end_layer=LAYERS - 1, target_layer_num=LAYERS)
        index = DSAIndexerPoolHost(make_dsa_indexer_pool_decl(kv), host, pin_memory=False,
                                   device="cpu")
        entries = [PoolEntry(name=PoolName.KV, host_pool=host, device_pool=kv,
                             layer_mapper=lambda layer: layer, is_primary_index_anchor=True),
                   PoolEntry(name=PoolName.INDEXER, host_pool=index, device_pool=kv,
                             layer_mapper=lambda layer: layer)]
        pools = ()
    for name in pools:
        if kind == "mla":
            kv = MLATokenToKVPool(1024, PAGE, torch.bfloat16, KV_LORA, ROPE, LAYERS, "cpu",
                                  False, start_layer=0, end_layer=LAYERS - 1)
            host = MLATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE,
                                        layout, pin_memory=False, device="cpu",
                                        device_capacity_tokens=kv.size, start_layer=0,
                                        end_layer=LAYERS - 1, target_layer_num=LAYERS)
        else:
            kv = MHATokenToKVPool(1024, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu",
                                  False, v_head_dim=HEAD_DIM, start_layer=0,
                                  end_layer=LAYERS - 1)
            host = MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, PAGE,
                                        layout, pin_memory=False, device="cpu",
                                        device_capacity_tokens=kv.size,
                                        start_layer=kv.start_layer, end_layer=kv.end_layer)
        entries.append(PoolEntry(name=PoolName(name), host_pool=host, device_pool=kv,
                                 layer_mapper=lambda layer: layer,
                                 is_primary_index_anchor=not entries))
    kv = entries[0].device_pool
    alloc = PagedTokenToKVPoolAllocator(1024, PAGE, torch.bfloat16, "cpu", kv, False)
    return alloc, HostPoolGroup(entries)


def controller(rc, rank, layout, kind, extra, model="tiny-hicache", pools=("kv",)):
    """SGLang's HybridCacheController of rank `rank`, with the storage
    backend attached by its own constructor (as the engine does)."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import \
        HybridCacheController
    rc.get_parallel().override_permanently(tp_rank=rank, pp_rank=0)
    alloc, group = host_pool(layout, kind, pools)
    return HybridCacheController(alloc, group, PAGE, tp_group=None,
                                 load_cache_event=threading.Event(), io_backend="direct",
                                 storage_backend="dynamic", model_name=model,
                                 storage_backend_extra_config=dict(extra))


def tokens(seed, n_pages):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 30000, (n_pages * PAGE,), generator=g).tolist()


def page_data(pool, seed, shard, page):
    """What page `page` of shard `shard` holds: random bytes of a flat page."""
    flat = pool.get_dummy_flat_data_page()
    g = torch.Generator().manual_seed(seed * 1000003 + shard * 1009 + page)
    raw = torch.randint(0, 256, (flat.numel() * flat.element_size(),), dtype=torch.uint8,
                        generator=g)
    return raw.view(flat.dtype)


def sidecars(cc):
    """The PoolTransfers the tree hands the controller for the pools that
    ride on the KV pages (DSA's indexer), as _build_sidecar_transfers."""
    from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer
    return [PoolTransfer(name=e.name, hit_policy=PoolHitPolicy.ALL_PAGES,
                         indices_from_pool=PoolName.KV)
            for e in cc.mem_pool_host.entries if e.name != PoolName.KV] or None


def pools_of(cc):
    """(number, host pool) of each pool of the rank, the KV anchor first."""
    return list(enumerate(e.host_pool for e in cc.mem_pool_host.entries))


def write(cc, seed, shard, n_pages, timeout=60):
    """Fills n_pages host pages (of every pool) and backs them up through
    the controller's backup thread (write_storage, as the tree does).
    Returns the tokens the controller reports stored."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    toks = tokens(seed, n_pages)
    idx = cc.storage_host_pool.alloc(n_pages * PAGE)
    for k, pool in pools_of(cc):
        for i in range(n_pages):
            pool.set_from_flat_data_page(int(idx[i * PAGE]),
                                         page_data(pool, seed, shard * 10 + k, i))
    hashes = get_storage_hash_str(toks, None, page_size=PAGE)
    cc.write_storage(idx, toks, hash_value=hashes, prefix_keys=[], extra_pools=sidecars(cc))
    op = cc.ack_backup_queue.get(timeout=timeout)
    return op.completed_tokens


def read(cc, seed, shard, n_pages, timeout=60):
    """Prefetches the prompt of `seed` (n_pages pages) through the
    controller: its prefetch thread asks the backend (batch_exists), the
    test allocates the hit's host pages as the tree does
    (allocate_storage_hit), its I/O thread loads them (batch_get_v1), its
    sync thread acks.  Returns (hit tokens, loaded tokens, pages whose
    bytes are wrong)."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    toks = tokens(seed, n_pages)
    op = cc.prefetch(CacheRequestHandle("req-%d" % seed, 0), toks, None, prefix_keys=[],
                     extra_pools=sidecars(cc))
    got = cc.prefetch_hit_queue.get(timeout=timeout)
    assert got is op
    hit = op.storage_hit_count
    if hit == 0:
        return 0, 0, []
    idx, n = cc.allocate_storage_hit(op, hit, allow_partial=False, min_tokens=PAGE,
                                     evict_host=lambda n: 0)
    op.host_indices = idx
    op.hash_value = op.hash_value[:hit // PAGE]
    cc.prefetch_buffer.put(op)
    done = 0
    while True:
        ack = cc.ack_prefetch_queue.get(timeout=timeout)
        if ack.completed_tokens is not None:
            done = max(done, ack.completed_tokens)
        if ack.completed_req:
            break
    bad = [(k, i) if k else i for k, p in pools_of(cc) for i in range(done // PAGE)
           if not torch.equal(p.get_data_page(int(idx[i * PAGE])).view(torch.uint8),
                              page_data(p, seed, shard * 10 + k, i).view(torch.uint8))]
    return hit, done, bad


def run(spec):
    """A node process's steps: spec = {world, instance, ranks, layout, kind,
    segment, seed, pages, action: write|read, extra: {...}}."""
    rc = publish(spec["world"])
    out = []
    ccs = []
    for r in spec["ranks"]:
        extra = extra_config(spec["segment"], kvtier_instance=spec["instance"],
                             **spec.get("extra", {}))
        cc = controller(rc, r, spec["layout"], spec["kind"], extra)
        ccs.append(cc)
        shard = r if spec["kind"] == "mha" else 0
        if spec["action"] == "write":
            out.append({"rank": r, "stored": write(cc, spec["seed"], shard, spec["pages"])})
        else:
            hit, done, bad = read(cc, spec["seed"], shard, spec["pages"])
            out.append({"rank": r, "hit": hit, "loaded": done, "bad": bad})
    st = ccs[0].storage_backend._tier.stats()
    for cc in ccs:
        cc.detach_storage_backend()
    return {"ranks": out, "saved_chunks": st["saved_chunks"]}


if __name__ == "__main__":
    res = run(json.loads(sys.argv[1]))
    sys.stdout.flush()
    print("RESULT " + json.dumps(res), flush=True)
    # SGLang's storage threads are daemons; skip interpreter teardown
    os._exit(0)
