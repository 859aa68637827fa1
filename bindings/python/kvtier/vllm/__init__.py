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

Only whole chunks are saved; a chunk is chunk_tokens (a multiple of every
KV cache group's block size, default: the largest -- one vLLM block for
models of one block size). vLLM's own prefix-cache hits are whole
blocks, so with larger chunks a local hit may end inside one: the lookup
then starts at that chunk, vLLM is told the tokens after its own hit, and
the load skips the chunk's blocks vLLM already has (KVT_BLOCK_SKIP).

Which KV a chunk holds, per KV cache group type.  kvtier stores a chunk
only when every block of it that kvtier keeps, in every group, holds KV
that vLLM computed for this prefix, and loads a chunk only into blocks vLLM
gave the request to be written.  vLLM's block tables say which: block id 0
is its null block, the stand-in for a block a group does not keep.  The
connector is SupportsHMA: vLLM keeps its hybrid KV cache manager on, with
a block table per group (full and sliding-window layers of one model in
groups of their own, DeepSeek V4's five groups of four block sizes), and
every cache of every group goes in the chunk (_caches.py: how groups of
several page and block sizes become kvtier groups).  Per group type
(kv_cache_interface.py):

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
    saved only in the step it becomes full, and only when the blocks kvtier
    keeps of it are at or past skipped(n) and none is the null block: its
    KV is in its blocks until the step ends, and no save runs past the next
    step's start (see above).  Of a sliding window kvtier keeps the tail a
    hit ending at the chunk's end needs (_caches.py), always the request's
    in the step the chunk fills; where the window is longer than a chunk
    it keeps every block, and chunks that fell out of the window before
    they were full, or were a local hit's null blocks, are never saved: the
    tier then holds a prefix with a hole, and lookups stop at the hole (a
    shorter hit, never a wrong one).  A load writes the kept blocks vLLM
    gave the request and skips the null ones (KVT_BLOCK_SKIP): those tokens
    are never attended; a real block where kvtier keeps none fails the load
    (vLLM recomputes).
  * anything else (Mamba/SSM state, cross-attention, encoder-only, sink
    and reversed-window attention, circular buffers, HiSparse): no chunk of
    it could be exact, so the connector refuses the model at start with
    the group named.

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

Layouts.  Whichever KV cache layout vLLM resolved (the connector asks
for none): a layer's block is described as the runs that layout makes
of it -- its two halves where it is one run, one run per KV head in the
head-outer layouts ROCm's native backends want (LHBNC, BHLNC) -- from
vLLM's own stride function, and each worker checks its tensors against
that (_layout.py).

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

# The package's parts: _versions (the tested vLLM releases and what differs
# between them), _common (vLLM's classes, the logger), _settings (identity,
# settings), _layout (a layer's blocks in each KV cache layout), _metadata
# (scheduler -> workers, stats), _scheduler and
# _worker (the two sides), _connector (the class vLLM makes).  The module
# path users give, "kvtier.vllm", names this package.
import kvtier  # noqa: F401  (kvtier.vllm.kvtier: the binding, for tests)

from ._versions import VLLM_VERSIONS  # noqa: F401
from ._common import logger  # noqa: F401
from ._metadata import (STATS, KvtierConnectorMetadata, KvtierConnectorStats,  # noqa: F401
                        KvtierPromMetrics, _Load, _Save)
from ._settings import (_Settings, _engine_identity, _group_kind, _key_identity,  # noqa: F401
                        _kv_format, _model_config_file)
from ._scheduler import _chunk_keys_from_hashes, _skipped_tokens  # noqa: F401
from ._layout import block_runs, pieces_per_block  # noqa: F401
from ._worker import _tables  # noqa: F401
from ._connector import KvtierConnector  # noqa: F401
