"""kvtier.vllm._worker: the connector's worker side (the KV caches
registered, loads and saves on the rank)."""
import errno
import time

import numpy as np

import kvtier

from ._common import KVConnectorTransferResults, logger
from ._layout import block_runs
from ._metadata import KvtierConnectorMetadata


class _WorkerSide:
    """KvtierConnector's worker-side methods."""

    def _worker_init(self):
        from vllm.distributed.parallel_state import (get_pp_group, get_tensor_model_parallel_rank,
                                                     get_tensor_model_parallel_world_size)
        s = self._s
        tp_w = get_tensor_model_parallel_world_size()
        pp_w = get_pp_group().world_size
        if tp_w * pp_w != s.world:
            raise RuntimeError(
                "kvtier: this worker's process groups say TP %d x PP %d = world %d, but "
                "vLLM's parallel config says TP %d x PP %d = %d; a worker that saves under "
                "another world would write a tier nobody reads" % (tp_w, pp_w, tp_w * pp_w,
                                                                    s.tp, s.pp, s.world))
        self._rank = get_pp_group().rank_in_group * s.tp + get_tensor_model_parallel_rank()
        self._tier = self._open("rank", rank=self._rank)
        self._worker_state()
        logger.info("kvtier: rank %d of %d (instance %d) on segment '%s'", self._rank,
                    s.world, s.instance, s.segment)
        if s.plan.special and self._rank == 0:
            logger.info("kvtier: the same segment from kvtierd: %s", self._kvtierd_line())

    def _worker_state(self):
        """The worker side's transfer state (empty)."""
        self._loads = {}             # req_id -> (op, _Load, t0): asynchronous loads running
        self._saves = {}             # req_id -> [op]: asynchronous saves running
        self._save_rids = set()      # req_ids that had asynchronous saves (as the scheduler's)
        self._finished_saving = set()  # of those, finished in vLLM, to report when done
        self._done_loads = set()     # asynchronous loads ended since the last report
        self._failed_loads = set()   # of those, failed
        self._bad_blocks = set()     # blocks of failed synchronous loads

    def register_kv_caches(self, kv_caches):
        """Each layer's tensor must hold its blocks at a fixed stride on some
        dimension of size num_blocks, each block the runs the resolved
        layout gives it (_layout.py): one contiguous run (described as its
        halves, or rounded up into its page's padding), K and V apart, or
        one run per KV head.  Every kvtier group (_caches.py) is
        registered: all the caches of each vLLM group, whatever their
        page."""
        s = self._s
        cfg = self._kv_cache_config
        per_group = []
        for kg in s.plan.kgroups:
            spans = []
            for name in kg.layers:
                spans.extend(block_runs(kv_caches[name], cfg.num_blocks, kg.data * kg.pieces,
                                        kg.pieces, name, s.layout))
            strides = {st for _, st in spans}
            if len(strides) != 1:
                raise ValueError("kvtier: the layers %s of a KV cache group have different "
                                 "block strides %s" % (", ".join(kg.layers[:3]),
                                                       sorted(strides)))
            per_group.append(([b for b, _ in spans], strides.pop(), cfg.num_blocks))
        _check_rounded_runs(s.plan, per_group)
        self._kv_caches = kv_caches  # kvtier holds their addresses
        self._tier.register_kv(groups=per_group)
        first = next(iter(kv_caches.values()), None)
        dev = getattr(first, "device", None)
        # a GPU cache: copies wait for the engine's queued work (_order_copies)
        self._save_order = "stream" if getattr(dev, "type", "cpu") == "cuda" else None
        self._kv_device = dev

    def _order_copies(self):
        """vLLM asks for the saves once it has launched the forward pass that
        writes the blocks, not once the pass finished: the copies must start
        after the work on the engine's current stream (vLLM's own offloader
        waits for it too).  Loads the same: the blocks a load writes may
        have been another request's, freed while a step the engine queued
        still reads them (asynchronous scheduling).  CUDA: kvtier orders
        its copy streams after that stream on the GPU, and hsa its SDMA
        copies (the HIP stream releases an HSA signal they depend on); a
        backend that cannot (hsa without HIP in the process) gets the stream
        synchronized on the host instead.  A
        CPU cache: nothing runs behind the caller's back."""
        mode = getattr(self, "_save_order", None)
        if mode is None:
            return
        import torch
        stream = torch.cuda.current_stream(self._kv_device)
        if mode == "stream":
            try:
                self._tier.order_after(stream.cuda_stream)
                return
            except kvtier.KvtierError as e:
                if e.errno != errno.ENOTSUP:
                    raise
                self._save_order = "sync"
                logger.info("kvtier: the DMA backend cannot wait on the engine's stream; "
                            "saves synchronize it on the host first")
        stream.synchronize()

    def start_load_kv(self, forward_context, **kwargs):
        """Submits this step's loads.  A synchronous one (kvtier_async off)
        is waited for here, before the forward pass that reads its blocks;
        an asynchronous one only submitted (vLLM calls this after launching
        the forward pass when the step has no synchronous load): its
        request waits in WAITING_FOR_REMOTE_KVS until get_finished reports
        it, and is scheduled only then, so no kernel reads its blocks
        before the copy completed."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierConnectorMetadata) or not meta.loads:
            return
        self._order_copies()
        for ld in meta.loads:
            t0 = time.perf_counter()
            if ld.error:    # the scheduler released its lease
                self._load_failed(ld, ld.error)
                continue
            try:
                op = self._tier.load(ld.lease, self._ktables(ld.block_ids), n=ld.n_chunks)
            except kvtier.KvtierError as e:
                self._load_failed(ld, e)
                continue
            if ld.is_async:
                self._loads[ld.req_id] = (op, ld, t0)
                continue
            try:
                op.wait()
                self._stat("loaded_chunks", ld.n_chunks)
            except kvtier.KvtierError as e:
                self._load_failed(ld, e)
            self._stat("load_seconds", time.perf_counter() - t0)

    def _load_failed(self, ld, e):
        """A load that failed: vLLM recomputes its tokens.  An asynchronous
        one is reported by request (failed_recving, with finished_recving);
        a synchronous one by its blocks, in this step."""
        logger.warning("kvtier: load of %d chunk(s) for %s failed (%s): vLLM recomputes "
                       "them", ld.n_chunks, ld.req_id, e)
        self._stat("load_errors")
        if ld.is_async:
            self._done_loads.add(ld.req_id)
            self._failed_loads.add(ld.req_id)
        else:
            self._bad_blocks.update(x for b in ld.block_ids for x in b
                                    if x != kvtier.BLOCK_SKIP)

    def wait_for_layer_load(self, layer_name):
        return

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def handle_preemptions(self, kv_connector_metadata):
        """Before the step's forward pass (and before vLLM zeroes or loads
        into reused blocks): the saves that read blocks vLLM has freed
        since they were submitted end now."""
        meta = kv_connector_metadata
        if not isinstance(meta, KvtierConnectorMetadata) or not self._saves:
            return
        rids = list(self._saves) if meta.flush_all else [r for r in meta.flush
                                                          if r in self._saves]
        if rids:
            t0 = time.perf_counter()
            for rid in rids:
                for op in self._saves.pop(rid):
                    self._finish_save(op, wait=True)
            self._stat("save_seconds", time.perf_counter() - t0)

    def wait_for_save(self):
        """Submits this step's saves, ordered after the forward pass on a
        GPU.  Asynchronous (the default): the copies run on while the next
        steps are scheduled and run; the request's blocks stay its own
        until then (vLLM frees them at finish only once get_finished has
        reported it, and a preemption or a moving window flushes them in
        handle_preemptions).  Synchronous: waited for here."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KvtierConnectorMetadata) or not meta.saves:
            return
        t0 = time.perf_counter()
        self._order_copies()
        for sv in meta.saves:
            keys = np.frombuffer(sv.keys, dtype="<u8").reshape(-1, 2)
            if self._s.async_io:
                self._save_rids.add(sv.req_id)
            try:
                op = self._tier.save(np.ascontiguousarray(keys), self._ktables(sv.block_ids),
                                     first_depth=sv.first_depth)
            except kvtier.KvtierError as e:
                logger.warning("kvtier: save for %s: %s", sv.req_id, e)
                self._stat("save_errors")
                continue
            if self._s.async_io:
                self._saves.setdefault(sv.req_id, []).append(op)
            else:
                self._finish_save(op, wait=True)
        self._stat("save_seconds", time.perf_counter() - t0)

    def _finish_save(self, op, wait):
        """True when the save op is complete (counted), False while it runs."""
        try:
            if not (op.wait() if wait else op.poll()):
                return False
            self._stat("saved_chunks", op.count)
        except kvtier.KvtierError as e:
            logger.warning("kvtier: a save failed (%s): its chunks are not in the tier", e)
            self._stat("save_errors")
        return True

    def get_transfer_results(self, finished_req_ids):
        """Loads and saves completed since the last step.  Every rank gets
        the same metadata, so every rank reports each request once: a load
        when its op ended (failed ones in failed_recving too), a finished
        request's saves once vLLM said it finished and none is running."""
        now = time.perf_counter()
        for rid, (op, ld, t0) in list(self._loads.items()):
            try:
                if not op.poll():
                    continue
                self._stat("loaded_chunks", ld.n_chunks)
                self._done_loads.add(rid)
            except kvtier.KvtierError as e:
                self._load_failed(ld, e)
            self._stat("load_seconds", now - t0)
            del self._loads[rid]
        for rid, ops in list(self._saves.items()):
            ops[:] = [op for op in ops if not self._finish_save(op, wait=False)]
            if not ops:
                del self._saves[rid]
        self._finished_saving.update(r for r in finished_req_ids if r in self._save_rids)
        sent = {r for r in self._finished_saving if r not in self._saves}
        self._finished_saving -= sent
        self._save_rids -= sent
        res = KVConnectorTransferResults(finished_sending=sent,
                                         finished_recving=set(self._done_loads),
                                         failed_recving=set(self._failed_loads))
        self._done_loads.clear()
        self._failed_loads.clear()
        return res

    def get_finished(self, finished_req_ids):
        r = self.get_transfer_results(finished_req_ids)
        return r.finished_sending or None, r.finished_recving or None

    def _ktables(self, block_ids):
        """Per-vgroup block lists (the metadata's) -> the kvtier groups'
        tables: each kgroup takes its vgroup's."""
        return _tables([block_ids[kg.vg] for kg in self._s.plan.kgroups])

    def get_block_ids_with_load_errors(self):
        bad, self._bad_blocks = self._bad_blocks, set()
        return bad


def _check_rounded_runs(plan, per_group):
    """A run copied rounded up past its layer's data (_caches.py) must stay
    inside its block stride and overlap no other layer's data of its vLLM
    group: each rounded run of block b is compared with blocks b - 1, b,
    b + 1 of every other run (one stride for all).  Raises ValueError
    naming both layers.  Runs copied as they are need no check."""
    runs = {}
    for kg, (bases, stride, _) in zip(plan.kgroups, per_group):
        for i, base in enumerate(bases):
            runs.setdefault(kg.vg, []).append((base, kg.run, kg.data, stride,
                                               kg.layers[i // kg.pieces]))
    for vg in runs.values():
        for i, (a, run, data, stride, na) in enumerate(vg):
            if run == data:
                continue
            if run > stride:
                raise ValueError("kvtier: layer %s: %d bytes copied a block, over its "
                                 "%d-byte block stride" % (na, run, stride))
            for j, (b, _, other, _, nb) in enumerate(vg):
                if i != j and any(a < b + k * stride + other and b + k * stride < a + run
                                  for k in (-1, 0, 1)):
                    raise ValueError(
                        "kvtier: layer %s: the %d bytes kvtier copies of a block overlap "
                        "layer %s's data; this layout has no room to round its blocks "
                        "into" % (na, run, nb))


def _tables(block_ids):
    """Per-group block id lists -> what Tier.load/save take: one table for
    one group, a list of tables for several."""
    tabs = [np.asarray(b, dtype=np.uint32) for b in block_ids]
    return tabs[0] if len(tabs) == 1 else tabs
