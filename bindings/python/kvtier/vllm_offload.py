"""kvtier.vllm_offload - kvtier added to a vLLM engine by environment, for
launchers that write --kv-transfer-config themselves (a prefill/decode
connector for their workers) and leave no way to add a second connector.

  KVTIER_OFFLOAD         on | off (also 1/0, true/false, yes/no; any case;
                         unset or empty: off)
  KVTIER_OFFLOAD_CONFIG  a JSON object: kvtier's kv_connector_extra_config
                         ({"kvtier_segment": "kvtier", ...}); default {}

With KVTIER_OFFLOAD on, the kv_transfer_config the launcher wrote becomes:

  none                          kvtier alone (kv_both)
  another connector X           MultiConnector [kvtier, X]: the outer config
                                keeps X's fields (its kv_role, engine_id,
                                ...), X's child entry all of X's settings
  a MultiConnector              kvtier inserted first among its children
  one that names kvtier already an error: kvtier would run twice
                                (KvtierConnector, or kvtier.vllm as a module
                                path, at the top or as a child)

kvtier goes first: vLLM's MultiConnector asks its children for external
hits in order and takes the first that has them, so a local DRAM hit
wins over a remote transfer.  A bad value, a config that is not a JSON
object, or one that names kvtier already stops the engine with an error
that names the variable.  Without KVTIER_OFFLOAD, nothing changes (and
KVTIER_OFFLOAD_CONFIG alone is ignored).

The same environment reaches every process of a launcher; only the one
that builds the engine's configuration folds (vllm_plugin wraps
EngineArgs.create_engine_config), and the engine core and the workers get
the folded config with the rest of vLLM's.  The result is logged.
Modelled on AMD ATOM's ATOM_KV_OFFLOAD / ATOM_KV_OFFLOAD_EXTRA_CONFIG.
"""
import dataclasses
import json
import os

CONNECTOR = "KvtierConnector"
MODULE = "kvtier.vllm"
ON = ("1", "on", "true", "yes")
OFF = ("", "0", "off", "false", "no")


class OffloadConfigError(ValueError):
    pass


def requested(environ=None):
    """kvtier's extra config when KVTIER_OFFLOAD asks for kvtier, else None.
    Raises OffloadConfigError naming the variable at fault."""
    env = os.environ if environ is None else environ
    v = env.get("KVTIER_OFFLOAD", "").strip().lower()
    if v in OFF:
        return None
    if v not in ON:
        raise OffloadConfigError("KVTIER_OFFLOAD=%r: on or off (1/0, true/false, yes/no)"
                                 % env.get("KVTIER_OFFLOAD"))
    text = env.get("KVTIER_OFFLOAD_CONFIG", "").strip()
    if not text:
        return {}
    try:
        extra = json.loads(text)
    except ValueError as e:
        raise OffloadConfigError("KVTIER_OFFLOAD_CONFIG is not JSON (%s): %r" % (e, text[:200]))
    if not isinstance(extra, dict):
        raise OffloadConfigError("KVTIER_OFFLOAD_CONFIG must be a JSON object (kvtier's "
                                 "kv_connector_extra_config), not %s" % type(extra).__name__)
    return extra


def _names_kvtier(d):
    return d.get("kv_connector") == CONNECTOR or d.get("kv_connector_module_path") == MODULE


def _fields(cfg):
    """A KVTransferConfig's init fields as a dict (a child entry)."""
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def fold(cfg, extra, make):
    """The kv_transfer_config with kvtier added (the table above): cfg is
    vLLM's KVTransferConfig or None, make the class (KVTransferConfig)."""
    mine = {"kv_connector": CONNECTOR, "kv_role": "kv_both",
            "kv_connector_extra_config": dict(extra)}
    if cfg is None or cfg.kv_connector is None:
        return make(**mine)
    top = _fields(cfg)
    if _names_kvtier(top):
        raise OffloadConfigError("KVTIER_OFFLOAD is on but --kv-transfer-config names kvtier "
                                 "already (%s): it would run twice; unset KVTIER_OFFLOAD or "
                                 "drop it from the config" % cfg.kv_connector)
    if cfg.kv_connector == "MultiConnector":
        extra_top = dict(cfg.kv_connector_extra_config or {})
        children = list(extra_top.get("connectors") or [])
        for c in children:
            if isinstance(c, dict) and _names_kvtier(c):
                raise OffloadConfigError("KVTIER_OFFLOAD is on but the MultiConnector of "
                                         "--kv-transfer-config has kvtier among its "
                                         "connectors already: it would run twice")
        extra_top["connectors"] = [mine] + children
        top["kv_connector_extra_config"] = extra_top
        return make(**top)
    child = {k: v for k, v in top.items() if k != "engine_id"}
    outer = dict(top, kv_connector="MultiConnector", kv_connector_module_path=None,
                 kv_connector_extra_config={"connectors": [mine, child]})
    return make(**outer)


def describe(cfg):
    """One line of the folded config: the connectors in order."""
    if cfg is None:
        return "none"
    if cfg.kv_connector == "MultiConnector":
        kids = (cfg.kv_connector_extra_config or {}).get("connectors") or []
        return "MultiConnector [%s] (kv_role %s)" % (
            ", ".join("%s (%s)" % (c.get("kv_connector"), c.get("kv_role")) for c in kids),
            cfg.kv_role)
    return "%s (kv_role %s)" % (cfg.kv_connector, cfg.kv_role)


def install(engine_args_cls, config_cls, log):
    """Wraps engine_args_cls.create_engine_config (once) so that it folds
    kvtier into the instance's kv_transfer_config first.  The fold is done
    once per EngineArgs; an error raises before vLLM builds anything."""
    orig = engine_args_cls.create_engine_config
    if getattr(orig, "_kvtier_fold", False):
        return

    def create_engine_config(self, *a, **kw):
        extra = requested()
        if extra is not None and not getattr(self, "_kvtier_folded", False):
            before = describe(self.kv_transfer_config)
            self.kv_transfer_config = fold(self.kv_transfer_config, extra, config_cls)
            self._kvtier_folded = True
            log("kvtier: KVTIER_OFFLOAD added kvtier to the engine's kv_transfer_config: "
                "%s -> %s" % (before, describe(self.kv_transfer_config)))
        return orig(self, *a, **kw)

    create_engine_config._kvtier_fold = True
    engine_args_cls.create_engine_config = create_engine_config
