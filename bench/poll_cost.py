"""What the vLLM connector's per-step polling costs (issue 40): its
get_transfer_results polls every load and save op it has running, once a
step, on the engine's thread, and each kvt_poll looks at the op's chunk
copies in flight (DMA tickets).  This times one such pass with 1,024
tickets in flight -- the connector's window (kvtier_max_inflight) -- as
N ops of 1024/N chunks each, on the host backend with one copy thread so
that they are all still queued or copying during the pass (256 KiB
chunks: a quarter GiB to copy), and a pass once all have ended.

    PYTHONPATH=bindings/python KVTIER_LIBRARY=build/tier/libkvtier.so \\
      python3 bench/poll_cost.py [OPS ...]
"""
import os
import statistics
import sys
import time
import uuid

import numpy as np

import kvtier

TICKETS = 1024
os.environ["KVTIER_COPY_THREADS"] = "1"


def run(n_ops, repeat=5):
    per = TICKETS // n_ops
    blocks = TICKETS
    g = kvtier.Group(2, 4096, 32, False)          # 2 x 128 KiB = 256 KiB a chunk
    kv = np.ones((2, blocks, 32 * 4096), dtype=np.uint8)
    name = "poll-" + uuid.uuid4().hex[:8]
    busy, ended, running = [], [], []
    key = 1
    try:
        with kvtier.Tier(segment=name, role="rank", rank=0, world=1, groups=[g],
                         chunk_tokens=32, create=True, dma="host", no_env=True,
                         tier_bytes=(TICKETS + 64) * 256 * 1024, max_inflight=TICKETS) as t:
            t.register_kv(groups=[([kv[0], kv[1]], None, None)])
            for _ in range(repeat):
                ops = []
                for i in range(n_ops):
                    keys = np.array([[key + j, 9] for j in range(per)], dtype=np.uint64)
                    key += per
                    ops.append(t.save(keys, np.arange(i * per, (i + 1) * per,
                                                      dtype=np.uint32)))
                t0 = time.perf_counter()
                running.append(sum(not op.poll() for op in ops))
                busy.append(time.perf_counter() - t0)
                time.sleep(1.0)                       # all end meanwhile
                t0 = time.perf_counter()
                for op in ops:
                    op.poll()
                ended.append(time.perf_counter() - t0)
                for op in ops:
                    op.wait()
    finally:
        kvtier.unlink(name)
    b, e = statistics.median(busy) * 1e6, statistics.median(ended) * 1e6
    print("%4d ops x %4d chunks = %d tickets: a pass %7.1f us while they run (%.2f us an op; "
          "%d ops still running after it), %7.1f us once ended" % (
              n_ops, per, TICKETS, b, b / n_ops, min(running), e))


if __name__ == "__main__":
    for n in [int(x) for x in sys.argv[1:]] or [4, 64, 256]:
        run(n)
