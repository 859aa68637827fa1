"""The Python half of `kvtier-bench lookup` (bench/lookup.c runs it).

Attaches to the bench's segment as a scheduler and times, per prompt
length, what an engine's scheduler does with a new request in Python:

  keys     hash_keys(uint32 numpy tokens) + lookup(key buffer) + release:
           the binding's fast path
  list     the same from a Python list of token ids (what a request holds
           before anything converts it)
  objects  hash_tokens (a Key object per chunk) + lookup(list of Key)
  zmq      an LMCache-style lookup as the reference, when Debian's
           python3-zmq and python3-msgpack are importable: the scheduler
           sends the token ids, msgpack-encoded, over a ZeroMQ REQ socket
           (loopback TCP) to a lookup server process, which hashes each
           chunk in Python (chained built-in hash of the chunk's tuple, the
           cheapest hash LMCache's token database offers), finds the longest
           stored prefix in a dict, and replies with the hit count

Each is measured on a prompt whose chunks are all stored (hit: the lookup
pins every chunk) and on one that shares none (miss).  Prints one line per
measurement, "py FORM TOKENS HIT|MISS MEDIAN_US HITS", for lookup.c.
Timing: batches of at least 2 ms, the median of --batches batches.
"""

import argparse
import os
import sys
import time


def tokens_of(n, miss):
    """The bench's prompt of n tokens (lookup.c builds the same ones)."""
    import numpy as np
    i = np.arange(n, dtype=np.uint64) + np.uint64(1)
    salt = np.uint64(n * 40503 + (0x5BD1E995 if miss else 0))
    v = (i * np.uint64(2654435761) + salt) & np.uint64(0xFFFFFFFF)
    return (v % np.uint64(151936)).astype(np.uint32)


def median_us(fn, batches):
    n = 1
    while True:  # calibrate: a batch of at least 2 ms
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        dt = time.perf_counter_ns() - t0
        if dt >= 2_000_000 or n >= 1 << 20:
            break
        n *= 2
    per = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(n):
            fn()
        per.append((time.perf_counter_ns() - t0) / n / 1000.0)
    per.sort()
    return per[len(per) // 2]


def zmq_server(port_q, chunk_tokens, stored):
    """The LMCache-style lookup server: token ids in, hit count out."""
    import msgpack
    import zmq
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REP)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    known = set()
    for toks in stored:  # the stored prompts' chunk hashes
        known.update(py_chain(toks, chunk_tokens))
    port_q.put(port)
    while True:
        msg = sock.recv()
        if msg == b"quit":
            sock.send(b"")
            break
        toks = msgpack.unpackb(msg)
        hits = 0
        for h in py_chain(toks, chunk_tokens):
            if h not in known:
                break
            hits += 1
        sock.send(msgpack.packb(hits))
    sock.close()
    ctx.term()


def py_chain(toks, chunk_tokens):
    h = 0
    out = []
    for i in range(0, len(toks) - chunk_tokens + 1, chunk_tokens):
        h = hash((h, tuple(toks[i:i + chunk_tokens])))
        out.append(h)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--segment", required=True)
    ap.add_argument("--segment-dir", default=None)
    ap.add_argument("--lengths", default="1024,8192,32768,131072")
    ap.add_argument("--batches", type=int, default=21)
    ap.add_argument("--zmq", choices=("auto", "none"), default="auto")
    a = ap.parse_args()

    import kvtier
    lengths = [int(x) for x in a.lengths.split(",")]
    t = kvtier.Tier(segment=a.segment, role="scheduler", world=1, segment_dir=a.segment_dir,
                    no_env=True)
    for n in lengths:
        for kind in ("hit", "miss"):
            toks = tokens_of(n, kind == "miss")
            lst = toks.tolist()
            hits = t.lookup(t.hash_keys(toks))
            h = hits.hits
            hits.release()

            def keys():
                t.lookup(t.hash_keys(toks)).release()

            def from_list():
                t.lookup(t.hash_keys(lst)).release()

            def objects():
                t.lookup(t.hash_tokens(toks)).release()

            for form, fn in (("keys", keys), ("list", from_list), ("objects", objects)):
                print("py %s %d %s %.3f %d" % (form, n, kind, median_us(fn, a.batches), h),
                      flush=True)
    t.close()

    if a.zmq == "none":
        return
    try:
        import msgpack  # noqa: F401
        import zmq
    except ImportError as e:
        print("note zmq reference skipped: %s (Debian: python3-zmq python3-msgpack)" % e,
              flush=True)
        return
    import multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    stored = [tokens_of(n, False).tolist() for n in lengths]
    chunk = int(os.environ.get("KVTIER_BENCH_CHUNK_TOKENS", "256"))
    srv = ctx.Process(target=zmq_server, args=(q, chunk, stored), daemon=True)
    srv.start()
    port = q.get(timeout=60)
    zc = zmq.Context()
    sock = zc.socket(zmq.REQ)
    sock.connect("tcp://127.0.0.1:%d" % port)
    try:
        for n in lengths:
            for kind in ("hit", "miss"):
                lst = tokens_of(n, kind == "miss").tolist()

                def rpc():
                    sock.send(msgpack.packb(lst))
                    return msgpack.unpackb(sock.recv())

                h = rpc()
                print("py zmq %d %s %.3f %d" % (n, kind, median_us(rpc, max(3, a.batches // 2)),
                                                h), flush=True)
    finally:
        sock.send(b"quit")
        sock.recv()
        sock.close()
        zc.term()
        srv.join(10)


if __name__ == "__main__":
    sys.exit(main())
