"""kvtier.sglang -- kvtier as the storage tier of SGLang's HiCache.

SGLang keeps evicted KV in HiCache: GPU (L1), a host pool per rank (L2),
and an optional storage tier (L3) behind its HiCacheStorage interface.
This module is such a storage backend, loaded by module path with no
change to SGLang:

  python -m sglang.launch_server ... --enable-hierarchical-cache --page-size 64 \\
    --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvtier",
        "module_path": "kvtier.sglang", "class_name": "KvtierStorage",
        "interface_v1": 1, "hicache_storage_pass_prefix_keys": true,
        "kvtier_segment": "kvtier", "kvtier_tier_gib": 64}'

Every rank and every instance on the node then shares one segment: what
one rank saved is what every instance's same rank finds, MLA pages are
kept once for all ranks, and kvtierd's disk tier and L3 sit below it.
SGLang's own per-rank host pools stay as they are (its L2); kvtier is
what they spill to and fill from.

Tested with SGLang 0.5.23 (TESTED); another version is refused at import
unless KVTIER_SGLANG_ANY_VERSION=1: the interface below changed between
releases (v1/v2 calls, prefix keys, the MLA writer rule) and a backend
that misreads one would store pages under the wrong keys.

Design
------
The pages.  A HiCache page (--page-size tokens) is one kvtier chunk
(chunk_tokens = page size).  Which bytes of the host pool make a page is
SGLang's to say: the pool's get_page_buffer_meta() -- the description
SGLang's own zero-copy backends (Mooncake, 3FS) read -- lists each page's
pieces (K and V of the whole page in page_first; K and V per layer in
layer_first; the latent row per layer for MLA ...).  At attach the
backend asks it for the pages 0, 1 and the last, and requires each piece
to sit at base + page * stride; pieces of one size and stride are one
kvtier layer group (at most 8 groups), so a save or load of n pages is
one kvt_save/kvt_load with a table of n page ids, copied by the
library's host DMA backend (memcpy on its threads) straight between the
pool and the arena: no Python-level copy per page.  A layout whose pages
SGLang cannot describe that way is refused by name at attach
(page_unified: its pages are head-group blocks with no per-page
description; see LAYOUTS).

What the bytes mean.  Two pools of one geometry can order a page's bytes
differently (page_first is token-major inside a page, page_first_direct
layer-major; page_head puts heads outermost), so the model identity that
enters the layout fingerprint names the engine, the pool's class, its
layout, its dtype and the page size, besides the model's name and (when
the served model is a directory) its files (kvt_model_files_id): engines
whose pages differ in any of these are refused at attach, each field
named, instead of reading each other's bytes.

Keys.  SGLang's page hashes: SHA-256 chained over the prefix (hex),
the same in every process and on every node for the same tokens and
namespace (extra key, cache salt).  The chunk key is the hash's first
128 bits.  A page's depth (its index in the prompt: eviction takes the
deepest cold pages first, and an L3 object is found only at the depth it
was put at) is len(prefix_keys) + i when SGLang passes the prefix keys --
set "hicache_storage_pass_prefix_keys": true.  SGLang passes None both
for an empty prefix (its prefetch query turns [] into None) and when that
is off; a lookup reads None as depth 0, a save as "off" (logged once):
its pages are placed at their index in the batch, which costs the L3
every page but a prompt's first (a miss, never a wrong byte: the depth is
in the object's authenticated header).

Ranks.  world = the attention TP size, rank = the attention TP rank
(SGLang's HiCacheStorageConfig, checked against the segment's world at
attach: a rank that thinks world=1 on a TP4 segment is refused), the
instance = kvtier_instance, else SGLang's DP rank (DP attention), else 0.
MHA/GQA pools are sharded (a page is found once every rank saved its
shard); MLA pools (SGLang's is_mla_model) use
the replicated layout: one copy for every rank, written by SGLang's one
storage writer (is_storage_writer: the others never call set) and read by
every rank.  Pipeline, context and decode-context parallelism and
heterogeneous TP (tp_lcm_size) are refused at attach, by name.

Calls.  SGLang calls the backend from three threads: the prefetch thread
(batch_exists), the prefetch I/O thread (batch_get_v1), the backup
thread (batch_set_v1); one kvtier handle is one thread's at a time, so
a lock serializes them.
  batch_exists: a lookup (kvt_lookup_ex, which also asks kvtierd to bring
    back pages that its disk tier or L3 has), the lease released at once;
    while pages are pending from below, asked again for up to
    kvtier_promote_wait_ms (default 500; it runs on SGLang's prefetch
    thread, never the scheduler's).  Returns the pages in DRAM.
  batch_get_v1: a lookup that pins, one kvt_load of the hits into the
    pool's pages, waited for, then the lease released -- by the load
    itself when it was the world's last (world 1), explicitly otherwise --
    on every path: an exception, a short hit, a failed copy.  A page
    evicted since batch_exists is a miss (False from there on).
  batch_set_v1: one kvt_save, waited for.  A page saved already (by this
    rank, or an instance's same rank) is skipped; a page that finds no
    free slot is dropped (kvtier's save_nospc counter) and reported
    stored: SGLang then misses it later, which costs a recomputation,
    never a wrong byte.
A process killed in any of these leaves nothing pinned: kvtierd's reaper
(or any process's kvt_reap) releases a dead process's leases and claims.

Hybrid pools (v2).  SGLang's hybrid models add host pools beside the KV
anchor, each with a hit rule (PoolHitPolicy).  kvtier keeps a page's
bytes of every cache it stores as one chunk under one key, so it takes a
pool only when that pool's pages are the KV pages' own: DSA's indexer
(DeepSeek V3.2, GLM-5.x: the index keys "ride on the full-KV pages",
its indices and layout follow the KV pool's, every page needed:
FOLDED_POOLS).  Its pieces join the chunk's groups; batch_set_v1 saves
both pools' bytes of a page in one kvt_save, batch_get_v1 loads both, and
the v2 calls for it report what the v1 call of the same keys did (SGLang
makes the v1 call of a batch and the v2 calls of its KV-derived pools on
one thread, v1 first for a get, v2 first for a set, whose failure then
leaves nothing of the page stored).  Pools with keys or windows of their
own (SWA and Mamba: trailing pages; DeepSeek V4's compressed pools:
block groups) are refused at attach, named, rather than half-served.

Metrics.  get_stats() gives SGLang's StorageMetrics (pages and GB/s of
each batch get and set), which SGLang exports with
--enable-cache-report / storage metrics; kvtier's own counters (hits,
evictions, disk, L3) are kvtierd's /metrics and kvtier-stat.

Settings (the extra config, else the variable, else the default):
  kvtier_segment     KVTIER_SEGMENT      "kvtier"
  kvtier_segment_dir KVTIER_SEGMENT_DIR  (POSIX shm or a hugetlbfs mount)
  kvtier_create      KVTIER_CREATE       true: the first rank creates it
  kvtier_tier_gib    KVTIER_TIER_GIB     1 (GiB per rank, when creating)
  kvtier_instance    KVTIER_INSTANCE     SGLang's DP rank, else 0
  kvtier_instances   KVTIER_INSTANCES    instance + 1 (when creating)
  kvtier_model       KVTIER_MODEL        SGLang's model name
  kvtier_model_config                    a config.json whose files' fields
                                         enter the identity
  kvtier_promote_wait_ms KVTIER_PROMOTE_WAIT_MS 500
"""
import hashlib
import logging
import os
import shlex
import threading
import time

import numpy as np

import kvtier
from kvtier._connect import as_bool, open_segment, opt

try:
    import sglang
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage
except ImportError as e:  # pragma: no cover
    raise ImportError("kvtier.sglang needs SGLang installed: %s" % e) from None

TESTED = ("0.5.23",)
# SGLang's pools whose pages are the KV pages' own (see "Hybrid pools")
FOLDED_POOLS = ("indexer",)
# the layouts whose pages get_page_buffer_meta describes and the tests
# run (page_first_kv_split, the NPU's, has split buffers no test builds)
LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")


def check_version(version):
    """Refuses an SGLang release kvtier was not tested with (the message
    names the tested ones), unless KVTIER_SGLANG_ANY_VERSION=1."""
    if version in TESTED or os.environ.get("KVTIER_SGLANG_ANY_VERSION") == "1":
        return
    raise ImportError(
        "kvtier.sglang: SGLang %s is not a release kvtier was tested with (%s): its "
        "HiCacheStorage calls may mean something else.  Install one of those, or set "
        "KVTIER_SGLANG_ANY_VERSION=1 to try it" % (version, ", ".join(TESTED)))


check_version(getattr(sglang, "__version__", "unknown"))

# under SGLang's root configuration (configure_logger's basicConfig)
logger = logging.getLogger("sglang.kvtier")

_NS = 1e-9


def _keys_of(hashes):
    """SGLang page hashes -> (n, 2) uint64 chunk keys: the hex digest's
    first 128 bits; a key that is not hex (a sidecar's suffixed key) is
    hashed with SHA-256 first."""
    raw = bytearray()
    for h in hashes:
        try:
            b = bytes.fromhex(h[:32])
            if len(b) != 16:
                raise ValueError(h)
        except (TypeError, ValueError):
            b = hashlib.sha256(str(h).encode()).digest()[:16]
        raw += b
    return np.frombuffer(bytes(raw), dtype=np.uint64).reshape(len(hashes), 2)


def _pages_of(host_indices, n, page):
    """The pool page ids of n pages of host token indices, as uint32; None
    when they are not n whole, aligned pages."""
    idx = host_indices.detach()
    if idx.device.type != "cpu":
        idx = idx.cpu()
    if idx.numel() != n * page or n == 0:
        return None
    idx = idx.reshape(n, page).to(torch.int64)
    first = idx[:, 0]
    if bool((first % page).any()):
        return None
    if page > 1 and not bool((idx - first[:, None] == torch.arange(page)).all()):
        return None
    return (first // page).numpy().astype(np.uint32)


def page_pieces(pool):
    """(pieces, n_pages): the pool's page as SGLang describes it
    (get_page_buffer_meta), each piece (base, stride, size) such that
    piece j of page p is size bytes at base + p * stride.  Raises
    ValueError naming what does not fit."""
    layout = getattr(pool, "layout", None)
    name = type(pool).__name__
    page = int(pool.page_size)
    n_pages = int(getattr(pool, "page_num", 0) or pool.size // page)
    if n_pages < 2:
        raise ValueError("kvtier: the host pool %s holds %d page(s); kvtier needs at least 2 "
                         "to read its page geometry" % (name, n_pages))
    probe = [0, 1, n_pages - 1]
    idx = torch.tensor([p * page + t for p in probe for t in range(page)], dtype=torch.int64)
    try:
        ptrs, sizes = pool.get_page_buffer_meta(idx)
    except (ValueError, NotImplementedError, AttributeError, AssertionError) as e:
        raise ValueError(
            "kvtier: SGLang's host pool %s with layout %r does not describe its pages "
            "(get_page_buffer_meta: %s); kvtier stores the layouts %s" %
            (name, layout, e or type(e).__name__, ", ".join(LAYOUTS))) from None
    if not ptrs or len(ptrs) != len(sizes) or len(ptrs) % len(probe):
        raise ValueError("kvtier: %s's get_page_buffer_meta gave %d pointers and %d sizes "
                         "for %d pages" % (name, len(ptrs), len(sizes), len(probe)))
    k = len(ptrs) // len(probe)
    pieces = []
    for j in range(k):
        p0, p1, pl = ptrs[j], ptrs[k + j], ptrs[2 * k + j]
        size = sizes[j]
        stride = p1 - p0
        if sizes[k + j] != size or sizes[2 * k + j] != size or stride <= 0 or \
                pl != p0 + (n_pages - 1) * stride or size % page or size > stride:
            raise ValueError(
                "kvtier: piece %d of a page of %s (layout %r) is not at base + page * "
                "stride (pages 0, 1, %d at %#x, %#x, %#x, %d bytes): kvtier cannot address "
                "its pages" % (j, name, layout, n_pages - 1, p0, p1, pl, size))
        pieces.append((p0, stride, size))
    return pieces, n_pages


def page_groups(pieces, page, replicated):
    """Pieces of one size and stride -> one kvtier group (in the order the
    pool lists them): [(Group, [bases], stride)]."""
    out = []
    for base, stride, size in pieces:
        if out and out[-1][2] == stride and out[-1][0].bytes_per_token * page == size:
            out[-1][1].append(base)
            continue
        out.append((kvtier.Group(1, size // page, page, replicated), [base], stride))
    out = [(g._replace(n_layers=len(bases)), bases, stride) for g, bases, stride in out]
    if len(out) > 8:
        raise ValueError("kvtier: a page has %d kinds of pieces; kvtier holds at most 8 "
                         "layer groups" % len(out))
    return out


def _dtype_name(dt):
    return str(dt).replace("torch.", "")


class KvtierStorage(HiCacheStorage):
    """A HiCacheStorage backend on the node's kvtier segment (see the
    module's design comment)."""

    def __init__(self, storage_config, kwargs=None):
        c = storage_config
        extra = dict(c.extra_config or {})
        self._config = c
        for what, bad in (("pipeline parallelism (pp_size=%s)" % c.pp_size, c.pp_size > 1),
                          ("attention context parallelism (attn_cp_size=%s)" % c.attn_cp_size,
                           c.attn_cp_size > 1),
                          ("decode context parallelism (dcp_size=%s)" % c.dcp_size,
                           getattr(c, "dcp_size", 1) > 1),
                          ("heterogeneous TP (tp_lcm_size=%s: pages split by heads)"
                           % c.tp_lcm_size, bool(getattr(c, "should_split_heads", False)))):
            if bad:
                raise ValueError("kvtier.sglang: %s is not supported: each rank of it holds "
                                 "another part of a page than kvtier's layout describes"
                                 % what)
        o = lambda key, env, default, conv=str: opt(extra, key, env, default, conv,  # noqa
                                                    where="hicache extra config")
        self.segment = o("kvtier_segment", "KVTIER_SEGMENT", "kvtier")
        if "/" in self.segment:
            raise ValueError("kvtier: kvtier_segment=%r: a segment name has no '/'"
                             % self.segment)
        self.segment_dir = o("kvtier_segment_dir", "KVTIER_SEGMENT_DIR", None)
        self.create = o("kvtier_create", "KVTIER_CREATE", True, as_bool)
        self.tier_gib = o("kvtier_tier_gib", "KVTIER_TIER_GIB", 1.0, float)
        self.instance = o("kvtier_instance", "KVTIER_INSTANCE", int(c.dp_rank or 0), int)
        self.instances = o("kvtier_instances", "KVTIER_INSTANCES", self.instance + 1, int)
        self.promote_wait = o("kvtier_promote_wait_ms", "KVTIER_PROMOTE_WAIT_MS", 500.0,
                              float) / 1000.0
        if self.instance < 0 or self.instances <= self.instance or self.tier_gib <= 0 or \
                self.promote_wait < 0:
            raise ValueError("kvtier: kvtier_instance=%d, kvtier_instances=%d, "
                             "kvtier_tier_gib=%r, kvtier_promote_wait_ms=%r: need 0 <= instance "
                             "< instances, a positive size and a wait >= 0"
                             % (self.instance, self.instances, self.tier_gib,
                                self.promote_wait * 1000))
        self.model_name = o("kvtier_model", "KVTIER_MODEL", c.model_name or "")
        if not self.model_name:
            raise ValueError("kvtier: SGLang gave no model name; set kvtier_model")
        if ";" in self.model_name:
            raise ValueError("kvtier: the model name %r contains ';', which separates the "
                             "model identity's fields" % self.model_name)
        self.model_config = extra.get("kvtier_model_config")
        if self.model_config is None and os.path.isfile(
                os.path.join(str(c.model_name or ""), "config.json")):
            self.model_config = os.path.join(str(c.model_name), "config.json")
        self.world = int(c.tp_size)
        self.rank = int(c.tp_rank)
        self.replicated = bool(c.is_mla_model)
        self.writer = bool(c.is_storage_writer)
        # SGLang's controller picks the zero-copy calls (batch_get_v1 /
        # batch_set_v1) for a dynamic backend whose extra config says
        # interface_v1; it reads the dict this config holds after
        # building the backend, so saying it here is enough.
        if c.extra_config is not None and not c.extra_config.get("interface_v1"):
            c.extra_config["interface_v1"] = 1
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self.folded = []
        # per thread: the keys and loaded count of its last batch_get_v1
        # (its batch_get_v2 of a folded pool reports them)
        self._last_get = threading.local()
        self._tier = None
        self._pools = {}
        self._depth_warned = False
        self._stats = {"prefetch_pgs": [], "backup_pgs": [], "prefetch_bandwidth": [],
                       "backup_bandwidth": []}
        self._hold = os.environ.get("KVTIER_SGLANG_TEST_HOLD")

    # ---- attach ----

    def register_mem_pool_host(self, mem_pool_host):
        super().register_mem_pool_host(mem_pool_host)
        self._pools["kv"] = mem_pool_host

    def register_mem_host_pool_v2(self, host_pool, host_pool_name):
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = str(host_pool_name)
        if name == "kv" or host_pool is self._pools.get("kv"):
            return
        if name in FOLDED_POOLS:
            self._pools[name] = host_pool
            return
        raise ValueError(
            "kvtier.sglang: the host pool %r (%s) is not stored: kvtier keeps a page's bytes "
            "of every cache as one chunk under one key, and this pool has keys or a window "
            "of its own (SWA, Mamba, DeepSeek V4's compressed pools; kvtier takes %s beside "
            "the KV pool).  Run this model without kvtier's storage backend" %
            (name, type(host_pool).__name__, ", ".join(FOLDED_POOLS)))

    def on_host_pools_registered(self):
        self._attach()

    def _identity(self, pool):
        ident = "%s;engine=sglang;pool=%s;layout=%s;kv=%s;page=%d" % (
            self.model_name, type(pool).__name__, pool.layout, _dtype_name(pool.dtype),
            pool.page_size)
        tag = getattr(pool, "storage_format_tag", None)
        if tag:
            ident += ";format=%s" % tag
        for name in self.folded:
            side = self._pools[name]
            ident += ";+%s=%s/%d" % (name, type(side).__name__,
                                     side.get_size_per_token() if hasattr(
                                         side, "get_size_per_token") else 0)
        files = ""
        if self.model_config:
            files = ";" + kvtier.model_files_id(self.model_config)
        return ident, files

    def _attach(self):
        if self._tier is not None:
            return self._tier
        pool = self._pools.get("kv") or getattr(self, "mem_pool_host", None)
        if pool is None:
            raise ValueError("kvtier.sglang: no host pool was registered")
        if pool.layout not in LAYOUTS:
            raise ValueError("kvtier.sglang: the host pool layout %r is not supported (%s); "
                             "kvtier stores %s" % (pool.layout, type(pool).__name__,
                                                   ", ".join(LAYOUTS)))
        page = int(pool.page_size)
        pieces, n_pages = page_pieces(pool)
        self.folded = sorted(n for n in self._pools if n != "kv")
        for name in self.folded:
            side = self._pools[name]
            if int(side.page_size) != page or getattr(side, "layout", pool.layout) != pool.layout:
                raise ValueError("kvtier.sglang: the %r pool's pages (%s tokens, %s) are not the "
                                 "KV pool's (%d, %s)" % (name, side.page_size,
                                                          getattr(side, "layout", None),
                                                          page, pool.layout))
            more, n = page_pieces(side)
            if n != n_pages:
                raise ValueError("kvtier.sglang: the %r pool has %d pages, the KV pool %d"
                                 % (name, n, n_pages))
            pieces += more
        groups = page_groups(pieces, page, self.replicated)
        self.page_size = page
        self.groups = [g for g, _, _ in groups]
        self.model_engine, files = self._identity(pool)
        self.model = self.model_engine + files
        if len(self.model.encode()) > 1000:
            raise ValueError("kvtier: the model identity is %d bytes, over 1000: %r"
                             % (len(self.model.encode()), self.model))
        kw = dict(segment=self.segment, segment_dir=self.segment_dir, role="rank",
                  rank=self.rank, world=self.world, instance=self.instance,
                  groups=self.groups, chunk_tokens=page, model=self.model, dma="host",
                  max_inflight=1024,
                  log=lambda level, msg: logger.log(level, "kvtier: %s", msg))
        try:
            t = open_segment(kw, self.create, self.instances, self.tier_gib)
        except kvtier.KvtierError:
            logger.error("kvtier: segment '%s' cannot be this engine's; a kvtierd for it: %s",
                         self.segment, self.kvtierd_line())
            raise
        try:
            t.register_kv(groups=[(bases, stride, n_pages) for _, bases, stride in groups])
        except BaseException:
            t.close()
            raise
        self._tier = t
        logger.info("kvtier: rank %d of %d, instance %d, on segment '%s' (%s; %d-token pages "
                    "of %d bytes in %d piece(s), %s)", self.rank, self.world, self.instance,
                    self.segment, type(pool).__name__ + " " + pool.layout, page,
                    sum(p[2] for p in pieces), len(pieces),
                    "replicated: one copy for every rank" if self.replicated else "sharded")
        logger.info("kvtier: the same segment from kvtierd: %s", self.kvtierd_line())
        return t

    def kvtierd_line(self):
        """The kvtierd command that makes the segment this rank attaches to."""
        q = shlex.quote
        model = ("--model-config %s --model %s" % (q(self.model_config), q(self.model_engine))
                 if self.model_config else "--model %s" % q(getattr(self, "model",
                                                                       self.model_name)))
        return "kvtierd --segment %s %s --world %d --chunk-tokens %d --instances %d %s%s" % (
            self.segment, " ".join("--group %d:%d" % (g.n_layers, g.bytes_per_token)
                                   for g in getattr(self, "groups", ())),
            self.world, getattr(self, "page_size", 0), self.instances, model,
            " --replicated" if self.replicated else "")

    def close(self):
        with self._lock:
            t, self._tier = self._tier, None
        if t is not None:
            t.close()

    # ---- the calls ----

    def _depth(self, extra_info, saving=False):
        """keys[0]'s depth: len(prefix_keys).  SGLang passes None both for
        an empty prefix (its prefetch query turns [] into None) and when
        hicache_storage_pass_prefix_keys is off; a backup passes [] for an
        empty prefix, so None there means "off" (warned once)."""
        pk = getattr(extra_info, "prefix_keys", None) if extra_info is not None else None
        if pk is not None:
            return len(pk)
        if saving and not self._depth_warned:
            self._depth_warned = True
            logger.warning("kvtier: SGLang passes no prefix keys, so a page's depth in its "
                           "prompt is not known: pages are saved at their depth in the batch, "
                           "so eviction cannot prefer the deepest pages and the L3 finds "
                           "none but a prompt's first; set \"hicache_storage_pass_prefix_"
                           "keys\": true in the storage backend's extra config")
        return 0

    def batch_exists(self, keys, extra_info=None):
        if not keys:
            return 0
        depth = self._depth(extra_info)
        k = _keys_of(keys)
        deadline = time.monotonic() + self.promote_wait
        while True:
            with self._lock:
                t = self._attach()
                lease = t.lookup_ex(k, promote=True, first_depth=depth)
                lease.release()
            if lease.hits == len(keys) or lease.pending == 0 or time.monotonic() >= deadline:
                return lease.hits
            time.sleep(0.002)

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        n = len(keys)
        if n == 0:
            return []
        k = _keys_of(keys)
        t0 = time.perf_counter_ns()
        got = 0
        with self._lock:
            t = self._attach()
            pages = self._pages(host_indices, n, "batch_get_v1")
            if pages is None:
                return [False] * n
            lease = t.lookup(k)
            loaded = False
            try:
                if lease.hits:
                    if self._hold:
                        self._hold_here()
                    got = min(lease.hits, n)
                    t.load(lease, pages[:got], n=got).wait()
                    loaded = True
            except kvtier.KvtierError as e:
                logger.warning("kvtier: loading %d page(s) failed, they are misses: %s",
                               got, e)
                got = 0
            finally:
                # A completed load of the world's last rank released the
                # lease (world 1); every other way out releases it here.
                if lease.id and not (loaded and self.world == 1):
                    lease.release()
        self._last_get.keys, self._last_get.got = list(keys), got
        if got:
            self._note("prefetch", got, t0)
        return [True] * got + [False] * (n - got)

    def _pages(self, host_indices, n, what):
        pages = _pages_of(host_indices, n, self.page_size)
        if pages is None:
            logger.error("kvtier: %s got %d host indices for %d pages of %d tokens that are "
                         "not whole pages; nothing moved", what, host_indices.numel(), n,
                         self.page_size)
        return pages

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        n = len(keys)
        if n == 0:
            return []
        if not self.writer:
            # SGLang's own rule (backup_skip): only the storage writer sets
            # MLA pages; a call here would be a second copy of the same bytes
            return [True] * n
        depth = self._depth(extra_info, saving=True)
        k = _keys_of(keys)
        t0 = time.perf_counter_ns()
        with self._lock:
            t = self._attach()
            pages = self._pages(host_indices, n, "batch_set_v1")
            if pages is None:
                return [False] * n
            try:
                op = t.save(k, pages, first_depth=depth)
                op.wait()
            except kvtier.KvtierError as e:
                logger.warning("kvtier: saving %d page(s) failed: %s", n, e)
                return [False] * n
        self._note("backup", n, t0)
        return [True] * n

    # ---- v2: the folded pools (see "Hybrid pools") ----

    def _folded_transfers(self, transfers, what):
        for t in transfers or ():
            name = str(t.name)
            if name not in self.folded:
                raise ValueError("kvtier.sglang: %s of the pool %r, which is not stored "
                                 "(kvtier stores the KV pool and %s)"
                                 % (what, name, ", ".join(self.folded) or "nothing else"))
            policy = str(getattr(t.hit_policy, "value", t.hit_policy))
            if policy != "all_pages":
                raise ValueError("kvtier.sglang: the %r pool asks for hit policy %r; its pages "
                                 "ride on the KV pages (all_pages)" % (name, policy))
            yield name, t

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransferResult
        hits = self.batch_exists(keys, extra_info)
        # keyed by SGLang's own names (PoolName hashes by its member name)
        pools = {PoolName.KV: hits}
        for _, t in self._folded_transfers(pool_transfers, "a lookup"):
            pools[t.name] = hits  # stored in the same chunk as the KV page
        return PoolTransferResult(hits, pools if hits else {}, list(range(1, hits + 1)))

    def batch_get_v2(self, transfers, extra_info=None):
        out = {}
        last = getattr(self._last_get, "keys", None)
        got = getattr(self._last_get, "got", 0)
        for name, t in self._folded_transfers(transfers, "a get"):
            keys = list(t.keys or ())
            # loaded by this thread's batch_get_v1 of the same keys
            n = got if keys == last else 0
            out[t.name] = [True] * min(n, len(keys)) + [False] * (len(keys) - min(n, len(keys)))
        return out

    def batch_set_v2(self, transfers, extra_info=None):
        # saved by the batch_set_v1 of the same keys, with the KV page
        return {t.name: [True] * len(t.keys or ())
                for _, t in self._folded_transfers(transfers, "a set")}

    def _hold_here(self):
        """Test hook (KVTIER_SGLANG_TEST_HOLD=PATH): a get that holds its
        pins stops here, after writing PATH, for the test to kill it."""
        with open(self._hold, "w") as f:
            f.write(str(os.getpid()))
        while True:
            time.sleep(60)

    def _note(self, kind, pages, t0):
        dt = max(time.perf_counter_ns() - t0, 1) * _NS
        nbytes = pages * sum(g.n_layers * g.bytes_per_token * g.tokens_per_block
                             for g in self.groups)
        with self._stats_lock:
            self._stats[kind + "_pgs"].append(pages)
            self._stats[kind + "_bandwidth"].append(nbytes / dt / 1e9)

    def get_stats(self):
        from sglang.srt.observability.metrics_collector import StorageMetrics
        m = StorageMetrics()
        # the scheduler's thread asks; the I/O and backup threads append
        with self._stats_lock:
            for name, values in self._stats.items():
                getattr(m, name).extend(values)
                values.clear()
        return m

    def clear(self):
        # The segment is the node's, shared with other instances: one
        # engine's "clear the storage" must not empty the others' tier.
        logger.info("kvtier: clear() leaves the node's segment as it is (other engines "
                    "share it); remove it with kvtier-stat --remove or kvtierd")

    # ---- the generic calls: kvtier moves pages only between the pool and
    # the segment (the v1 calls); SGLang uses those with interface_v1 ----

    def _generic(self, what):
        raise NotImplementedError(
            "kvtier.sglang: %s (SGLang's copying interface) is not provided: kvtier moves "
            "pages straight between the host pool and the segment; set \"interface_v1\": 1 "
            "in --hicache-storage-backend-extra-config" % what)

    def get(self, key, target_location=None, target_sizes=None):
        self._generic("get")

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        self._generic("batch_get")

    def set(self, key, value=None, target_location=None, target_sizes=None):
        self._generic("set")

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        self._generic("batch_set")

    def exists(self, key):
        return self.batch_exists([key]) == 1
