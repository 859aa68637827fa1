"""LMCache's own client (the pinned lmcache wheel) driven the way its vLLM
adapters drive it, for tests/lmcache: a rank that registers a CPU KV cache
(cpu_shm, vLLM's per-layer [2, blocks, heads, block, head_size]), stores and
retrieves, and a scheduler that looks up.  Run as a script it is one
process of a test: it reads JSON commands on stdin and answers one JSON
line each."""
import json
import os
import sys

os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")

import torch  # noqa: E402
import zmq  # noqa: E402
from lmcache.utils import EngineType  # noqa: E402
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey  # noqa: E402
from lmcache.v1.multiprocess.group_view import EngineGroupInfo  # noqa: E402
from lmcache.v1.multiprocess.transport.zmq_impl import create_request_client  # noqa: E402
from lmcache.v1.platform.base.event_ipc import get_event_ipc_backend  # noqa: E402
from lmcache.v1.platform.kv_wrap import wrap_kv_caches, wrap_one_kv_cache  # noqa: E402

T = 30.0


def filled(shape, dtype, g):
    """A contiguous cache tensor: zeros, or random from generator g."""
    if g is None:
        return torch.zeros(shape, dtype=dtype)
    if not dtype.is_floating_point:   # an fp8 index cache's bytes
        return torch.randint(0, 256, shape, generator=g, dtype=dtype)
    return torch.randn(shape, generator=g).to(dtype).contiguous()


class Client:
    def __init__(self, url):
        self.c = create_request_client(url, context=zmq.Context.instance())
        ev = get_event_ipc_backend(torch.device("cpu"))
        self.handle = ev.export_event(ev.create_event("cpu"), "cpu")
        self.kv = None
        self.layout = None

    def close(self):
        self.c.close()

    def key(self, model, world, worker, tokens, start, end, rid, readers=1, salt=""):
        return IPCCacheServerKey(model_name=model, world_size=world, worker_id=worker,
                                 token_ids=tuple(tokens), start=start, end=end,
                                 request_id=rid, num_kv_readers=readers, cache_salt=salt)

    def make_kv(self, layers, blocks, heads, block, head, dtype=torch.float16, seed=None,
                layout="HND", index=0, index_layers=0):
        """vLLM CPU's per-layer caches, filled from seed (zeros without)."""
        kv = {}
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        if layout == "MLA":
            # vLLM's MLA caches as its LMCache adapter registers them (the
            # engine's kv_caches dict): per layer [blocks, block, width]
            # (here heads x head); with index, DeepSeek V3.2's DSA indexer
            # caches [blocks, block, index] (bytes: an fp8 key and its
            # scale a token) of the first index_layers layers, after them
            for i in range(layers):
                kv["layer.%d" % i] = filled((blocks, block, heads * head), dtype, g)
            for i in range(index_layers):
                kv["layer.%d.indexer" % i] = filled((blocks, block, index), torch.uint8, g)
            self.kv, self.block, self.layout = kv, block, layout
            self.wrappers = wrap_kv_caches(kv)
            return self.wrappers
        if layout in ("SGL", "SGLU"):
            # SGLang's MHA pools as its LMCache connectors register them:
            # every layer's K then every layer's V, each [token slots,
            # heads, head_dim] (SGL: lmcache.integration.sglang's
            # _wrap_sglang_kv_caches) or its view [pages, page, heads,
            # head_dim] (SGLU: the unified connector of SGLang 0.5.23's
            # LMCacheUnifiedRadixCache); a page of `block` slots is a block
            for kind in "kv":
                for i in range(layers):
                    shape = (blocks * block, heads, head) if layout == "SGL" else \
                        (blocks, block, heads, head)
                    kv["%s.%d" % (kind, i)] = filled(shape, dtype, g)
            self.kv, self.block, self.layout = kv, block, layout
            self.wrappers = [wrap_one_kv_cache(t) for t in kv.values()]
            return self.wrappers
        if layout == "SGLM":
            # SGLang's MLA pool as the unified connector registers it: per
            # layer a [pages, page, width] view of MLATokenToKVPool's
            # [slots, 1, width] (the latent width here heads x head)
            for i in range(layers):
                kv["latent.%d" % i] = filled((blocks, block, heads * head), dtype, g)
            self.kv, self.block, self.layout = kv, block, layout
            self.wrappers = [wrap_one_kv_cache(t) for t in kv.values()]
            return self.wrappers
        for i in range(layers):
            # vLLM's per-layer [2, blocks, ...] (HND, NHD), or vLLM 0.32 CPU's
            # [blocks, heads, block, 2 x head] ("CPU4": one plane)
            shape = (2, blocks, heads, block, head) if layout == "HND" else \
                (2, blocks, block, heads, head) if layout == "NHD" else \
                (blocks, heads, block, 2 * head)
            kv["layer.%d" % i] = filled(shape, dtype, g)
        self.kv = kv
        self.block = block
        self.layout = layout
        self.wrappers = wrap_kv_caches(kv)
        return self.wrappers

    def register(self, iid, model, world, groups_tpb=None, layout="HND", wait=True, sw=-1):
        groups = [] if groups_tpb is None else [EngineGroupInfo(
            engine_group_id=0, layer_indices=tuple(range(len(self.wrappers))),
            tokens_per_block=groups_tpb, sw_size_tokens=sw)]
        hints = {"kv_layout": "HND" if layout == "CPU4" else
                 "NHD" if layout == "MLA" else layout} if layout else {}
        engine = EngineType.VLLM
        if layout == "SGL":  # what LMCache's SGLang connectors send
            engine, groups = EngineType.SGLANG, []
            hints = {"tokens_per_block": self.block, "kv_list_layout": "k_v"}
        elif layout in ("SGLU", "SGLM"):
            engine, hints = EngineType.SGLANG, {"kv_list_layout": "unified"}
            groups = [EngineGroupInfo(engine_group_id=0,
                                      layer_indices=tuple(range(len(self.wrappers))),
                                      tokens_per_block=self.block, sw_size_tokens=-1)]
        self.registered = (iid, model, world, groups_tpb, layout)
        fut = self.c.register_kv_cache(iid, self.wrappers, model, world, engine,
                                       hints, groups)
        return fut.result(timeout=T) if wait else fut

    def heartbeat(self, interval):
        """LMCache's own heartbeat thread, as its vLLM worker adapter runs
        it: pings with the instance id; on the unhealthy -> healthy edge
        the recovery callback registers the KV cache again."""
        import threading

        from lmcache.integration.vllm.vllm_multi_process_adapter import HeartbeatThread
        self.health = threading.Event()
        self.health.set()
        self.recoveries = 0
        iid, model, world, tpb, layout = self.registered

        def recover():
            try:
                self.register(iid, model, world, tpb, layout)
            except Exception:  # noqa: BLE001 -- the callback must not raise
                return False
            self.recoveries += 1
            return True
        self.hb = HeartbeatThread(self.c, self.health, interval=interval, instance_id=iid)
        self.hb.register_recover_callback(recover)
        self.hb.start()

    def atom(self, url, model, world, worker, layers, blocks, block, width, seed=None,
             index_width=0):
        """LMCache's own ATOM adapters (lmcache.integration.atom: the
        worker's, registering ATOM's per-layer MLA latent caches [blocks,
        block, width], and the scheduler's), as ATOM's connector drives
        them; index_width adds a DSA index cache a layer beside the
        latent."""
        from lmcache.integration.atom.multi_process_adapter import (
            AtomMPParallelConfig, AtomMPSchedulerAdapter, AtomMPWorkerAdapter)
        par = AtomMPParallelConfig(world_size=world, worker_id=worker, tp_size=world)
        ctx = zmq.Context.instance()
        g = torch.Generator().manual_seed(seed) if seed is not None else None
        kv = {}
        for i in range(layers):
            for name, w in (("latent", width), ("index", index_width)):
                if not w:
                    continue
                kv["layer.%d.%s" % (i, name)] = filled((blocks, block, w), torch.float16, g)
        self.kv, self.block, self.layout = kv, block, "ATOM"
        self.atom_s = AtomMPSchedulerAdapter(url, ctx, model, block, par)
        self.atom_w = AtomMPWorkerAdapter(url, ctx, model, block, par,
                                          transfer_mode="lmcache_driven")
        self.atom_w.register_kv_caches(kv)

    def atom_copy(self, what, rid, tokens, blocks, start, end):
        from lmcache.integration.atom.multi_process_adapter import AtomMPTransferSpec
        ev = get_event_ipc_backend(torch.device("cpu"))
        spec = AtomMPTransferSpec(token_ids=tokens, block_ids=[blocks], start=start, end=end)
        submit = self.atom_w.submit_store_request if what == "store" else \
            self.atom_w.submit_retrieve_request
        return submit(rid, spec, ev.create_event("cpu")).result(timeout=T)

    def atom_lookup(self, rid, tokens):
        import time
        self.atom_s.maybe_submit_lookup_request(rid, tokens)
        end = time.monotonic() + T
        while (n := self.atom_s.check_lookup_result(rid)) is None:
            assert time.monotonic() < end, "no lookup result"
            time.sleep(0.01)
        return n

    def gpu_kv(self, layers, blocks, heads, block, head, seed, raw=False, device=0,
               forge=False, uuid=None, vmm=False):
        """vLLM's per-layer caches [2, blocks, heads, block, head] (HND,
        float16) in the fake driver's device memory, filled with seeded
        random bytes, as a GPU engine's LMCache adapter registers them:
        torch's "cuda" descriptors (every layer in one cudaMalloc block, as
        the caching allocator carves it: torch's storage handle, the
        layer's offset in the block) or, raw, "cuda_raw" ones (a driver
        handle a layer).  LMCache's own wire classes encode them.  forge:
        raw descriptors that claim twice the blocks their allocations hold;
        uuid: another device's UUID in the metadata; vmm: "cuda_vmm" ones
        (LMCache's use_vmm_api, a fabric handle), as the first layer's."""
        import random
        from lmcache.v1.platform.base.ipc_wire import (
            CudaIPCData, RawCudaIPCData, TensorMetadata, VmmCudaIPCData)
        from lmcache.v1.platform.devices.cuda.ipc_wrapper import (
            CudaIPCWrapper, RawCudaIPCWrapper, VmmCudaIPCWrapper)
        from fake_gpu import FakeCuda, FakeHip
        if not getattr(self, "gpu", None):
            self.gpu = FakeHip(device) if os.environ.get("KVTIER_FAKE_HIP") else \
                FakeCuda(device)
        self.events = []
        lb = 2 * blocks * heads * block * head * 2
        self.gpu_shape = (blocks, heads * block * head * 2)
        shape = (2, blocks, heads, block, head)
        stride = (blocks * heads * block * head, heads * block * head, block * head, head, 1)
        uuid = uuid or self.gpu.uuid()
        claim = 2 if forge else 1
        if forge:
            shape = (2, 2 * blocks) + shape[2:]
            stride = (2 * stride[0],) + stride[1:]
        rnd = random.Random(seed)
        one = None if raw else self.gpu.alloc(layers * lb + 4096)
        self.gpu_layers, self.wrappers = [], []
        for i in range(layers):
            base = self.gpu.alloc(lb) if raw else one + 4096 + i * lb
            self.gpu.write(base, rnd.randbytes(lb))
            self.gpu_layers.append(base)
            md = TensorMetadata(dtype="float16", shape=shape, stride=stride, storage_offset=0,
                                device_uuid=uuid)
            if vmm and not i:
                self.wrappers.append(VmmCudaIPCWrapper.from_wire(VmmCudaIPCData(
                    version=1, metadata=md, export_id=bytes(16), kind="fabric",
                    fabric_blob=bytes(64), alloc_size=lb, alloc_offset=0, nbytes=lb)))
            elif raw:
                self.wrappers.append(RawCudaIPCWrapper.from_wire(RawCudaIPCData(
                    version=1, metadata=md, ipc_handle=self.gpu.mem_handle(base),
                    alloc_offset=0, nbytes=lb * claim)))
            else:
                h = b"\x03c" + self.gpu.mem_handle(one)
                self.wrappers.append(CudaIPCWrapper.from_wire(CudaIPCData(
                    version=1, metadata=md,
                    handle=(device, h, lb, 4096 + i * lb, None, 0, None, False))))
        self.block, self.layout = block, "GPU"
        return uuid

    def gpu_block_bytes(self, block_ids):
        """Every layer's K and V bytes of these blocks, as block_bytes."""
        blocks, bb = self.gpu_shape
        return b"".join(self.gpu.read(base + (kv * blocks + b) * bb, bb)
                        for base in self.gpu_layers for kv in range(2) for b in block_ids)

    def gpu_late(self, block_ids, byte, delay_us):
        """A forward pass that writes these blocks late: a fake kernel on
        the engine's stream per layer and plane."""
        blocks, bb = self.gpu_shape
        for base in self.gpu_layers:
            for kv in range(2):
                for b in block_ids:
                    self.gpu.kernel_write(base + (kv * blocks + b) * bb, byte, bb, delay_us)

    def gpu_copy(self, what, key, iid, blocks, skip=0, timeline=False, sem_words=4096,
                 sem_offset=None):
        """A store or retrieve as LMCache's GPU adapters send it: an event
        recorded on the engine's stream just before; the engine's stream
        then waits on the server's completion event.  timeline: the event
        is a timeline semaphore, packed as LMCache's isolated-IPC backend
        packs it (its own struct), and so is the answer's; sem_words: the
        size of the process's semaphore buffer (at its first record),
        sem_offset: a word's offset to claim instead of its own."""
        from lmcache.v1.platform.devices.cuda import timeline_semaphore_event_ipc as ts
        if timeline:
            handle, off, seq = self.gpu.sem_record(sem_words)
            off = off if sem_offset is None else sem_offset
            h = ts._EXPORT_STRUCT.pack(ts._HANDLE_VERSION, handle, off, seq)
        else:
            ev, h = self.gpu.event()
            self.events.append(ev)  # alive until the server has it (torch keeps it)
        if what == "store":
            res = self.c.store(key, iid, [blocks], h).result(timeout=T)
        else:
            res = self.c.retrieve(key, iid, [blocks], h, skip).result(timeout=T)
        if len(res[0]) == 64:
            self.gpu.wait_ipc_event(res[0])
        elif len(res[0]) == ts._EXPORT_STRUCT.size:
            version, handle, off, value = ts._EXPORT_STRUCT.unpack(res[0])
            assert version == ts._HANDLE_VERSION, version
            self.gpu.sem_wait(handle, off, value)
        return [len(res[0]), res[1]]

    def unlink(self):
        """The shared memory of every KV cache this process registered
        (os._exit skips the wrappers' finalizers that unlink it; the ATOM
        adapters' wrappers are not ours to reach): LMCache names it
        /lmcache_kv_PID_N, and a leftover name meets a later process that
        gets the same pid (FileExistsError at its registration)."""
        import glob
        for n in glob.glob("/dev/shm/lmcache_kv_%d_*" % os.getpid()):
            try:
                os.unlink(n)
            except OSError:
                pass

    def block_bytes(self, block_ids, only=None):
        """Every layer's K and V bytes of these blocks, in order (only: the
        tensors whose name has it, as ATOM's "latent" or "index")."""
        out = []
        for name, t in self.kv.items():
            if only and only not in name:
                continue
            if self.layout in ("SGLU", "SGLM", "ATOM", "MLA"):
                for b in block_ids:
                    out.append(t[b].contiguous().view(torch.uint8).numpy().tobytes())
                continue
            if self.layout == "SGL":
                for b in block_ids:
                    out.append(t[b * self.block:(b + 1) * self.block].contiguous()
                               .view(torch.uint8).numpy().tobytes())
                continue
            if t.dim() == 4:
                for b in block_ids:
                    out.append(t[b].contiguous().view(torch.uint8).numpy().tobytes())
                continue
            for kv in range(2):
                for b in block_ids:
                    out.append(t[kv, b].contiguous().view(torch.uint8).numpy().tobytes())
        return b"".join(out)


def main():
    c = Client(sys.argv[1])
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        try:
            if op == "kv":
                c.make_kv(**cmd)
                res = [w.shm_name for w in c.wrappers]
            elif op == "register":
                res = c.register(**cmd)
            elif op == "rpc":
                args = list(cmd.get("args", []))
                if "key" in cmd:
                    k = cmd["key"]
                    args = [c.key(k["model"], k["world"], None, k["tokens"], k["start"],
                                  k["end"], k["rid"]), 1]
                res = getattr(c.c, cmd["name"])(*args).result(timeout=T)
            elif op == "query":
                res = c.c.query_prefetch_status(cmd["rid"]).result(timeout=T)
            elif op == "gpu_kv":
                res = c.gpu_kv(**cmd)
            elif op == "gpu_late":
                res = c.gpu_late(**cmd)
            elif op in ("gpu_store", "gpu_retrieve"):
                k = c.key(cmd["model"], cmd["world"], cmd["worker"], cmd["tokens"],
                          cmd["start"], cmd["end"], cmd.get("rid", "r"))
                res = c.gpu_copy(op[4:], k, cmd["iid"], cmd["blocks"], cmd.get("skip", 0),
                                 cmd.get("timeline", False), cmd.get("sem_words", 4096),
                                 cmd.get("sem_offset"))
            elif op == "store":
                k = c.key(cmd["model"], cmd["world"], cmd["worker"], cmd["tokens"],
                          cmd["start"], cmd["end"], cmd.get("rid", "r"))
                res = list(c.c.store(k, cmd["iid"], [cmd["blocks"]], c.handle)
                           .result(timeout=T))
                res[0] = res[0].decode("latin-1")
            elif op == "retrieve":
                k = c.key(cmd["model"], cmd["world"], cmd["worker"], cmd["tokens"],
                          cmd["start"], cmd["end"], cmd.get("rid", "r"))
                res = list(c.c.retrieve(k, cmd["iid"], [cmd["blocks"]], c.handle,
                                        cmd.get("skip", 0)).result(timeout=T))
                res[0] = res[0].decode("latin-1")
            elif op == "bytes":
                import hashlib
                b = c.gpu_block_bytes(cmd["blocks"]) if c.layout == "GPU" else \
                    c.block_bytes(cmd["blocks"], cmd.get("only"))
                res = hashlib.sha256(b).hexdigest()
            elif op == "lookup":
                k = c.key(cmd["model"], cmd["world"], None, cmd["tokens"], 0, cmd["end"],
                          cmd["rid"], readers=cmd.get("readers", 1))
                c.c.lookup(k, cmd.get("tp", 1)).result(timeout=T)
                res = c.c.wait_prefetch_status(cmd["rid"], 10.0).result(timeout=T)
            elif op == "atom":
                res = c.atom(sys.argv[1], **cmd)
            elif op in ("atom_store", "atom_retrieve"):
                res = c.atom_copy(op[5:], **cmd)
            elif op == "atom_lookup":
                res = c.atom_lookup(**cmd)
            elif op == "forged":
                # a real descriptor whose view claims another shape
                # (nothing is mapped before the shape is checked)
                w = wrap_kv_caches({"l": torch.zeros((1, 4, 8), dtype=torch.float16)})
                w[0].shape, w[0].stride = tuple(cmd["shape"]), tuple(cmd["stride"])
                w[0].nbytes = 2 * cmd["shape"][0] * cmd["stride"][0]
                c.wrappers = w
                res = c.c.register_kv_cache(cmd["iid"], w, "org/forged", 1, EngineType.VLLM,
                                            {}, []).result(timeout=T)
            elif op == "heartbeat":
                res = c.heartbeat(cmd["interval"])
            elif op == "health":
                res = [c.health.is_set(), c.recoveries]
            elif op == "chunk":
                res = c.c.get_chunk_size().result(timeout=T)
            elif op == "exit":
                c.unlink()
                print(json.dumps({"ok": None}), flush=True)
                os._exit(0)
            else:
                raise ValueError(op)
            print(json.dumps({"ok": res}), flush=True)
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"err": "%s: %s" % (type(e).__name__, e)}), flush=True)


if __name__ == "__main__":
    main()
