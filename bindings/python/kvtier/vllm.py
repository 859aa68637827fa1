"""kvtier.vllm - vLLM on kvtier: a KV connector that vLLM loads by module path.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvtier_segment": "kvtier"}}'

Which of vLLM's plug-in points, and why.  vLLM (0.32) offers two: a KV
connector class (KVConnectorBase_V1, by kv_connector_module_path) and the
OffloadingConnector's pluggable spec (spec_name / spec_module_path: a
scheduler-side OffloadingManager and a worker-side handler).  This module is
a KV connector, because kvtier's unit of work is a *prefix lookup under a
lease*, and only the connector interface hands the connector a whole
request at once:

  * get_num_new_matched_tokens(request) is one kvt_lookup over every chunk
    key of the prompt: the longest READY prefix, pinned atomically under one
    lease that every rank's load releases.  The offloading manager instead
    asks lookup(key) one block at a time and later prepare_load(keys),
    "assuming all given blocks are offloaded"; between the two another
    instance may evict a chunk from the shared segment, and prepare_load
    cannot fail.  Pinning per block at lookup time would need a lease per
    block and a release protocol vLLM does not drive.
  * The block bookkeeping the offloading spec would keep (an LRU of what is
    offloaded, per-block events) lives in the segment already, shared by
    every instance on the node; a second copy per engine would disagree
    with it as soon as another engine evicts.
  * Preemption, abort and never-scheduled lookups map onto kvtier's own
    release paths: request_finished and preemption release the request's
    lease; a lookup whose request is never scheduled is released by the
    two-step stale sweep (kvt_step with this step's loads).

Loads and saves off the step (kvtier_async, the default).  On the CPU
backend a copy is a memcpy of the blocks by the rank's copy threads; on
GPUs the driver's DMA engines.  Neither holds up the batch:

  * a hit is answered as an asynchronous load (get_num_new_matched_tokens
    -> (tokens, True)): vLLM allocates its blocks (update_state_after_alloc
    gives them: the request is not in this step's scheduler output), puts
    it in WAITING_FOR_REMOTE_KVS, and the ranks submit the load in
    start_load_kv; get_transfer_results reports it once its op ended, and
    only then does vLLM schedule the request, so no kernel reads a block
    before its copy completed.  The lease stays in the stale sweep's live
    set until the ranks reported it (a rank that has not loaded yet still
    needs the pins).  A failed load is reported in failed_recving (with
    finished_recving): vLLM recomputes the request (kv_load_failure_policy
    recompute, set by the scheduler side unless kvtier_load_failure_policy
    says fail), and kvtier is not asked for it again.
  * saves are submitted in wait_for_save (ordered after the forward pass
    on a GPU) and polled once a step.  What they read must stay the
    request's KV until they end; vLLM gives a block away in three ways:
      - the request finishes: request_finished returns True for a request
        that had saves, vLLM keeps its blocks until every rank reported it
        in finished_sending, which a rank does once vLLM said it finished
        and none of its saves runs;
      - preemption frees the blocks at once: the scheduler names the
        preempted requests in the next step's metadata and the ranks end
        their saves in handle_preemptions, which vLLM calls before that
        step's forward pass (and before any zeroing or load of a reused
        block);
      - a sliding window or chunked local group frees a running request's
        blocks as the window moves on, and a finished one's below the
        window before the connector hears of the finish (vLLM 0.32's
        Scheduler._connector_finished calls remove_skipped_blocks, then
        request_finished, whose True keeps only the blocks still in the
        request's table): with such a group the metadata says so every
        step (flush_all), and each rank ends every save it has running in
        handle_preemptions, before the forward pass that may write a freed
        block.  The rank decides from its own running saves, not the
        scheduler from its view of who is saving: a request that finished
        has left that view while its copies still run.  So a save never
        outlives the step after the one it was submitted in, which the
        saving rule below assumes.
  * each rank may have 1024 chunk copies in flight (kvtier_max_inflight):
    a load or save moves on only when the step polls it, once a step.

kvtier_async false waits for loads in start_load_kv and for saves in
wait_for_save, inside the step.

Only whole chunks are saved; a chunk is chunk_tokens (a multiple of vLLM's
block size, default: one block). vLLM's own prefix-cache hits are whole
blocks, so with larger chunks a local hit may end inside one: the lookup
then starts at that chunk, vLLM is told the tokens after its own hit, and
the load skips the chunk's blocks vLLM already has (KVT_BLOCK_SKIP).

Which KV a chunk holds, per KV cache group type.  kvtier stores a chunk
only when every block of it, in every group, holds KV that vLLM computed
for this prefix, and loads a chunk only into blocks vLLM gave the request
to be written.  vLLM's block tables say which: block id 0 is its null
block, the stand-in for a block a group does not keep.  Per group type
(kv_cache_interface.py; this connector is not SupportsHMA, so vLLM turns
its hybrid allocator off and promotes a mix of full and local attention
layers to full attention: a model has one group type here):

  * full attention, MLA: every block of the prompt is real and kept while
    the request runs.  Saved and loaded whole.
  * sliding window (window w) and chunked local attention (chunk a): the
    blocks before the window are the null block -- in a local prefix hit
    (find_longest_cache_hit pads them with it), in the blocks allocated for
    kvtier's own hit tokens (add_local_computed_blocks pads the skipped
    ones), and in a running request's table, where allocate_slots replaces
    them (remove_skipped_blocks) and frees the real block, which another
    request may then be given.  The connector's copy of the table never
    sees that replacement (scheduler output lists new blocks only), so it
    works the rule out itself: at the start of a step whose request had n
    tokens computed, the blocks vLLM may have freed are those below
    skipped(n) tokens (sliding: n - w + 1; chunked: n // a * a; the
    retained tail of speculative decoding only keeps more).  A chunk is
    saved only in the step it becomes full, and only when all its blocks
    are at or past skipped(n) and none is the null block: its KV is in its
    blocks until the step ends, and no save runs past the next step's
    start (see above).  Chunks that fell out of the window before they
    were full, or were a local hit's null blocks, are never saved; the tier then holds a prefix with a
    hole, and lookups stop at the hole (a shorter hit, never a wrong one).
    A load writes every block vLLM gave the request and skips the null
    ones (KVT_BLOCK_SKIP): those tokens are never attended.
  * anything else (Mamba/SSM state, cross-attention, encoder-only, sink
    and reversed-window attention, circular buffers, HiSparse): no chunk of
    it could be exact, so the connector refuses the model at start with
    the group named.  (Hybrid SSM models also need vLLM's hybrid allocator,
    which vLLM keeps off for connectors that are not SupportsHMA.)

Keys.  A chunk's key is the first 128 bits of vLLM's own block hash of the
chunk's last block: vLLM chains block hashes over the whole prefix (and its
extra keys: LoRA, multimodal hashes, cache salt), so nothing is hashed twice.
That is only sound when every process computes the same hashes: vLLM's
sha256 family with its fixed seed, or any algorithm with PYTHONHASHSEED set.
A process-seeded hash (xxhash without PYTHONHASHSEED) is refused at start
with the option to change.  What the keys depend on besides the tokens,
where it is not every engine's default -- an algorithm other than sha256,
PYTHONHASHSEED set (it seeds every algorithm) -- is appended to the model
identity (";prefix-hash=ALGO", ";hashseed=N"): two engines that would
compute other keys for the same tokens are refused at attach, both
identities named, instead of sharing a tier neither finds the other's
chunks in.  With prefix caching off (no block hashes), keys
are kvtier's own hash of the token ids (kvt_hash_tokens).

What a chunk's bytes mean.  A chunk is served to any engine whose layout
fingerprint is the segment's (and, through the L3, the node's), so the
fingerprint must cover everything that gives the bytes their meaning, not
only their sizes.  The geometry (chunk tokens, world, the groups' layers
and bytes per token) is the segment's own; the rest is the model identity,
a text "NAME;field=value;..." whose hash is part of the fingerprint and
which the segment keeps for messages (a mismatch names each field that
differs, with both values):

  NAME          kvtier_model / KVTIER_MODEL, default the model as given to
                vLLM (a path or a Hugging Face name);
  dtype         the model's dtype as vLLM resolved it;
  kv            the KV cache's element format: "auto" is the model's
                dtype; every fp8 format with the platform's variant
                ("fp8_e4m3/ocp", "fp8_e4m3/fnuz": MI300/MI325 store FNUZ,
                MI355X, NVIDIA and CPUs OCP -- one byte, another number);
  kv-skip       layers vLLM keeps unquantized (kv_cache_dtype_skip_layers);
  layout        the KV cache layout vLLM's engine core resolved for the
                backends (KVCacheConfig.kv_cache_layout: LBHNC, LBNHC, ...:
                the order of heads and tokens inside a block);
  quant         online quantization (--quantization);
  weights=dummy vLLM's dummy weights;
  prefix-hash, hashseed   what the keys depend on (see Keys);
  then what the model's files say (kvt_model_files_id, in libkvtier so that
  kvtierd --model-config computes the same from the same file):
  rev           the Hugging Face snapshot's commit (every file of it), or
  weights       the weight files' names, sizes and mtimes (a checkpoint
                rewritten in place is another model);
  config        config.json's digest (architecture, rope, the
                quantization config, the checkpoint's KV-scale scheme).

The fp8 KV scales: vLLM 0.32 takes them from the checkpoint (or 1.0 where
it has none) -- covered by the files' fields; it has no runtime
calculation any more (calculate_kv_scales), and an engine that has one is
refused at start: two engines would scale the same prefix differently.
Not covered: weights changed without their files changing (a process that
patches them in memory), and a local checkpoint copied without its mtimes
is another identity on that node (a miss there, never a wrong chunk).

Ranks.  Every TP x PP worker is a kvtier rank: rank = pp_rank x TP + tp_rank,
world = TP x PP, both from vLLM's parallel config and checked against the
worker's process groups; a worker whose groups disagree with the config
(a TP 4 engine whose worker sees world 1) fails at start, loudly.  The
scheduler is the instance's SCHEDULER.  MLA models use the replicated
layout (one copy for all ranks).  Data-parallel replicas are instances.

Configuration: kv_connector_extra_config keys (kvtier_segment,
kvtier_segment_dir, kvtier_instance, kvtier_instances, kvtier_chunk_tokens,
kvtier_tier_gib, kvtier_create, kvtier_dma, kvtier_model,
kvtier_disk_wait_ms), else the KVTIER_* variables, else defaults (README,
"vLLM").

The disk tier and the L3.  When the segment has one (kvtierd --disk,
kvtierd --l3) the scheduler's lookup is kvt_lookup_ex: chunks right after
the DRAM hits that sit on disk, or that the L3 store may hold, are asked
back, and the request is answered "ask again" (None: vLLM's scheduler
skips it this step and asks next step) until they are hits (or the L3
answered that it has not got them), or until it has waited
kvtier_disk_wait_ms (default 500; 0: never wait, load what is in DRAM).  Waiting costs the request its place for a step or a
few; recomputing those chunks costs their prefill.
"""

import errno
import os
import shlex
import time
from dataclasses import dataclass, field

import numpy as np

import kvtier

VLLM_VERSIONS = ("0.32.",)  # the KV connector interface these tests ran against

try:
    import vllm
except ImportError as e:  # pragma: no cover
    raise ImportError("kvtier.vllm needs vLLM installed: %s" % e) from None

if not any(vllm.__version__.startswith(v) for v in VLLM_VERSIONS) and \
        os.environ.get("KVTIER_VLLM_ANY_VERSION") != "1":
    raise ImportError(
        "kvtier.vllm was built and tested against vLLM %s; this is vLLM %s.  vLLM's KV "
        "connector interface is experimental and changes between releases: install a "
        "tested vLLM, or set KVTIER_VLLM_ANY_VERSION=1 to try this one at your own risk"
        % (" / ".join(v + "x" for v in VLLM_VERSIONS), vllm.__version__))

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults)
from vllm.logger import init_logger  # noqa: E402

# Under vLLM's own logger ("vllm"), so that the lines reach vLLM's handlers
# and level (VLLM_LOGGING_LEVEL, VLLM_LOGGING_CONFIG_PATH); a logger named
# after this module ("kvtier.vllm") would be outside vLLM's configuration
# and its INFO lines would be dropped.
logger = init_logger("vllm.kvtier")

# The name in vLLM's connector factory, also when the plugin (vllm_plugin.py,
# installed with the package) did not run in this process.
from . import vllm_plugin as _plugin  # noqa: E402

_plugin.register()

try:  # vLLM's KV-connector stats (its log lines and its /metrics)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
        KVConnectorPromMetrics, KVConnectorStats)
except ImportError:  # pragma: no cover
    KVConnectorStats = KVConnectorPromMetrics = None

_NON_DETERMINISTIC_ALGOS = ("xxhash", "xxhash_cbor")


# ---- metadata (scheduler -> workers, once per step) ----

@dataclass
class _Load:
    req_id: str
    lease: int
    n_chunks: int
    block_ids: list      # one list per KV cache group; BLOCK_SKIP: leave it
    is_async: bool = False  # the request waits in WAITING_FOR_REMOTE_KVS


@dataclass
class _Save:
    req_id: str
    keys: bytes          # n x 16 bytes, little-endian (lo, hi)
    first_depth: int
    block_ids: list      # one list per KV cache group


@dataclass
class KvtierConnectorMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)
    # saves still in flight that must end before this step's forward pass:
    # those of the requests preempted since the last step (vLLM freed their
    # blocks), or every one a rank has running when flush_all (the model has
    # a windowed group: vLLM frees a running or finished request's blocks
    # as its window moves on, the finished one's before request_finished)
    flush: list = field(default_factory=list)
    flush_all: bool = False


# ---- stats: through vLLM's KV-connector stats to its log and /metrics ----

# name -> help; every value a sum over the interval (and over the ranks)
STATS = {
    "lookups": "kvtier lookups (one per request and try)",
    "lookup_tokens": "prompt tokens asked of kvtier (past vLLM's own hit)",
    "hit_tokens": "prompt tokens kvtier had, handed to vLLM as computed",
    "disk_waits": "lookups answered 'ask again' while kvtierd read chunks back from disk",
    "save_holes": "full chunks not saved because their blocks were not this request's KV "
                  "(vLLM's null block: outside a sliding window, or freed)",
    "loaded_chunks": "chunk shards loaded into vLLM's KV cache (per rank)",
    "saved_chunks": "chunk shards written to kvtier (per rank; deduplicated ones not counted)",
    "load_seconds": "seconds the ranks spent on loads: waiting in the step (synchronous), "
                    "or from submission to completion seen (asynchronous)",
    "save_seconds": "seconds the ranks' steps waited for saves (submission, and the flushes "
                    "before a forward pass that reuses a saved block)",
    "load_errors": "loads that failed (their tokens are recomputed by vLLM, never used)",
    "save_errors": "saves that failed (those chunks are simply not in the tier)",
}

if KVConnectorStats is not None:
    @dataclass
    class KvtierConnectorStats(KVConnectorStats):
        """kvtier's counters over one interval (sums; see STATS)."""

        def __post_init__(self):
            if not self.data:
                self.reset()

        def reset(self):
            self.data = {k: 0 for k in STATS}

        def add(self, name, v):
            self.data[name] = self.data.get(name, 0) + v

        def aggregate(self, other):
            for k, v in (other.data or {}).items():
                self.add(k, v)
            return self

        def reduce(self):
            return {k: round(v, 6) if isinstance(v, float) else v for k, v in self.data.items()}

        def is_empty(self):
            return not any(self.data.values())

        def take(self):
            """The interval's stats (None when nothing happened); resets."""
            if self.is_empty():
                return None
            out = KvtierConnectorStats(data=dict(self.data))
            self.reset()
            return out

    class KvtierPromMetrics(KVConnectorPromMetrics):
        """vllm:kvtier_<name>_total counters, per engine."""

        def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
            super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
            self._counters = {}
            for k, doc in STATS.items():
                c = self._counter_cls(name="vllm:kvtier_" + k, documentation=doc,
                                      labelnames=labelnames)
                self._counters[k] = {i: c.labels(*v) for i, v in per_engine_labelvalues.items()}

        def observe(self, transfer_stats_data, engine_idx=0):
            for k, v in (transfer_stats_data or {}).items():
                per = self._counters.get(k)
                if per is not None and engine_idx in per and v:
                    per[engine_idx].inc(v)
else:  # pragma: no cover
    KvtierConnectorStats = KvtierPromMetrics = None


# ---- configuration ----

def _key_identity(prefix_caching, algo):
    """What a chunk's key depends on besides its tokens, where it is not
    what every engine shares by default: vLLM's block-hash algorithm (its
    default sha256) and PYTHONHASHSEED, which seeds every algorithm's
    hashes when set (vLLM 0.32's kv_cache_utils.resolve_none_hash_seed).
    Appended to the model identity, so that two engines that would compute
    other keys for the same tokens -- a recipe that sets PYTHONHASHSEED on
    prefill only -- are refused at attach with both values named, instead
    of sharing a tier in which neither ever finds the other's chunks.
    Empty in the default case, so kvtierd's --model needs nothing more;
    with prefix caching off the keys are kvtier's own hash of the tokens."""
    if not prefix_caching:
        return ""
    out = "" if algo == "sha256" else ";prefix-hash=%s" % algo
    seed = os.environ.get("PYTHONHASHSEED")
    if seed is not None:
        out += ";hashseed=%s" % seed
    return out


def _kv_format(cache_dtype, model_dtype):
    """The KV cache's element format as the bytes hold it: "auto" is the
    model's dtype; fp8 is e4m3 (vLLM: "fp8" = "fp8_e4m3"), and every fp8
    format is named with the platform's variant -- MI300/MI325 (gfx94x)
    store FNUZ, MI355X, NVIDIA and the CPU OCP (vLLM's
    current_platform.is_fp8_fnuz()): one byte, another number."""
    if cache_dtype in (None, "auto"):
        return model_dtype
    if cache_dtype.startswith("fp8"):
        try:
            from vllm.platforms import current_platform
            fnuz = bool(current_platform.is_fp8_fnuz())
        except Exception:  # pragma: no cover - a platform that cannot say
            fnuz = False
        name = "fp8_e4m3" if cache_dtype == "fp8" else cache_dtype
        return "%s/%s" % (name, "fnuz" if fnuz else "ocp")
    return cache_dtype


def _model_config_file(mc):
    """The config.json vLLM read for the model: in its directory, else in
    the Hugging Face cache (a snapshot path, whose commit is the weights'
    identity); None when there is none (GGUF, Mistral's params.json)."""
    src = getattr(mc, "hf_config_path", None) or mc.model
    p = os.path.join(str(src), "config.json")
    if os.path.isfile(p):
        return os.path.abspath(p)
    try:
        from huggingface_hub import try_to_load_from_cache
        f = try_to_load_from_cache(str(src), "config.json",
                                   revision=getattr(mc, "revision", None))
        return f if isinstance(f, str) else None
    except Exception:
        return None


def _engine_identity(mc, cache, kv_cache_config):
    """The fields of the model identity that the engine decides -- what its
    KV bytes mean besides the model's files (the module's design comment,
    "What a chunk's bytes mean")."""
    dtype = str(mc.dtype).replace("torch.", "")
    if getattr(cache, "calculate_kv_scales", False):
        raise ValueError(
            "kvtier: calculate_kv_scales is on: each engine computes its own fp8 KV scales "
            "from its first batches, so two engines' chunks of one prefix hold numbers of "
            "different scales; run without it (a checkpoint's scales are part of the model's "
            "identity)")
    out = ";dtype=%s;kv=%s" % (dtype, _kv_format(getattr(cache, "cache_dtype", "auto"), dtype))
    skip = getattr(cache, "kv_cache_dtype_skip_layers", None)
    if skip and getattr(cache, "cache_dtype", "auto") != "auto":
        out += ";kv-skip=%s" % ",".join(sorted(str(x) for x in skip))
    layout = getattr(kv_cache_config, "kv_cache_layout", None) or \
        getattr(cache, "kv_cache_layout", None)
    if not layout:
        raise ValueError("kvtier: vLLM has not resolved the KV cache layout (KVCacheConfig."
                         "kv_cache_layout): kvtier cannot tell which bytes of a block are "
                         "which; this vLLM is not one kvtier supports")
    out += ";layout=%s" % getattr(layout, "name", layout)
    quant = getattr(mc, "quantization", None)
    if quant:
        out += ";quant=%s" % quant
    load = getattr(getattr(mc, "load_config", None), "load_format", None) or \
        getattr(mc, "load_format", None)
    if str(load) == "dummy":
        out += ";weights=dummy"
    return out


def _opt(extra, key, env, default, conv=str):
    if extra and key in extra and extra[key] is not None:
        v = extra[key]
        what = "kv_connector_extra_config[%r]" % key
    elif os.environ.get(env) is not None:
        v = os.environ[env]
        what = env
        if v == "":
            raise ValueError("kvtier: %s is set but empty: unset it or give a value" % env)
    else:
        return default
    try:
        return conv(v)
    except (TypeError, ValueError):
        raise ValueError("kvtier: %s=%r: expected %s" % (what, v, conv.__name__)) from None


def _bool(v):
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(v)


class _Settings:
    def __init__(self, vllm_config, kv_cache_config):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        par = vllm_config.parallel_config
        cache = vllm_config.cache_config
        self.tp = par.tensor_parallel_size
        self.pp = par.pipeline_parallel_size
        self.world = self.tp * self.pp
        self.segment = _opt(extra, "kvtier_segment", "KVTIER_SEGMENT", "kvtier")
        self.segment_dir = _opt(extra, "kvtier_segment_dir", "KVTIER_SEGMENT_DIR", None)
        dp_rank = getattr(par, "data_parallel_rank", 0) or 0
        self.instance = _opt(extra, "kvtier_instance", "KVTIER_INSTANCE", dp_rank, int)
        self.instances = _opt(extra, "kvtier_instances", "KVTIER_INSTANCES",
                              max(getattr(par, "data_parallel_size", 1) or 1,
                                  self.instance + 1), int)
        self.block_size = cache.block_size
        self.chunk_tokens = _opt(extra, "kvtier_chunk_tokens", "KVTIER_CHUNK_TOKENS",
                                 self.block_size, int)
        if self.chunk_tokens <= 0 or self.chunk_tokens % self.block_size:
            raise ValueError("kvtier: chunk_tokens=%d must be a positive multiple of vLLM's "
                             "block size (%d)" % (self.chunk_tokens, self.block_size))
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        self.tier_gib = _opt(extra, "kvtier_tier_gib", "KVTIER_TIER_GIB", 1.0, float)
        self.create = _opt(extra, "kvtier_create", "KVTIER_CREATE", True, _bool)
        self.dma = _opt(extra, "kvtier_dma", "KVTIER_DMA", None)
        self.disk_wait_ms = _opt(extra, "kvtier_disk_wait_ms", "KVTIER_DISK_WAIT_MS", 500.0,
                                 float)
        if self.disk_wait_ms < 0:
            raise ValueError("kvtier: kvtier_disk_wait_ms=%r must be >= 0" % self.disk_wait_ms)
        # loads and saves off the step (the default), or waited for in it
        self.async_io = _opt(extra, "kvtier_async", "KVTIER_ASYNC", True, _bool)
        # chunk copies in flight per rank: an asynchronous load or save moves
        # on only when the step polls it, once a step, so a window of the
        # library's default (32 chunks) would spread a long prompt's load
        # over several steps.  0: the library's (KVTIER_MAX_INFLIGHT).
        self.max_inflight = _opt(extra, "kvtier_max_inflight", "KVTIER_MAX_INFLIGHT",
                                 1024 if self.async_io else 0, int)
        if not 0 <= self.max_inflight <= 4096:
            raise ValueError("kvtier: kvtier_max_inflight=%d: expected 1..4096"
                             % self.max_inflight)
        # keys: vLLM's block hashes when every process computes the same ones
        self.hash_algo = cache.prefix_caching_hash_algo
        self.prefix_caching = bool(cache.enable_prefix_caching)
        mc = vllm_config.model_config
        name = _opt(extra, "kvtier_model", "KVTIER_MODEL", str(mc.model))
        if ";" in name:
            raise ValueError("kvtier: the model name %r contains ';', which separates the "
                             "model identity's fields" % name)
        # The identity: the name, what the engine decides, what the keys
        # depend on, then what the model's files say (kvt_model_files_id,
        # last: kvtierd --model-config appends the same) -- see the
        # module's design comment, "What a chunk's bytes mean".
        self.model_name = name
        self.config_file = _model_config_file(mc)
        self.model_engine = name + _engine_identity(mc, cache, kv_cache_config) + \
            _key_identity(self.prefix_caching, self.hash_algo)
        files = ""
        if self.config_file is not None:
            files = ";" + kvtier.model_files_id(self.config_file)
        elif getattr(mc, "revision", None):
            files = ";rev=%s" % mc.revision
        self.model = self.model_engine + files
        if len(self.model.encode()) > 1000:
            raise ValueError("kvtier: the model identity is %d bytes, over 1000: %r"
                             % (len(self.model.encode()), self.model))
        if self.prefix_caching and self.hash_algo in _NON_DETERMINISTIC_ALGOS and \
                os.environ.get("PYTHONHASHSEED") is None:
            raise ValueError(
                "kvtier: vLLM's prefix_caching_hash_algo=%r is seeded per process (random "
                "unless PYTHONHASHSEED is set), so two processes never agree on a chunk's "
                "key and nothing saved would ever be found; kvtier shares chunks across "
                "processes.  Use --prefix-caching-hash-algo sha256 (or sha256_cbor), or set "
                "PYTHONHASHSEED to the same value for every vLLM process" % self.hash_algo)
        self.groups, self.replicated = self._groups(kv_cache_config)

    def _groups(self, kv_cache_config):
        """One kvtier group per vLLM KV cache group: each attention layer's
        block (one rank's) is two kvtier "layers", its two halves -- the
        one description that fits every backend's tensor layout, K and V
        apart (GPU) or interleaved in one block (CPU) (see register).
        self.windows[g]: the group's skipped-token rule (see the module's
        design comment), None for full attention."""
        groups, repl = [], set()
        self.windows = []
        for g in kv_cache_config.kv_cache_groups:
            spec = g.kv_cache_spec
            kind, param = _group_kind(spec)
            if kind is None:
                raise ValueError(
                    "kvtier: the KV cache group of layers %s... is %s, which kvtier cannot "
                    "store exactly (it stores full, MLA, sliding-window and chunked local "
                    "attention KV); run this model without the kvtier connector"
                    % (", ".join(g.layer_names[:2]), type(spec).__name__))
            if spec.block_size != self.block_size:
                raise ValueError("kvtier: KV cache groups with different block sizes (%d, "
                                 "%d) are not supported" % (spec.block_size, self.block_size))
            page = spec.page_size_bytes
            if page % (2 * spec.block_size):
                raise ValueError("kvtier: a block of %d bytes does not split into two halves "
                                 "of whole tokens" % page)
            is_mla = kind in ("mla", "sliding-mla")
            repl.add(is_mla)
            groups.append(kvtier.Group(2 * len(g.layer_names), page // (2 * spec.block_size),
                                       spec.block_size, is_mla))
            self.windows.append(None if kind in ("full", "mla") else
                                ("chunked" if kind == "chunked" else "sliding", param))
        if len(repl) > 1:
            raise ValueError("kvtier: MLA and non-MLA KV cache groups in one model are not "
                             "supported")
        if len(groups) > 8:
            raise ValueError("kvtier: %d KV cache groups; kvtier holds at most 8" % len(groups))
        return groups, bool(repl and repl.pop())

    def open(self, role, rank=None):
        """Opens the segment as role.  With create (the default) whoever
        comes first -- a rank or the scheduler -- creates it: attach first
        (wherever kvt_open finds it: the segment dir, /dev/shm, a hugetlbfs
        mount), create only where there is none, and attach again if
        another process created it meanwhile."""
        # the library's own lines (placement, huge pages, the DMA backend)
        # through vLLM's logger, with its format and level
        kw = dict(segment=self.segment, segment_dir=self.segment_dir, role=role,
                  world=self.world, instance=self.instance, groups=self.groups,
                  chunk_tokens=self.chunk_tokens, model=self.model,
                  log=lambda level, msg: logger.log(level, "kvtier: %s", msg))
        if rank is not None:
            kw["rank"] = rank
        if self.dma and role == "rank":
            kw["dma"] = self.dma
        if self.max_inflight and role == "rank":
            kw["max_inflight"] = self.max_inflight
        deadline = time.monotonic() + 30
        while True:
            try:
                return kvtier.Tier(**kw)
            except kvtier.KvtierError as e:
                if e.errno == 71 and time.monotonic() < deadline:
                    time.sleep(0.05)  # EPROTO: its creator is still writing it
                    continue
                if e.errno != 2 or not self.create:  # ENOENT
                    raise
            try:
                return kvtier.Tier(create=True, n_instances=self.instances,
                                   tier_bytes=int(self.tier_gib * (1 << 30)), **kw)
            except kvtier.KvtierError as e:
                if e.errno != 17:  # EEXIST: another process created it first
                    raise


def _group_kind(spec):
    """(kind, parameter) of a KV cache spec: ("full"|"mla", None),
    ("sliding"|"sliding-mla", window), ("chunked", chunk size), or
    (None, None) for a spec kvtier cannot store exactly.  By exact class:
    a subclass (sink, reversed-window, hidden-state caches) has its own
    block rules."""
    name = type(spec).__name__
    if name == "FullAttentionSpec":
        return "full", None
    if name == "MLAAttentionSpec":
        return "mla", None
    if name in ("SlidingWindowSpec", "SlidingWindowMLASpec"):
        return ("sliding-mla" if "MLA" in name else "sliding"), int(spec.sliding_window)
    if name == "ChunkedLocalAttentionSpec":
        return "chunked", int(spec.attention_chunk_size)
    return None, None


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


# ---- the connector ----

class KvtierConnector(KVConnectorBase_V1):

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._s = _Settings(vllm_config, kv_cache_config)
        self._tier = None
        self._stats = KvtierConnectorStats() if KvtierConnectorStats else None
        if role == KVConnectorRole.SCHEDULER:
            self._sched_init()
        else:
            self._worker_init()

    # -- stats (both sides; vLLM sums the workers' and the scheduler's) --

    def _stat(self, name, v=1):
        if self._stats is not None:
            self._stats.add(name, v)

    def get_kv_connector_stats(self):
        return self._stats.take() if self._stats is not None else None

    @classmethod
    def build_kv_connector_stats(cls, data=None):
        if KvtierConnectorStats is None:
            return None
        return KvtierConnectorStats(data=dict(data)) if data else KvtierConnectorStats()

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        if KvtierPromMetrics is None:
            return None
        return KvtierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # -- scheduler side --

    @property
    def requires_kv_delivery(self):
        """A best-effort cache: a save dropped with a preempted request is a
        future miss, never a reason to recompute the request."""
        return False

    def _kvtierd_line(self):
        s = self._s
        # with the model's config.json, kvtierd appends its files' fields
        # itself (the same kvt_model_files_id)
        q = shlex.quote
        model = ("--model-config %s --model %s" % (q(s.config_file), q(s.model_engine))
                 if s.config_file else "--model %s" % q(s.model))
        return ("kvtierd --segment %s %s --world %d --chunk-tokens %d --instances %d "
                "%s%s" % (
                    s.segment, " ".join("--group %d:%d" % (g.n_layers, g.bytes_per_token)
                                        for g in s.groups),
                    s.world, s.chunk_tokens, s.instances, model,
                    " --replicated" if s.replicated else ""))

    def _open(self, role, **kw):
        """The segment, as role.  When it cannot be attached (another
        layout's or model's, or none where kvtier_create is off), the
        kvtierd line that makes one this engine attaches to is logged first:
        it is wanted then, not only on success."""
        try:
            return self._s.open(role, **kw)
        except kvtier.KvtierError:
            logger.error("kvtier: segment '%s' cannot be this engine's; a kvtierd for this "
                         "engine: %s", self._s.segment, self._kvtierd_line())
            raise

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
        if s.prefix_caching and len(request.block_hashes) >= (first_chunk + n) * s.blocks_per_chunk:
            return _chunk_keys_from_hashes(request.block_hashes, s.blocks_per_chunk,
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
        if off % s.block_size:
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
        bpc = s.blocks_per_chunk
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
            if any(len(b) < (first + n) * bpc for b in blocks):
                self._tier.release(lid)
                continue
            have = off // s.block_size  # blocks of the first chunk vLLM computed itself
            tables = [[kvtier.BLOCK_SKIP if x == 0 or i < have else x
                       for i, x in enumerate(b[first * bpc:(first + n) * bpc])]
                      for b in blocks]
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
            full = min([full] + [len(b) // bpc for b in blocks])
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
                                        [b[c * bpc:e * bpc] for b in blocks]))
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
        """Chunk c's blocks, in every group, hold this request's KV during
        this step: none is the null block, and none is below what vLLM may
        have freed at the start of the step (done0 tokens computed then)."""
        s = self._s
        bpc = s.blocks_per_chunk
        for g, b in enumerate(blocks):
            # remove_skipped_blocks frees blocks [0, skipped // block_size)
            if c * bpc < _skipped_tokens(s.windows[g], done0) // s.block_size:
                return False
            if 0 in b[c * bpc:(c + 1) * bpc]:
                return False
        return True

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

    # -- worker side --

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
        dimension of size num_blocks, each block one contiguous run of
        page_size bytes, or split in two equal runs (K and V apart)."""
        s = self._s
        cfg = self._kv_cache_config
        per_group = []
        for g, grp in zip(s.groups, cfg.kv_cache_groups):
            page = grp.kv_cache_spec.page_size_bytes
            half = page // 2
            spans = []
            for name in grp.layer_names:
                spans.extend(_halves(kv_caches[name], cfg.num_blocks, page, half, name))
            strides = {st for _, st in spans}
            if len(strides) != 1:
                raise ValueError("kvtier: the layers of a KV cache group have different block "
                                 "strides %s" % sorted(strides))
            per_group.append(([b for b, _ in spans], strides.pop(), cfg.num_blocks))
        self._kv_caches = kv_caches  # kvtier holds their addresses
        self._tier.register_kv(groups=per_group)
        first = next(iter(kv_caches.values()), None)
        dev = getattr(first, "device", None)
        # a GPU cache: saves wait for the forward pass (_order_saves)
        self._save_order = "stream" if getattr(dev, "type", "cpu") == "cuda" else None
        self._kv_device = dev

    def _order_saves(self):
        """vLLM asks for the saves once it has launched the forward pass that
        writes the blocks, not once the pass finished: the copies must start
        after the work on the engine's current stream (vLLM's own offloader
        waits for it too).  CUDA: kvtier orders its copy streams after that
        stream on the GPU; a backend that cannot (hsa) gets the stream
        synchronized on the host instead.  A CPU cache: nothing runs behind
        the caller's back."""
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
        for ld in meta.loads:
            t0 = time.perf_counter()
            try:
                op = self._tier.load(ld.lease, _tables(ld.block_ids), n=ld.n_chunks)
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
        self._order_saves()
        for sv in meta.saves:
            keys = np.frombuffer(sv.keys, dtype="<u8").reshape(-1, 2)
            if self._s.async_io:
                self._save_rids.add(sv.req_id)
            try:
                op = self._tier.save(np.ascontiguousarray(keys), _tables(sv.block_ids),
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

    def get_block_ids_with_load_errors(self):
        bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def shutdown(self):
        if self._tier is not None and self._role == KVConnectorRole.WORKER:
            for op, _, _ in self._loads.values():
                try:
                    op.wait()
                except kvtier.KvtierError:
                    pass
            for ops in self._saves.values():
                for op in ops:
                    self._finish_save(op, wait=True)
            self._loads.clear()
            self._saves.clear()
        if self._tier is not None:
            self._tier.close()
            self._tier = None


def _tables(block_ids):
    """Per-group block id lists -> what Tier.load/save take: one table for
    one group, a list of tables for several."""
    tabs = [np.asarray(b, dtype=np.uint32) for b in block_ids]
    return tabs[0] if len(tabs) == 1 else tabs


def _halves(t, num_blocks, page, half, name):
    """The two halves of each block of layer tensor t: (base, stride) of
    each, as kvtier layers of half-block bytes."""
    es = t.element_size()
    dims = [d for d in range(t.dim()) if t.shape[d] == num_blocks]
    if not dims:
        raise ValueError("kvtier: layer %s: no dimension of its KV tensor %s has the %d "
                         "blocks" % (name, tuple(t.shape), num_blocks))
    d = dims[0]
    if d == 0:
        # [num_blocks, ...]: a block is the rest, contiguous
        if t[0].numel() * es != page or not t[0].is_contiguous():
            raise ValueError("kvtier: layer %s: a block of %s is not %d contiguous bytes"
                             % (name, tuple(t.shape), page))
        stride = t.stride(0) * es
        return [(t.data_ptr(), stride), (t.data_ptr() + half, stride)]
    if d == 1 and t.shape[0] == 2:
        # [2, num_blocks, ...]: K and V apart
        out = []
        for kv in (0, 1):
            sub = t[kv]
            if sub[0].numel() * es != half or not sub[0].is_contiguous():
                raise ValueError("kvtier: layer %s: K/V block of %s is not %d contiguous "
                                 "bytes" % (name, tuple(t.shape), half))
            out.append((sub.data_ptr(), sub.stride(0) * es))
        return out
    raise ValueError("kvtier: layer %s: KV tensor layout %s (blocks on dimension %d) is not "
                     "supported" % (name, tuple(t.shape), d))
