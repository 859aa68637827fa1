"""kvtierd's LMCache front end against LMCache's own server, with the same
client: LMCache 0.5.6's ZeroMQ client and cpu_shm KV caches laid out as
vLLM's CPU backend lays them out ([2, blocks, heads, block, head_size] a
layer), one process playing a rank and its scheduler.

Measured, per server:
  * store: chunks a second and GB/s, requests of --chunks-per-request
    chunks from the KV cache's blocks (the reply comes after the copy);
  * lookup: the scheduler's path, lookup then wait_prefetch_status, of a
    prompt whose chunks are all there, and of one that misses: median and
    99th percentile in microseconds;
  * retrieve: lookup + retrieve into other blocks, GB/s, the bytes checked
    against what was stored;
  * the ceiling: one memcpy of the same bytes in this process (numpy).

Usage (LMCache's server needs its server packages: fastapi, uvicorn,
blake3, opentelemetry; tests/lmcache/setup-venv.sh makes the client's
environment, `pip install blake3 fastapi uvicorn httpx cryptography
"opentelemetry-api<=1.40" opentelemetry-sdk "opentelemetry-exporter-prometheus<=0.61b0"`
adds them):
  PY -m bench.lmcache_front --kvtierd build/tier/daemon/kvtierd [--layers 8 ...]
Prints one line per measurement and a JSON summary last."""

import argparse
import hashlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "lmcache"))
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_port(port, proc, what, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit("%s exited (%s)" % (what, proc.returncode))
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise SystemExit("%s did not listen on %d" % (what, port))


def start_kvtierd(a, port):
    planes, bpt = 2 * a.layers, a.heads * a.head * 2
    chunk_bytes = planes * bpt * a.chunk
    slots = max(64, int(a.tier_gib * (1 << 30) // chunk_bytes))
    log = tempfile.NamedTemporaryFile(prefix="bench-kvtierd-", suffix=".log", delete=False)
    p = subprocess.Popen([a.kvtierd, "--segment", "lmcbench%d" % os.getpid(), "--group",
                          "%d:%d" % (planes, bpt), "--world", "1", "--chunk-tokens",
                          str(a.chunk), "--slots", str(slots), "--model", "bench",
                          "--no-http", "--log", log.name, "--lmcache-port", str(port),
                          "--unlink", "--recreate"])
    wait_port(port, p, "kvtierd")
    return p, log.name


def start_lmcache(a, port):
    log = tempfile.NamedTemporaryFile(prefix="bench-lmcache-", suffix=".log", delete=False)
    p = subprocess.Popen([sys.executable, "-m", "lmcache.v1.multiprocess.http_server",
                          "--host", "127.0.0.1", "--port", str(port), "--http-port",
                          str(free_port()), "--chunk-size", str(a.chunk), "--l1-size-gb",
                          str(a.tier_gib), "--eviction-policy", "LRU"],
                         stdout=log, stderr=subprocess.STDOUT)
    wait_port(port, p, "lmcache server")
    time.sleep(1.0)
    return p, log.name


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def run(a, url, name):
    import numpy as np
    from lmc_client import Client

    c = Client(url)
    bpc = a.chunk // a.block
    n_chunks = a.chunks
    blocks = 2 * n_chunks * bpc + 1
    c.make_kv(layers=a.layers, blocks=blocks, heads=a.heads, block=a.block, head=a.head,
              seed=1)
    c.register(1, "bench", 1, groups_tpb=a.block)
    chunk_bytes = 2 * a.layers * a.chunk * a.heads * a.head * 2
    toks = [3 + (i * 7919) % 30000 for i in range(n_chunks * a.chunk)]
    src = list(range(1, 1 + n_chunks * bpc))
    dst = list(range(1 + n_chunks * bpc, blocks))
    per = a.chunks_per_request
    out = {"server": name}

    t0 = time.perf_counter()
    for s in range(0, n_chunks, per):
        e = min(s + per, n_chunks)
        k = c.key("bench", 1, 0, toks, s * a.chunk, e * a.chunk, "store")
        ok = c.c.store(k, 1, [src[s * bpc:e * bpc]], c.handle).result(timeout=120)[1]
        assert ok, "store refused"
    dt = time.perf_counter() - t0
    out["store_GBps"] = n_chunks * chunk_bytes / dt / 1e9
    out["store_chunks_per_s"] = n_chunks / dt
    time.sleep(1.0)   # LMCache's server commits a store after its reply

    def lookup(tokens, rid):
        k = c.key("bench", 1, None, tokens, 0, len(tokens), rid)
        t = time.perf_counter()
        c.c.lookup(k, 1)
        r = c.c.wait_prefetch_status(rid, 30.0).result(timeout=60)
        dt = time.perf_counter() - t
        c.c.free_lookup_locks(k, 1)
        c.c.end_session(rid)
        return r, dt

    hits, misses = [], []
    prefix = toks[:a.lookup_chunks * a.chunk]
    for i in range(a.lookups):
        r, dt = lookup(prefix, "h%d" % i)
        assert r == a.lookup_chunks, ("lookup hit", r)
        hits.append(dt * 1e6)
        r, dt = lookup([1 + (i + j) % 50000 for j in range(a.lookup_chunks * a.chunk)],
                       "m%d" % i)
        misses.append(dt * 1e6)
    out["lookup_hit_us_p50"] = statistics.median(hits)
    out["lookup_hit_us_p99"] = pct(hits, 0.99)
    out["lookup_miss_us_p50"] = statistics.median(misses)

    t0 = time.perf_counter()
    for s in range(0, n_chunks, per):
        e = min(s + per, n_chunks)
        rid = "r%d" % s
        kl = c.key("bench", 1, None, toks[:e * a.chunk], 0, e * a.chunk, rid)
        c.c.lookup(kl, 1)
        got = c.c.wait_prefetch_status(rid, 30.0).result(timeout=60)
        assert got == e, ("retrieve's lookup", got, e)
        k = c.key("bench", 1, 0, toks, s * a.chunk, e * a.chunk, rid)
        c.c.free_lookup_locks(c.key("bench", 1, None, toks, 0, s * a.chunk, rid), 1)
        ok = c.c.retrieve(k, 1, [dst[s * bpc:e * bpc]], c.handle, 0).result(timeout=120)[1]
        assert ok, "retrieve missed"
        c.c.end_session(rid)
    dt = time.perf_counter() - t0
    out["retrieve_GBps"] = n_chunks * chunk_bytes / dt / 1e9
    same = hashlib.sha256(c.block_bytes(src)).digest() == \
        hashlib.sha256(c.block_bytes(dst)).digest()
    out["retrieve_exact"] = same
    assert same, "retrieved bytes differ from the stored ones"

    # the ceiling: a copy of as many bytes, in this process
    buf = np.ones(n_chunks * chunk_bytes, dtype=np.uint8)
    dst_buf = np.empty_like(buf)
    np.copyto(dst_buf, buf)
    t0 = time.perf_counter()
    np.copyto(dst_buf, buf)
    out["memcpy_GBps"] = buf.nbytes / (time.perf_counter() - t0) / 1e9
    c.unlink()
    c.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvtierd", required=True)
    ap.add_argument("--server", choices=("both", "kvtierd", "lmcache"), default="both")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head", type=int, default=128)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--chunks", type=int, default=64)
    ap.add_argument("--chunks-per-request", type=int, default=8)
    ap.add_argument("--lookup-chunks", type=int, default=32)
    ap.add_argument("--lookups", type=int, default=200)
    ap.add_argument("--tier-gib", type=float, default=2.0)
    a = ap.parse_args()
    res = []
    for name in ("kvtierd", "lmcache"):
        if a.server not in ("both", name):
            continue
        port = free_port()
        p, log = (start_kvtierd if name == "kvtierd" else start_lmcache)(a, port)
        try:
            # each measurement in a process of its own (LMCache's client keeps
            # one polling loop a process)
            r = subprocess.run([sys.executable, __file__, "--_client", json.dumps(vars(a)),
                                "tcp://127.0.0.1:%d" % port, name], capture_output=True,
                               text=True, timeout=1800)
            line = [x for x in r.stdout.splitlines() if x.startswith("{")]
            if r.returncode or not line:
                raise SystemExit("%s: the client failed:\n%s\n%s" % (name, r.stdout[-3000:],
                                                                    r.stderr[-3000:]))
            res.append(json.loads(line[-1]))
        finally:
            p.send_signal(signal.SIGTERM)
            p.wait(timeout=60)
            os.unlink(log)
    for r in res:
        print("%-8s store %.2f GB/s (%.0f chunks/s)  retrieve %.2f GB/s  lookup hit p50 %.0f us "
              "p99 %.0f us, miss p50 %.0f us  (memcpy %.2f GB/s)" % (
                  r["server"], r["store_GBps"], r["store_chunks_per_s"], r["retrieve_GBps"],
                  r["lookup_hit_us_p50"], r["lookup_hit_us_p99"], r["lookup_miss_us_p50"],
                  r["memcpy_GBps"]))
    print(json.dumps(res))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--_client":
        ns = argparse.Namespace(**json.loads(sys.argv[2]))
        print(json.dumps(run(ns, sys.argv[3], sys.argv[4])))
        os._exit(0)
    main()
