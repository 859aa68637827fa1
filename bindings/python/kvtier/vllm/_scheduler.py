"""kvtier.vllm._scheduler: the connector's scheduler side (lookups,
leases, what each step loads and saves)."""
import time

import numpy as np

import kvtier

from ._common import logger
from ._metadata import KvtierConnectorMetadata, _Load, _Save
from ._settings import _opt


def _skipped_tokens(window, n_computed):
    """Tokens before a group's window once n_computed are computed: vLLM
    frees (and replaces with its null block) the blocks below this."""
    if window is None:
        return 0
    kind, w = window
    if kind == "sliding":
        return max(0, n_computed - w + 1)
    return n_computed // w * w


def _chunk_keys_from_hashes(block_hashes, bpc, first_chunk, n_chunks):
    """Keys of chunks first_chunk .. first_chunk + n - 1: the first 16 bytes of
    vLLM's hash of each chunk's last block."""
    if n_chunks <= 0:
        return np.zeros((0, 2), np.uint64)
    raw = b"".join(bytes(block_hashes[(c + 1) * bpc - 1])[:16]
                   for c in range(first_chunk, first_chunk + n_chunks))
    return np.frombuffer(raw, dtype="<u8").reshape(-1, 2)


def _load_tables(vgroups, blocks, first, n, off):
    """The block tables of a load of chunks first .. first + n - 1 (one
    per vgroup: the blocks of each chunk kvtier keeps), and why it cannot
    be exact ("" when it can).  The blocks of the first chunk that vLLM
    computed itself (off tokens) and vLLM's null block are skipped.  A
    block kvtier does not keep (before a window's tail) must be one vLLM
    does not need -- its null block; were it a real block, vLLM would read
    it, so the load is refused and vLLM recomputes the request."""
    tables, error = [], ""
    for v, b in zip(vgroups, blocks):
        have = first * v.bpc + off // v.block_size
        t = []
        for c in range(first, first + n):
            kept = (c + 1) * v.bpc - v.tail
            for i in range(c * v.bpc, kept):
                if b[i] != 0 and i >= have and not error:
                    error = ("vLLM gave block %d of chunk %d real block %d in KV cache group %d, "
                             "outside the %d-block window tail kvtier keeps"
                             % (i - c * v.bpc, c, b[i], v.index, v.tail))
            t.extend(kvtier.BLOCK_SKIP if b[i] == 0 or i < have else b[i]
                     for i in range(kept, (c + 1) * v.bpc))
        tables.append(t)
    return tables, error


class _SchedulerSide:
    """KvtierConnector's scheduler-side methods."""

    def _sched_init(self):
        s = self._s
        self._tier = self._open("scheduler")
        self._sched_state()
        ktc = self._vllm_config.kv_transfer_config
        if getattr(ktc, "kv_load_failure_policy", "recompute") == "fail":
            # vLLM fails a request whose load failed unless told to
            # recompute it; for a cache a failed load is a miss.
            policy = _opt(ktc.kv_connector_extra_config or {}, "kvtier_load_failure_policy",
                          "KVTIER_LOAD_FAILURE_POLICY", "recompute")
            if policy not in ("recompute", "fail"):
                raise ValueError("kvtier: kvtier_load_failure_policy=%r: expected recompute "
                                 "or fail" % policy)
            ktc.kv_load_failure_policy = policy
        logger.info("kvtier: scheduler of instance %d on segment '%s' (world %d, %d-token "
                    "chunks, keys from %s)", s.instance, s.segment, s.world, s.chunk_tokens,
                    "vLLM's %s block hashes" % s.hash_algo if s.prefix_caching
                    else "kvtier's token hash")
        if s.plan.special:
            # one spec per group here (vLLM's scheduler config): the ranks
            # know every cache's shape, rank 0 logs the line
            logger.info("kvtier: the same segment from kvtierd: see rank 0's line (the "
                        "scheduler sees one KV cache spec per group)")
        else:
            logger.info("kvtier: the same segment from kvtierd: %s", self._kvtierd_line())

    def _sched_state(self):
        """The scheduler side's per-request state (empty)."""
        self._reqs = {}       # req_id -> Request
        self._pending = {}    # req_id -> (lease id, first chunk, hits, tokens of it vLLM has)
        self._waiting = {}    # req_id -> monotonic time it first waited for the disk tier
        self._to_load = {}    # req_id -> (lease, first chunk, n chunks, offset): allocated
        self._blocks = {}     # req_id -> block ids per KV cache group, as vLLM allocated them
        self._saved = {}      # req_id -> chunks considered for saving (from chunk 0)
        self._saving = set()  # req_ids with asynchronous saves issued (blocks held at finish)
        self._loading = {}    # req_id -> lease of an asynchronous load not reported done
        self._failed = set()  # req_ids whose asynchronous load failed: recomputed
        self._next_reap = 0.0

    def _keys(self, request, first_chunk, n):
        s = self._s
        if s.prefix_caching and len(request.block_hashes) >= (first_chunk + n) * s.hashes_per_chunk:
            return _chunk_keys_from_hashes(request.block_hashes, s.hashes_per_chunk,
                                           first_chunk, n)
        toks = np.asarray(request.all_token_ids[:(first_chunk + n) * s.chunk_tokens],
                          dtype=np.uint32)
        keys = self._tier.hash_keys(toks)
        return np.ascontiguousarray(keys[first_chunk:first_chunk + n])

    def _release_pending(self, req_id):
        p = self._pending.pop(req_id, None)
        if p and p[0]:
            self._tier.release(p[0])

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        s = self._s
        self._reqs[request.request_id] = request
        self._release_pending(request.request_id)
        if request.request_id in self._failed:
            # Its load failed: vLLM recomputes it, and kvtier does not ask
            # again.  Answered 0 and synchronous on purpose: vLLM 0.32 keeps
            # a request whose asynchronous load failed in its in-flight
            # prefills, reserving the request's whole size against its own
            # next asynchronous admission, so a prompt over half the free
            # KV cache could never be admitted again (seen: a livelock).
            return 0, False
        # vLLM computes at least the prompt's last token itself
        usable = (request.num_tokens - 1) // s.chunk_tokens
        # A local hit that ends inside a chunk (chunks of several blocks):
        # that chunk's blocks after the hit are loaded, the ones vLLM has
        # are skipped (KVT_BLOCK_SKIP).  vLLM's hits are whole blocks.
        off = num_computed_tokens % s.chunk_tokens
        if any(off % v.block_size for v in s.plan.vgroups):
            return 0, False
        first = num_computed_tokens // s.chunk_tokens
        if usable <= first:
            return 0, False
        keys = self._keys(request, first, usable - first)
        rid = request.request_id
        self._stat("lookups")
        self._stat("lookup_tokens", (usable - first) * s.chunk_tokens)
        try:
            if s.disk_wait_ms > 0:
                # the keys start at chunk `first`: the L3 asks each at its depth
                lease = self._tier.lookup_ex(keys, first_depth=first)
            else:
                lease = self._tier.lookup(keys)
        except kvtier.KvtierError as e:
            logger.warning("kvtier: lookup of %s: %s", rid, e)
            return 0, False
        if getattr(lease, "pending", 0):
            now = time.monotonic()
            t0 = self._waiting.setdefault(rid, now)
            if (now - t0) * 1000.0 < s.disk_wait_ms:
                lease.release()  # asked back from disk: ask again next step
                self._stat("disk_waits")
                return None, False
        self._waiting.pop(rid, None)
        if not lease.hits:
            return 0, False
        ext = lease.hits * s.chunk_tokens - off
        lid = lease.hand_off()
        self._pending[request.request_id] = (lid, first, lease.hits, off)
        self._stat("hit_tokens", ext)
        return ext, s.async_io

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        rid = request.request_id
        p = self._pending.pop(rid, None)
        if not p:
            return
        lid, first, hits, off = p
        n = (num_external_tokens + off) // self._s.chunk_tokens
        if n <= 0:
            self._tier.release(lid)
            return
        # the request's blocks now: an asynchronous load's request is not
        # scheduled this step, so scheduler output will not list them
        ids = [list(g) for g in blocks.get_block_ids()]
        self._to_load[rid] = (lid, first, min(n, hits), off, ids)

    def build_connector_meta(self, scheduler_output):
        s = self._s
        meta = KvtierConnectorMetadata()
        vgroups = s.plan.vgroups
        for rid in getattr(scheduler_output, "preempted_req_ids", None) or ():
            self._release_pending(rid)
            tl = self._to_load.pop(rid, None)
            if tl:
                self._tier.release(tl[0])
            self._blocks.pop(rid, None)
            if rid in self._saving:
                meta.flush.append(rid)  # vLLM freed the blocks its saves read
        # a window moving on frees a running request's blocks, and a finished
        # one's before request_finished (see the design comment): the saves
        # each rank has running end before this step's forward pass.  Not
        # "if self._saving": a finished request left it, its copies did not.
        meta.flush_all = any(w is not None for w in s.windows)
        for nr in scheduler_output.scheduled_new_reqs:
            self._blocks[nr.req_id] = [list(g) for g in nr.block_ids]
            self._saved.setdefault(nr.req_id, 0)
        cr = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cr, "resumed_req_ids", None) or ()
        for i, rid in enumerate(cr.req_ids):
            nb = cr.new_block_ids[i]
            if nb is None:
                continue
            if rid in resumed or rid not in self._blocks:
                self._blocks[rid] = [list(g) for g in nb]
            else:
                for have, new in zip(self._blocks[rid], nb):
                    have.extend(new)
        # loads: into the blocks vLLM allocated for the hit tokens; its null
        # block (outside a window: never attended) is skipped
        live = []
        for rid, (lid, first, n, off, blocks) in self._to_load.items():
            blocks = [blocks[v.index] for v in vgroups]
            if any(len(b) < (first + n) * v.bpc for b, v in zip(blocks, vgroups)):
                self._tier.release(lid)
                continue
            tables, error = _load_tables(vgroups, blocks, first, n, off)
            if error:
                # the scheduler holds the lease: released here, once; the
                # ranks only report the load failed (vLLM recomputes it)
                self._tier.release(lid)
                meta.loads.append(_Load(rid, 0, n, tables, s.async_io, error))
                continue
            meta.loads.append(_Load(rid, lid, n, tables, s.async_io))
            live.append(lid)
            if s.async_io:
                self._loading[rid] = lid
            self._saved[rid] = max(self._saved.get(rid, 0), first + n)
        self._to_load.clear()
        # saves: the chunks that become full in this step, whose blocks hold
        # this prefix's KV in every group (see the design comment)
        computed = {}
        for nr in scheduler_output.scheduled_new_reqs:
            computed[nr.req_id] = nr.num_computed_tokens
        for i, rid in enumerate(cr.req_ids):
            computed[rid] = cr.num_computed_tokens[i]
        for rid, done0 in computed.items():
            req = self._reqs.get(rid)
            blocks = self._blocks.get(rid)
            if req is None or blocks is None:
                continue
            done = done0 + scheduler_output.num_scheduled_tokens.get(rid, 0)
            full = min(done, req.num_tokens) // s.chunk_tokens
            full = min([full] + [len(blocks[v.index]) // v.bpc for v in vgroups])
            start = self._saved.get(rid, 0)
            if full <= start:
                continue
            ok = [self._chunk_saveable(blocks, c, done0) for c in range(start, full)]
            self._saved[rid] = full
            self._stat("save_holes", ok.count(False))
            c = start
            while c < full:
                if not ok[c - start]:
                    c += 1
                    continue
                e = c
                while e < full and ok[e - start]:
                    e += 1
                keys = self._keys(req, c, e - c)
                meta.saves.append(_Save(rid, keys.tobytes(), c,
                                        [[x for k in range(c, e)
                                          for x in v.chunk_table(blocks[v.index], k)]
                                         for v in vgroups]))
                if s.async_io:
                    self._saving.add(rid)
                c = e
        # the two-step stale sweep: leases looked up and not in this step's
        # loads for two steps are released
        live.extend(p[0] for p in self._pending.values())
        # an asynchronous load's lease is live until its ranks reported it
        # (a rank that has not loaded yet still needs its pins)
        live.extend(self._loading.values())
        try:
            self._tier.step(live)
            # Without kvtierd nobody else frees what a killed engine left
            # (its pins and leases): reap once a second (cheap: one lock
            # probe per table entry).
            now = time.monotonic()
            if now >= self._next_reap:
                self._next_reap = now + 1.0
                n = self._tier.reap()
                if n:
                    logger.info("kvtier: reaped %d dead process(es)' claims, pins and leases", n)
        except kvtier.KvtierError as e:
            logger.warning("kvtier: step: %s", e)
        return meta

    def update_connector_output(self, connector_output):
        for rid in connector_output.finished_recving or ():
            self._loading.pop(rid, None)
        # only the requests still here: one aborted while its load failed
        # was finished (request_finished) before its failure is reported,
        # and would stay in _failed for the life of the process
        self._failed.update(r for r in getattr(connector_output, "failed_recving", None) or ()
                            if r in self._reqs)

    def _chunk_saveable(self, blocks, c, done0):
        """Chunk c's blocks that kvtier keeps, in every group, hold this
        request's KV during this step: none is the null block, and none is
        below what vLLM may have freed at the start of the step (done0
        tokens computed then)."""
        for v in self._s.plan.vgroups:
            first = (c + 1) * v.bpc - v.tail
            # remove_skipped_blocks frees blocks [0, skipped // block_size)
            if first < _skipped_tokens(v.window, done0) // v.block_size:
                return False
            if 0 in v.chunk_table(blocks[v.index], c):
                return False
        return True

    def request_finished_all_groups(self, request, block_ids):
        """SupportsHMA's finish (block ids per group): the same as
        request_finished -- the connector keeps its own copy of every
        group's blocks."""
        return self.request_finished(request, block_ids)

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self._release_pending(rid)
        self._waiting.pop(rid, None)
        tl = self._to_load.pop(rid, None)
        if tl:
            self._tier.release(tl[0])
        for d in (self._reqs, self._blocks, self._saved):
            d.pop(rid, None)
        self._failed.discard(rid)
        # Asynchronous saves may still read its blocks: vLLM keeps them
        # until every rank reports the request in finished_sending.
        if rid in self._saving:
            self._saving.discard(rid)
            return True, None
        return False, None
