"""kvtier.vllm._metadata: what the scheduler hands the workers each step,
and kvtier's stats through vLLM's."""
from dataclasses import dataclass, field

from ._common import KVConnectorMetadata, KVConnectorPromMetrics, KVConnectorStats


# ---- metadata (scheduler -> workers, once per step) ----

@dataclass
class _Load:
    req_id: str
    lease: int
    n_chunks: int
    block_ids: list      # one list per KV cache group; BLOCK_SKIP: leave it
    is_async: bool = False  # the request waits in WAITING_FOR_REMOTE_KVS
    error: str = ""      # why it cannot be exact: lease released, reported failed


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
