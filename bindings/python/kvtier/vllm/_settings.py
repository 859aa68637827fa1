"""kvtier.vllm._settings: the engine's identity and the connector's
settings, from vLLM's configuration and kv_connector_extra_config."""
import errno
import os
import re

import kvtier
from kvtier._connect import as_bool, open_segment, opt

from ._common import _NON_DETERMINISTIC_ALGOS, logger
from ._caches import Plan, default_chunk_tokens, group_kind


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


def _strip_caches(model):
    """A model identity without its caches field."""
    return re.sub(r";caches=[0-9a-f]+", "", model or "")


def _opt(extra, key, env, default, conv=str):
    return opt(extra, key, env, default, conv, where="kv_connector_extra_config")


_bool = as_bool


SLEEP_REFUSED = (
    "kvtier: vLLM's sleep mode is on (enable_sleep_mode): a sleep discards the KV cache's "
    "contents and the wake-up gives other bytes at the same addresses, so a save still "
    "queued, or one of a block that held a chunk before the sleep, would put those bytes "
    "under the chunk's key -- wrong KV for every engine that loads it.  Run without sleep "
    "mode, or without kvtier")


class _Settings:
    def __init__(self, vllm_config, kv_cache_config):
        extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
        # vLLM 0.33 and later ask KvtierConnector.supports_sleep_mode first
        if getattr(getattr(vllm_config, "model_config", None), "enable_sleep_mode", False):
            raise ValueError(SLEEP_REFUSED)
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
        # vLLM's block size (the prefix cache's hash block); a model whose
        # KV cache groups have other block sizes (DeepSeek V4) has chunks
        # that cover a whole block of each (_caches.py)
        self.block_size = cache.block_size
        self.chunk_tokens = _opt(extra, "kvtier_chunk_tokens", "KVTIER_CHUNK_TOKENS",
                                 default_chunk_tokens(kv_cache_config, self.block_size), int)
        if self.chunk_tokens <= 0 or self.chunk_tokens % self.block_size:
            raise ValueError("kvtier: chunk_tokens=%d must be a positive multiple of vLLM's "
                             "block size (%d)" % (self.chunk_tokens, self.block_size))
        self.blocks_per_chunk = self.chunk_tokens // self.block_size
        # vLLM's block hashes, of which a chunk's key is its last one's: one
        # per hash block (the engine core's, with HMA the groups' common
        # divisor)
        self.hash_block = getattr(kv_cache_config, "hash_block_size", None) or self.block_size
        if self.chunk_tokens % self.hash_block:
            raise ValueError("kvtier: chunk_tokens=%d must be a multiple of vLLM's prefix-cache "
                             "hash block (%d tokens)" % (self.chunk_tokens, self.hash_block))
        self.hashes_per_chunk = self.chunk_tokens // self.hash_block
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
        layout = getattr(kv_cache_config, "kv_cache_layout", None) or \
            getattr(cache, "kv_cache_layout", None)
        self.layout = str(getattr(layout, "name", layout))
        engine = _engine_identity(mc, cache, kv_cache_config)
        self.plan = Plan(kv_cache_config, self.layout, self.chunk_tokens)
        self.groups, self.replicated = self.plan.groups, self.plan.replicated
        self.windows = self.plan.windows
        # every cache's shape and dtype, where the plain fields do not say
        if self.plan.caches:
            engine += ";caches=%s" % self.plan.caches
        self.model_engine = name + engine + _key_identity(self.prefix_caching, self.hash_algo)
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
        try:
            return open_segment(kw, self.create, self.instances, self.tier_gib)
        except kvtier.KvtierError as e:
            if role != "scheduler" or e.errno != errno.ESTALE or not self.plan.special:
                raise
            return self._adopt(kw, e)

    def _adopt(self, kw, refused):
        """The scheduler of a model whose caches it sees only in part:
        vLLM gives the scheduler one spec per KV cache group, the first
        layer's, so its geometry and caches field can differ from the
        ranks' (which describe every cache, and create the segment: vLLM
        starts the workers' connectors first).  It attaches without a
        layout, and the segment must be this engine's in everything but
        those: the same identity without its caches field, the same world
        and chunk size.  Otherwise the refusal stands."""
        kw = dict(kw, groups=None)
        t = kvtier.Tier(**kw)
        try:
            theirs = t.segment_model
            st = t.stats()
            mine = _strip_caches(self.model)
            if _strip_caches(theirs) != mine or st.get("world") != self.world or \
                    st.get("chunk_tokens") != self.chunk_tokens:
                raise refused
        except BaseException:
            t.close()
            raise
        logger.info("kvtier: the scheduler joined segment '%s' of its ranks (its KV caches: "
                    "%s)", self.segment, theirs)
        return t


_group_kind = group_kind
