"""kvtier.vllm._connector: KvtierConnector, vLLM's KV connector: its
scheduler side (_scheduler.py) and worker side (_worker.py) in one class,
as vLLM makes one object per role."""
import shlex

import kvtier

from ._common import KVConnectorBase_V1, KVConnectorRole, SupportsHMA, logger
from ._metadata import KvtierConnectorStats, KvtierPromMetrics
from ._scheduler import _SchedulerSide
from ._settings import _Settings
from ._worker import _WorkerSide


class KvtierConnector(_SchedulerSide, _WorkerSide, KVConnectorBase_V1, SupportsHMA):
    """SupportsHMA: vLLM keeps its hybrid KV cache manager on with kvtier
    (per-group block tables, sliding windows freed as they move;
    request_finished_all_groups), see _caches.py and the package's design
    comment."""


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

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config=None):
        """No (vLLM 0.33 and later ask, and refuse the configuration with
        this connector named; _Settings refuses it on the releases that do
        not ask): _settings.SLEEP_REFUSED says why."""
        return False

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
