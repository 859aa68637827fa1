"""A real rank process for the kvtierd tests: opens instance I's rank R of
a world-2 segment with host DMA, registers a KV cache seeded by R (so that
rank R of every instance holds the same source bytes), then serves
commands, one JSON line each on stdin, answering one JSON line on stdout:

  {"cmd": "save", "seed": S, "chunks": N}  -> {"ok": true, "count": c}
  {"cmd": "load", "lease": L, "chunks": N} -> {"ok": true, "sha": hex of the loaded blocks}
  {"cmd": "exit"}
"""

import hashlib
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bindings", "python", "tests"))
from kvt_testlib import block_table, kv_cache, prompt  # noqa: E402
import kvtier  # noqa: E402

from daemon_geo import CHUNK_TOKENS, MODEL, WORLD, groups  # noqa: E402


def blocks_sha(kv, table):
    h = hashlib.sha256()
    for a in kv:
        h.update(a[table].tobytes())
    return h.hexdigest()


def main():
    name, inst, r = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    kv = kv_cache(seed=100 + r)
    t = kvtier.Tier(segment=name, role="rank", rank=r, world=WORLD, instance=inst,
                    groups=groups(), chunk_tokens=CHUNK_TOKENS, dma="host", model=MODEL)
    t.register_kv(groups=[kv])
    print(json.dumps({"ok": True, "pid": os.getpid()}), flush=True)
    for line in sys.stdin:
        m = json.loads(line)
        if m["cmd"] == "exit":
            break
        if m["cmd"] == "save":
            toks = prompt(m["chunks"], seed=m["seed"])
            keys = t.hash_tokens(toks)
            op = t.save(keys, block_table(m["chunks"], seed=m["seed"]))
            op.wait(timeout=30)
            print(json.dumps({"ok": True, "count": op.count}), flush=True)
        elif m["cmd"] == "load":
            dst = block_table(m["chunks"], seed=7, half=1)
            for a in kv:
                a[dst] = 0
            t.load(m["lease"], dst, n=m["chunks"]).wait(timeout=30)
            print(json.dumps({"ok": True, "sha": blocks_sha(kv, dst)}), flush=True)
    t.close()


if __name__ == "__main__":
    main()
