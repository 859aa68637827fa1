"""kvtier.vllm_plugin - vLLM's general plugin for kvtier (entry point
"vllm.general_plugins", installed by `pip install bindings/python`).

vLLM calls register() in every process it starts -- the front end, the
engine core, the workers -- before it builds its configuration.  It names
the connector in vLLM's KVConnectorFactory, so that:

  * "kv_connector": "KvtierConnector" works without kv_connector_module_path;
  * kvtier works inside vLLM's MultiConnector: the front end rebuilds each
    child connector's stats by class name (KVConnectorFactory.
    get_connector_class_by_name), and without the name registered there --
    in a process that never imported kvtier.vllm -- the first stats report
    raised "Connector 'KvtierConnector' is not registered" and stopped the
    engine.

The registration is lazy (a module path: nothing of kvtier or of the
library is loaded until vLLM makes the connector), idempotent, and quiet
when vLLM is absent or too different (then it does nothing).

It also adds kvtier by environment (KVTIER_OFFLOAD, kvtier.vllm_offload):
EngineArgs.create_engine_config is wrapped to fold kvtier into the
kv_transfer_config a launcher wrote, in the process that builds the
engine's configuration.
"""

CONNECTOR = "KvtierConnector"


def register():
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    except ImportError:
        return False
    _offload_by_env()
    registry = getattr(KVConnectorFactory, "_registry", None)
    if isinstance(registry, dict) and CONNECTOR in registry:
        return True
    try:
        KVConnectorFactory.register_connector(CONNECTOR, "kvtier.vllm", CONNECTOR)
    except ValueError:  # registered meanwhile
        pass
    return True


def _offload_by_env():
    try:
        from vllm.config import KVTransferConfig
        from vllm.engine.arg_utils import EngineArgs
        from vllm.logger import init_logger
    except ImportError:
        return
    from kvtier.vllm_offload import install
    install(EngineArgs, KVTransferConfig, init_logger("vllm.kvtier").info)
