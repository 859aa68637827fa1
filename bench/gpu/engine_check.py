"""engine_check.py - a torch mini-engine on kvtier's CUDA backend, and the
bandwidth of the engine's page shapes (bench/gpu/check.sh runs it).

1. Correctness, in the two layouts vLLM gives the connector -- per layer
   ([2, blocks, block_size, heads, dim] per layer: K and V pages apart) and
   block-outermost ([blocks, layers, 2, block_size, heads, dim]: a block's
   pages one run) -- the engine's stream, held first (torch.cuda._sleep),
   writes the KV of a prompt's blocks with torch kernels; the save, ordered
   after that stream (Tier.order_after), goes through the Python binding;
   a lookup and a load bring the chunks back into other blocks, compared
   byte for byte with what the kernels wrote.  Then the same save without
   the order must read the old bytes: the check fails when it is wrong.
2. Bandwidth at the engine's shapes: 4, 8.25, 16 and 32 KiB pages (Llama
   70B at TP8, GLM-5's indexer, Llama 8B at TP2 and TP1), MLA pages
   (72 KiB, DeepSeek V3 / GLM-5, bf16) and whole blocks of 0.64 and 2 MiB
   (block-outermost) -- saves alone, loads alone, both at once, through the
   binding as an engine calls it, with the copy kernel for the pages below
   its crossover and with DMA only (KVTIER_COPY_KERNEL=off) -- against the driver's pinned copy of the
   same pages (torch copy_ from/to pinned memory, page by page: Python's
   cost per call included, so it is a floor of what a per-page engine
   loop gets), a gather kernel then one copy (index_select into a device
   buffer, then one pinned copy: what a copy kernel buys), and the driver's
   4 MiB pinned copy (the peak).

A dry run (KVTIER_CUDA_LIBRARY naming the fake libcuda of tests/fakes):
CPU torch tensors adopted by the fake as device memory, the engine's
writes done by the fake's late kernels on its engine stream; the figures
are CPU copies, not a GPU's.  Output: lines PASS/FAIL/NOTE: ..., the
tables, and --json FILE.  Exit 1 when a check FAILed.

  python3 bench/gpu/engine_check.py [--quick] [--json FILE] [--segment-dir DIR]
"""
import argparse
import ctypes
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python"))
import torch  # noqa: E402

import kvtier  # noqa: E402

failed = False


def rec(verdict, msg):
    global failed
    print("%s: %s" % (verdict, msg), flush=True)
    if verdict == "FAIL":
        failed = True


class Device:
    """The GPU through torch, or the fake libcuda with CPU tensors."""

    def __init__(self):
        lib = os.environ.get("KVTIER_CUDA_LIBRARY")
        self.fake = None
        if lib:
            f = ctypes.CDLL(lib)
            if not hasattr(f, "kvt_fake_cuda_adopt"):
                raise SystemExit("KVTIER_CUDA_LIBRARY=%s is not kvtier's fake; unset it "
                                 "for the system driver" % lib)
            f.kvt_fake_cuda_adopt.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
            f.kvt_fake_cuda_engine_stream.restype = ctypes.c_void_p
            f.kvt_fake_cuda_kernel_write.argtypes = [ctypes.c_void_p, ctypes.c_uint64,
                                                     ctypes.c_int, ctypes.c_uint64,
                                                     ctypes.c_uint]
            self.fake = f
            self.name = "fake libcuda (a dry run: CPU memory, not a GPU)"
            self.torch_dev = "cpu"
            self.stream = None
        else:
            if not torch.cuda.is_available():
                raise SystemExit("no CUDA device for torch, and no KVTIER_CUDA_LIBRARY")
            self.name = torch.cuda.get_device_name(0)
            self.torch_dev = "cuda:0"
            self.stream = torch.cuda.Stream()  # the engine's stream

    def alloc(self, shape, dtype=torch.bfloat16):
        t = torch.zeros(shape, dtype=dtype, device=self.torch_dev)
        if self.fake is not None:
            n = t.numel() * t.element_size()
            if self.fake.kvt_fake_cuda_adopt(t.data_ptr(), n):
                raise SystemExit("the fake would not adopt %d bytes" % n)
        return t

    def pinned(self, nbytes):
        t = torch.empty(nbytes, dtype=torch.uint8)
        return t.pin_memory() if self.fake is None else t

    def sync(self):
        if self.fake is None:
            torch.cuda.synchronize()
        else:
            self.fake.kvt_fake_cuda_kernels_wait()

    def stream_handle(self):
        if self.fake is not None:
            return self.fake.kvt_fake_cuda_engine_stream()
        return self.stream.cuda_stream

    def late_write(self, views, seed):
        """The forward pass: each (tensor view) rewritten on the engine's
        stream, late (held ~200 ms first).  Returns nothing; sync() waits."""
        if self.fake is not None:
            es = self.fake.kvt_fake_cuda_engine_stream()
            for i, v in enumerate(views):
                n = v.numel() * v.element_size()
                rc = self.fake.kvt_fake_cuda_kernel_write(es, v.data_ptr(),
                                                          (seed * 31 + i) % 251 + 1, n, 200000)
                if rc:
                    raise SystemExit("fake kernel_write: %d" % rc)
            return
        g = torch.Generator(device=self.torch_dev).manual_seed(seed)
        with torch.cuda.stream(self.stream):
            torch.cuda._sleep(int(0.2 * 1.98e9))  # ~200 ms at up to 1.98 GHz
            for v in views:
                r = torch.randint(-32768, 32768, v.shape, dtype=torch.int32,
                                  device=self.torch_dev, generator=g)
                v.view(torch.int16).copy_(r.to(torch.int16))


# ---- the engine's caches -----------------------------------------------------------

class Cache:
    """One rank's KV cache: per-layer or block-outermost, bf16."""

    def __init__(self, dev, layout, layers, heads, dim, block, n_blocks, halves=2):
        self.layout, self.block, self.n_blocks = layout, block, n_blocks
        self.bpt = heads * dim * 2  # bytes per token of one half (a page's token)
        if layout == "per-layer":
            self.tensors = [dev.alloc((halves, n_blocks, block, heads, dim))
                            for _ in range(layers)]
            self.views = [t[h] for t in self.tensors for h in range(halves)]
        else:
            self.tensors = [dev.alloc((n_blocks, layers, halves, block, heads, dim))]
            t = self.tensors[0]
            self.views = [t[:, l, h] for l in range(layers) for h in range(halves)]
        self.page = block * self.bpt

    def group(self):
        return kvtier.Group(len(self.views), self.bpt, self.block)

    def block_bytes(self):
        return self.page * len(self.views)

    def pages(self, blocks):
        """The device pages of these blocks, as flat uint8 views."""
        return [v[b].reshape(-1).view(torch.uint8) for b in blocks for v in self.views]

    def block_views(self, blocks):
        """What the engine's kernels write: each layer's K and V of each
        block (per-layer), or each whole block (block-outermost)."""
        if self.layout == "per-layer":
            return [v[b] for b in blocks for v in self.views]
        return [self.tensors[0][b] for b in blocks]

    def fill(self, byte):
        for t in self.tensors:
            t.view(torch.uint8).fill_(byte)

    def equal(self, a_blocks, b_blocks):
        ia = torch.tensor(a_blocks, device=self.tensors[0].device)
        ib = torch.tensor(b_blocks, device=self.tensors[0].device)
        return all(torch.equal(v.index_select(0, ia).view(torch.int16),
                               v.index_select(0, ib).view(torch.int16)) for v in self.views)


def open_tier(segname, segdir, cache, chunk_tokens, n_chunks, log=None):
    g = [cache.group()]
    s = kvtier.Tier(segment=segname, role="scheduler", world=1, instance=0, groups=g,
                    chunk_tokens=chunk_tokens, create=True, replace=True,
                    n_slots=n_chunks + 8, model="kvtier-gpu-check", segment_dir=segdir)
    r = kvtier.Tier(segment=segname, role="rank", rank=0, world=1, instance=0, groups=g,
                    chunk_tokens=chunk_tokens, dma="cuda", model="kvtier-gpu-check",
                    segment_dir=segdir, log=log)
    r.register_kv(groups=[cache.views])
    return s, r


def prompt_keys(s, n_chunks, chunk_tokens, seed):
    g = torch.Generator().manual_seed(seed)
    toks = torch.randint(0, 150000, (n_chunks * chunk_tokens,), generator=g)
    return s.hash_keys(toks)


# ---- 1. correctness -------------------------------------------------------------

def check_layout(dev, args, layout):
    block, bpc, n_chunks = 16, 4, 8
    chunk_tokens = block * bpc
    cache = Cache(dev, layout, layers=4, heads=2, dim=64, block=block, n_blocks=128)
    segname = "gpucheck-%d-%s" % (os.getpid(), layout)
    s, r = open_tier(segname, args.segment_dir, cache, chunk_tokens, 2 * n_chunks)
    try:
        for ordered, seed, half in ((True, 1, 0), (False, 2, 1)):
            base = half * 64
            save = list(range(base, base + n_chunks * bpc))
            load = [b + 32 for b in save]
            cache.fill(0x11)  # the old bytes
            dev.sync()
            keys = prompt_keys(s, n_chunks, chunk_tokens, seed)
            dev.late_write(cache.block_views(save), seed)
            if ordered:
                r.order_after(dev.stream_handle())
            r.save(keys, torch.tensor(save, dtype=torch.int32)).wait()
            dev.sync()
            with s.lookup(keys) as lease:
                hits = lease.hits
                if hits == n_chunks:
                    r.load(lease, torch.tensor(load, dtype=torch.int32)).wait()
            dev.sync()
            same = hits == n_chunks and cache.equal(save, load)
            what = "%s: %d chunks written by the engine's stream (held), saved %s, " \
                   "loaded into other blocks" % (layout, n_chunks,
                                                 "ordered after it" if ordered else
                                                 "WITHOUT the order")
            if ordered:
                rec("PASS" if same else "FAIL",
                    what + (": byte-exact" if same else ": %d hits, bytes differ" % hits))
            else:
                rec("PASS" if not same else "FAIL",
                    what + (": the old bytes came back, as they must (the check can fail)"
                            if not same else ": the new bytes came back -- the stream was "
                            "not held, or the copy waited anyway: the ordering check "
                            "proves nothing here"))
    finally:
        r.close()
        s.close()
        kvtier.unlink(segname, args.segment_dir)


# ---- 2. bandwidth at the engine's shapes -----------------------------------------------

# name, layout, layers, KV heads per rank, head dim, block tokens, pages per
# layer and block (2: K and V; 1: MLA's latent, the indexer's keys)
SHAPES = [
    ("llama70b-tp8 4K pages", "per-layer", 80, 1, 128, 16, 2),
    ("glm5 indexer 8.25K pages", "per-layer", 21, 1, 66, 64, 1),
    ("llama8b-tp2 16K pages", "per-layer", 32, 4, 128, 16, 2),
    ("llama8b-tp1 32K pages", "per-layer", 32, 8, 128, 16, 2),
    ("mla bf16 72K pages", "per-layer", 61, 1, 576, 64, 1),
    ("llama70b-tp8 640K blocks", "block-outer", 80, 1, 128, 16, 2),
    ("llama8b-tp1 2M blocks", "block-outer", 32, 8, 128, 16, 2),
]


def timed(fn, dev, repeat):
    out = []
    for _ in range(repeat):
        dev.sync()
        t0 = time.perf_counter()
        fn()
        dev.sync()
        out.append(time.perf_counter() - t0)
    return statistics.median(out)


def kvtier_rates(dev, args, cache, n, block, mode):
    """save, load and both-at-once GB/s through the binding with the CUDA
    backend's copy kernel as KVTIER_COPY_KERNEL=mode says (auto: pages
    below its crossover through the kernel; off: DMA only), and whether a
    loaded block came back exact."""
    os.environ["KVTIER_COPY_KERNEL"] = mode
    segname = "gpucheck-bw-%d" % os.getpid()
    # room for every run's chunks: nothing the loads want is evicted
    lines = []
    s, r = open_tier(segname, args.segment_dir, cache, block, n * (2 + 2 * args.repeat),
                     log=lambda level, msg: lines.append(msg))
    bb = cache.block_bytes()
    out = {}
    try:
        ka = prompt_keys(s, n, block, 10)
        # every timed save is of keys not saved before
        fresh = iter([prompt_keys(s, n, block, 100 + i) for i in range(2 * args.repeat)])
        a = torch.arange(0, n, dtype=torch.int32)
        b = torch.arange(n, 2 * n, dtype=torch.int32)
        c = torch.arange(2 * n, 3 * n, dtype=torch.int32)
        total = n * bb
        r.save(ka, a).wait()   # untimed: the arena's first touch

        def save_b():
            r.save(next(fresh), b).wait()

        def load_a():
            with s.lookup(ka) as lease:
                assert lease.hits == n, lease.hits
                r.load(lease, c).wait()

        def both():
            with s.lookup(ka) as lease:
                op_l = r.load(lease, c)
                op_s = r.save(next(fresh), b)
                op_l.wait()
                op_s.wait()

        out["save"] = total / timed(save_b, dev, args.repeat) / 1e9
        out["load"] = total / timed(load_a, dev, args.repeat) / 1e9
        out["both"] = 2 * total / timed(both, dev, args.repeat) / 1e9
        cache.fill(0)
        dev.sync()
        with s.lookup(ka) as lease:
            r.load(lease, c).wait()
        dev.sync()
        # the backend's line: whether the kernel was there to take the pages
        out["kernel"] = any("copy kernel pages below" in x for x in lines)
    finally:
        r.close()
        s.close()
        kvtier.unlink(segname, args.segment_dir)
        os.environ.pop("KVTIER_COPY_KERNEL", None)
    return out


def bench_shape(dev, args, shape):
    name, layout, layers, heads, dim, block, halves = shape
    bb = layers * halves * block * heads * dim * 2
    n = max(4, min(args.run_bytes // bb, 4096))  # chunks (one block each) per run
    cache = Cache(dev, layout, layers, heads, dim, block, 3 * n, halves)
    res = {"shape": name, "layout": layout, "page": cache.page, "block": bb, "chunks": n}
    total = n * bb
    # blocks 0..n-1 hold the saved chunks' bytes: what every load must bring
    g = torch.Generator(device=cache.tensors[0].device).manual_seed(5)
    for t in cache.tensors:
        t.view(torch.int16).copy_(torch.randint(-32768, 32768, t.shape, dtype=torch.int32,
                                                device=t.device, generator=g).to(torch.int16))
    ref = [v[:n].clone() for v in cache.views]
    for mode, key in (("auto", ""), ("off", "dma_")):
        x = kvtier_rates(dev, args, cache, n, block, mode)
        res[key + "save"], res[key + "load"], res[key + "both"] = x["save"], x["load"], x["both"]
        if "kernel" not in res:
            res["kernel"] = x["kernel"]
        res[key + "exact"] = all(torch.equal(v[2 * n:3 * n].view(torch.int16),
                                             w.view(torch.int16))
                                 for v, w in zip(cache.views, ref))
        for v, w in zip(cache.views, ref):  # the source blocks as they were
            v[:n].copy_(w)
    res["exact"] = res["exact"] and res["dma_exact"]
    # the driver's pinned copy of the same pages, one call each
    host = dev.pinned(total)
    src = cache.pages(range(n))
    dst = [host[i * cache.page:(i + 1) * cache.page] for i in range(len(src))]

    def pages_d2h():
        for x, y in zip(src, dst):
            y.copy_(x, non_blocking=True)

    def pages_h2d():
        for x, y in zip(src, dst):
            x.copy_(y, non_blocking=True)

    res["pages_d2h"] = total / timed(pages_d2h, dev, args.repeat) / 1e9
    res["pages_h2d"] = total / timed(pages_h2d, dev, args.repeat) / 1e9
    # a gather kernel, then one copy (what a copy kernel buys)
    ia = torch.arange(0, n, device=cache.tensors[0].device)
    staging = torch.empty(total, dtype=torch.uint8, device=cache.tensors[0].device)
    per = n * cache.page

    def gather_d2h():
        for i, v in enumerate(cache.views):
            staging[i * per:(i + 1) * per].view(v.dtype).view(
                (n,) + tuple(v.shape[1:])).copy_(v.index_select(0, ia))
        host.copy_(staging, non_blocking=True)

    res["gather_d2h"] = total / timed(gather_d2h, dev, args.repeat) / 1e9
    # the peak: 4 MiB copies
    peak = min(total, 4 << 20)
    npk = max(1, total // peak)

    def peak_d2h():
        for i in range(npk):
            host[i * peak:(i + 1) * peak].copy_(staging[i * peak:(i + 1) * peak],
                                                non_blocking=True)

    def peak_h2d():
        for i in range(npk):
            staging[i * peak:(i + 1) * peak].copy_(host[i * peak:(i + 1) * peak],
                                                   non_blocking=True)

    res["peak_d2h"] = npk * peak / timed(peak_d2h, dev, args.repeat) / 1e9
    res["peak_h2d"] = npk * peak / timed(peak_h2d, dev, args.repeat) / 1e9
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small runs (a dry run)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--segment-dir", default=None, help="where segments go (default /dev/shm)")
    ap.add_argument("--skip-bandwidth", action="store_true")
    args = ap.parse_args()
    args.run_bytes = (8 << 20) if args.quick else (128 << 20)
    args.repeat = 1 if args.quick else 3
    dev = Device()
    print("device: %s; torch %s" % (dev.name, torch.__version__), flush=True)
    for layout in ("per-layer", "block-outer"):
        try:
            check_layout(dev, args, layout)
        except Exception as e:  # a check that cannot run is a failure
            rec("FAIL", "%s: %s: %s" % (layout, type(e).__name__, e))
    rows = []
    if not args.skip_bandwidth:
        print("\n%-26s %7s %7s %3s | %6s %6s %6s | %6s %6s %6s | %6s %6s %6s %6s %6s | %s" % (
            "shape", "page", "block", "krn", "save", "load", "both", "dSave", "dLoad", "dBoth",
            "pgD2H", "pgH2D", "gathr", "pkD2H", "pkH2D", "save/pk load/pk"), flush=True)
        for sh in SHAPES:
            try:
                x = bench_shape(dev, args, sh)
            except Exception as e:
                rec("FAIL", "bandwidth %s: %s: %s" % (sh[0], type(e).__name__, e))
                continue
            rows.append(x)
            print("%-26s %6.1fK %6.0fK %3s | %6.2f %6.2f %6.2f | %6.2f %6.2f %6.2f | "
                  "%6.2f %6.2f %6.2f %6.2f %6.2f | %.2f %.2f" % (
                      x["shape"], x["page"] / 1024, x["block"] / 1024,
                      "yes" if x["kernel"] else "no", x["save"], x["load"], x["both"],
                      x["dma_save"], x["dma_load"], x["dma_both"], x["pages_d2h"],
                      x["pages_h2d"], x["gather_d2h"], x["peak_d2h"], x["peak_h2d"],
                      x["save"] / x["peak_d2h"], x["load"] / x["peak_h2d"]), flush=True)
            if not x["exact"]:
                rec("FAIL", "bandwidth %s: a loaded block differs from the saved one" % x["shape"])
        print("(GB/s, medians of %d; save/load/both: kvtier with its copy kernel for pages "
              "below its crossover (krn: the kernel was there), dSave..: DMA only; pg: the "
              "driver's pinned copy page by page from Python; gathr: index_select then one "
              "copy; pk: 4 MiB pinned copies)" % args.repeat)
        if rows and not any(x["kernel"] for x in rows):
            rec("NOTE", "no copy kernel (no NVRTC found): kvtier's columns are DMA only too")
        if rows:
            rec("PASS", "bandwidth at %d engine shapes measured, every loaded block exact"
                % len(rows) if all(x["exact"] for x in rows) else
                "bandwidth at %d shapes measured" % len(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": dev.name, "torch": torch.__version__, "rows": rows,
                       "failed": failed}, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
