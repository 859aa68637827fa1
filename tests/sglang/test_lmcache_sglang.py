"""kvtierd's LMCache front end serving SGLang: LMCache's own SGLang
connector (lmcache.integration.sglang's LMCacheMPConnector, the pinned
wheel unpacked beside SGLang's environment by tests/lmcache/setup-engine.sh
--sglang) over SGLang's own MHATokenToKVPool on the CPU, wired as SGLang's
LMCRadixCache wires it (the pool's k_buffer and v_buffer, the page size).

A writer process stores a prompt's pages; this process -- another SGLang
pool and connector -- looks the prompt up and retrieves it into other
pages: every layer's K and V byte-exact; a retrieve whose first chunk the
radix tree holds already leaves those slots alone.  Not run: SGLang's
scheduler, radix tree (LMCRadixCache needs SGLang's whole runtime) and
model.  Run by scripts/test.sh with SGLang's environment and
KVTIER_LMCACHE_TARGET (the unpacked wheel), after tests/sglang."""
import json
import os
import subprocess
import sys
import types

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
TARGET = os.environ.get("KVTIER_LMCACHE_TARGET", os.path.join(REPO, "build", "sglang-lmcache"))
if TARGET not in sys.path:
    sys.path.insert(0, TARGET)
sys.path.insert(0, os.path.join(REPO, "tests", "lmcache"))
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

PAGE, LAYERS, HEADS, HEAD_DIM = 8, 3, 2, 32
BPT = HEADS * HEAD_DIM * 2       # bf16: one plane (a layer's K or V) a token
SLOTS = 512
MODEL = "org/sglang-model"


def pool():
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    return MHATokenToKVPool(SLOTS, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                            v_head_dim=HEAD_DIM, start_layer=0, end_layer=LAYERS - 1)


def connector(kv, port):
    from lmcache.integration.sglang.multi_process_adapter import LMCacheMPConnector
    return LMCacheMPConnector(types.SimpleNamespace(model_path=MODEL), 1, 0, PAGE,
                              "tcp://127.0.0.1", port, kv.k_buffer, kv.v_buffer)


def planes(kv):
    return list(kv.k_buffer) + list(kv.v_buffer)


def contents(seed, like):
    """The writer's pool contents, a function of the seed."""
    out = []
    for i, t in enumerate(like):
        g = torch.Generator().manual_seed(seed * 100 + i)
        out.append(torch.randn(t.shape, generator=g).to(t.dtype))
    return out


def slots(pages):
    return torch.tensor([p * PAGE + j for p in pages for j in range(PAGE)], dtype=torch.int64)


def write(port, seed, tokens, pages):
    """The writer process: its pool filled after the registration (LMCache
    moves the pool's storage into shared memory at registration), then the
    prompt's pages stored."""
    from lmcache.integration.sglang.sglang_adapter import StoreMetadata
    kv = pool()
    c = connector(kv, port)
    for t, v in zip(planes(kv), contents(seed, planes(kv))):
        t.copy_(v)
    c.store_kv(StoreMetadata(last_node=None, token_ids=tokens, kv_indices=slots(pages),
                             offset=0, request_id="w1"))
    c.close()
    print("STORED", flush=True)


def test_sglang_pool_served_by_kvtierd():
    from lmcache.integration.sglang.sglang_adapter import LoadMetadata
    from test_lmcache_client import CHUNK, Daemon
    d = Daemon("sgl-lmc%d" % os.getpid(), layers=2 * LAYERS, bpt=BPT)
    c = None
    try:
        n_chunks = 6
        toks = list(range(7000, 7000 + n_chunks * CHUNK + 5))
        span = n_chunks * CHUNK
        src = list(range(10, 10 + span // PAGE))
        w = subprocess.run([sys.executable, __file__, "write", str(d.port), "5",
                            json.dumps(toks), json.dumps(src)], capture_output=True, text=True,
                           timeout=600)
        assert w.returncode == 0 and "STORED" in w.stdout, (w.stdout + w.stderr)[-4000:]
        assert d.metric("kvtier_lmcache_stored_total") == n_chunks

        kv = pool()
        c = connector(kv, d.port)
        want = [t[slots(src)] for t in contents(5, planes(kv))]
        # the whole prompt: every layer's K and V of every page, exact
        dst = list(range(40, 40 + span // PAGE))
        for i, t in enumerate(planes(kv)):   # the comparison below can fail
            assert not torch.equal(t[slots(dst)], want[i]), "plane %d" % i
        assert c.lookup_kv(toks, "r1") == span
        assert c.retrieve_kv(LoadMetadata(token_ids=toks, slot_mapping=slots(dst), offset=0,
                                          request_id="r1")) == span
        for i, t in enumerate(planes(kv)):
            assert torch.equal(t[slots(dst)], want[i]), "plane %d" % i
        c.end_session("r1")
        # the radix tree holds the first chunk: its slots are left alone
        dst2 = list(range(2, 2 + span // PAGE))
        keep = [t[slots(dst2[:CHUNK // PAGE])].clone() for t in planes(kv)]
        assert c.lookup_kv(toks, "r2") == span
        assert c.retrieve_kv(LoadMetadata(token_ids=toks, slot_mapping=slots(dst2),
                                          offset=CHUNK, request_id="r2")) == span - CHUNK
        for i, t in enumerate(planes(kv)):
            assert torch.equal(t[slots(dst2[:CHUNK // PAGE])], keep[i]), "plane %d" % i
            assert torch.equal(t[slots(dst2[CHUNK // PAGE:])], want[i][CHUNK:]), "plane %d" % i
        c.end_session("r2")
        assert d.metric("kvtier_lmcache_retrieved_total") == 2 * n_chunks - 1
        assert d.metric("kvtier_lmcache_misses_total") == 0
    finally:
        if c is not None:
            c.close()
        d.close()


if __name__ == "__main__":
    if sys.argv[1] == "write":
        write(int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]),
              json.loads(sys.argv[5]))
