"""Records the request frames LMCache's own client sends for every RPC
the engines use, as the fuzz target tests/fuzz/fuzz_lmc.c reads them
(frames, each a 2-byte little-endian length and its bytes: the operation,
then the payloads), into tests/fuzz/corpus/lmc/.  The client talks to a
bare ZeroMQ ROUTER that records and never answers.
Usage: build/lmcache-venv/bin/python tests/lmcache/record_corpus.py [NAME...]
(the named calls only; all without).  The GPU descriptors' calls need the
fake libcuda: KVTIER_FAKE_CUDA=build/tests/dma/fakes/cuda/libcuda.so.1."""
import os
import struct
import sys

import zmq

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from lmc_client import Client  # noqa: E402

OUT = os.path.join(HERE, "..", "fuzz", "corpus", "lmc")


def sglang(c, iid, layout):
    c.make_kv(layers=2, blocks=8, heads=2, block=4, head=8, seed=1, layout=layout)
    return c.register(iid, "org/model", 1, layout=layout, wait=False)


def atom(c, iid, index=0):
    """ATOM's MLA latent caches as LMCache's ATOM worker adapter registers
    them (its adapter waits for get_chunk_size first: the call itself);
    index: a DSA index cache of that width beside each layer's latent."""
    import torch
    from lmcache.utils import EngineType
    from lmcache.v1.platform.kv_wrap import wrap_kv_caches
    kv = {}
    for i in range(2):
        kv["layer.%d" % i] = torch.zeros((8, 4, 24), dtype=torch.float16)
        if index:
            kv["layer.%d.index" % i] = torch.zeros((8, 4, index), dtype=torch.uint8)
    c.wrappers = wrap_kv_caches(kv)
    return c.c.register_kv_cache(iid, c.wrappers, "org/model", 1, EngineType.ATOM, {}, [])


def gpu(c, iid, raw):
    """A GPU engine's caches on the fake driver (lmc_client.gpu_kv): torch's
    cuda descriptors, or cuda_raw ones."""
    c.gpu_kv(layers=2, blocks=8, heads=2, block=4, head=8, seed=1, raw=raw)
    return c.register(iid, "org/model", 1, groups_tpb=4, wait=False)


def main():
    ctx = zmq.Context.instance()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    c = Client("tcp://127.0.0.1:%d" % port)
    c.make_kv(layers=2, blocks=8, heads=2, block=4, head=8, seed=1)
    toks = list(range(100, 140))
    sk = c.key("org/model", 1, None, toks, 0, 32, "req-1")
    wk = c.key("org/model", 1, 0, toks, 0, 32, "req-1", salt="tenant-a")
    calls = [
        ("get_chunk_size", lambda: c.c.get_chunk_size()),
        ("get_experimental", lambda: c.c.get_experimental()),
        ("noop", lambda: c.c.noop()),
        ("ping-none", lambda: c.c.ping(None)),
        ("ping-id", lambda: c.c.ping(2 ** 62 + 5)),
        ("register_kv_cache", lambda: c.register(7, "org/model", 1, groups_tpb=4, wait=False)),
        ("register_kv_cache-nogroups", lambda: c.register(7, "org/model", 1, layout="", wait=False)),
        ("unregister_kv_cache", lambda: c.c.unregister_kv_cache(7)),
        ("lookup", lambda: c.c.lookup(sk, 1)),
        ("query_prefetch_status", lambda: c.c.query_prefetch_status("req-1")),
        ("wait_prefetch_status", lambda: c.c.wait_prefetch_status("req-1", 300.0)),
        ("store", lambda: c.c.store(wk, 7, [[1, 2, 3, 4, 5, 6, 7, 8]], c.handle)),
        ("retrieve", lambda: c.c.retrieve(wk, 7, [[1, 2, 3, 4, 5, 6, 7, 8]], c.handle, 4)),
        ("free_lookup_locks", lambda: c.c.free_lookup_locks(sk, 1)),
        ("end_session", lambda: c.c.end_session("req-1")),
        ("clear", lambda: c.c.clear(False)),
        ("report_block_allocation", lambda: c.c.report_block_allocation(
            1234, "org/model", [])),
        # SGLang's pools, as its k_v and unified connectors register them
        # (MHA; MLA: the unified connector's)
        ("register_kv_cache-sglang", lambda: sglang(c, 8, "SGL")),
        ("register_kv_cache-sglang-unified", lambda: sglang(c, 9, "SGLU")),
        ("register_kv_cache-sglang-mla", lambda: sglang(c, 11, "SGLM")),
        ("register_kv_cache-atom", lambda: atom(c, 10)),
        ("register_kv_cache-atom-dsa", lambda: atom(c, 12, index=132)),
    ]
    if os.environ.get("KVTIER_FAKE_CUDA"):
        calls += [
            ("register_kv_cache-cuda", lambda: gpu(c, 13, raw=False)),
            ("register_kv_cache-cuda-raw", lambda: gpu(c, 14, raw=True)),
            # with a CUDA IPC event handle (64 bytes), as a GPU engine sends
            ("store-gpu", lambda: c.c.store(wk, 13, [[1, 2, 3, 4, 5, 6, 7, 8]],
                                            c.gpu.event()[1])),
        ]
    only = set(sys.argv[1:])
    calls = [x for x in calls if not only or x[0] in only]
    os.makedirs(OUT, exist_ok=True)
    for name, call in calls:
        try:
            call()
        except Exception:  # noqa: BLE001 -- register waits for a reply it never gets
            pass
        if not router.poll(10000):
            raise SystemExit("no frames for %s" % name)
        frames = router.recv_multipart()[2:]  # identity, uid
        with open(os.path.join(OUT, name), "wb") as f:
            for fr in frames:
                f.write(struct.pack("<H", len(fr)) + fr)
        print(name, len(frames), "frames")
    c.unlink()
    os._exit(0)


if __name__ == "__main__":
    main()
