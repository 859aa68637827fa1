"""kvtier.vllm._common: what every part of the connector shares -- vLLM's
base classes (after the version check), the logger, the plugin's
registration in this process, vLLM's KV-connector stats classes."""
try:
    import vllm
except ImportError as e:  # pragma: no cover
    raise ImportError("kvtier.vllm needs vLLM installed: %s" % e) from None

from ._versions import check

check(vllm.__version__)

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402,F401
    KVConnectorBase_V1, KVConnectorMetadata, KVConnectorRole, KVConnectorTransferResults)
from vllm.logger import init_logger  # noqa: E402

try:  # the hybrid KV cache manager's connector interface (vLLM 0.31 and later)
    from vllm.distributed.kv_transfer.kv_connector.v1.base import SupportsHMA  # noqa: E402
except ImportError:  # pragma: no cover
    class SupportsHMA:  # noqa: D101
        pass

# Under vLLM's own logger ("vllm"), so that the lines reach vLLM's handlers
# and level (VLLM_LOGGING_LEVEL, VLLM_LOGGING_CONFIG_PATH); a logger named
# after this module ("kvtier.vllm") would be outside vLLM's configuration
# and its INFO lines would be dropped.
logger = init_logger("vllm.kvtier")

# The name in vLLM's connector factory, also when the plugin (vllm_plugin.py,
# installed with the package) did not run in this process.
from .. import vllm_plugin as _plugin  # noqa: E402

_plugin.register()

try:  # vLLM's KV-connector stats (its log lines and its /metrics)
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (  # noqa: E402
        KVConnectorPromMetrics, KVConnectorStats)
except ImportError:  # pragma: no cover
    KVConnectorStats = KVConnectorPromMetrics = None

_NON_DETERMINISTIC_ALGOS = ("xxhash", "xxhash_cbor")
