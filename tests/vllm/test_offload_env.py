"""KVTIER_OFFLOAD / KVTIER_OFFLOAD_CONFIG (kvtier.vllm_offload): every row
of the fold table, against vLLM's own KVTransferConfig, and each child
built the way vLLM's MultiConnector builds it; the values, any case; the
errors, each naming its variable.  The engine started this way:
test_vllm_kvtier.py::test_offload_by_environment."""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bindings", "python"))

from vllm.config import KVTransferConfig  # noqa: E402

from kvtier import vllm_offload as vo  # noqa: E402

MINE = {"kvtier_segment": "kvtier", "kvtier_tier_gib": 1}


def children(cfg):
    """The children as vLLM's MultiConnector makes them."""
    assert cfg.kv_connector == "MultiConnector"
    return [KVTransferConfig(**c, engine_id=c.get("engine_id", cfg.engine_id))
            for c in cfg.kv_connector_extra_config["connectors"]]


@pytest.mark.parametrize("value", ["1", "on", "ON", "On", "true", "TRUE", "yes", " Yes "])
def test_on_values(value):
    assert vo.requested({"KVTIER_OFFLOAD": value}) == {}


@pytest.mark.parametrize("value", [None, "", "0", "off", "OFF", "false", "No"])
def test_off_values(value):
    env = {} if value is None else {"KVTIER_OFFLOAD": value}
    env["KVTIER_OFFLOAD_CONFIG"] = '{"kvtier_segment": "x"}'   # ignored while off
    assert vo.requested(env) is None


@pytest.mark.parametrize("env, var", [
    ({"KVTIER_OFFLOAD": "maybe"}, "KVTIER_OFFLOAD="),
    ({"KVTIER_OFFLOAD": "lmcache"}, "KVTIER_OFFLOAD="),
    ({"KVTIER_OFFLOAD": "on", "KVTIER_OFFLOAD_CONFIG": "{kvtier_segment: x}"},
     "KVTIER_OFFLOAD_CONFIG is not JSON"),
    ({"KVTIER_OFFLOAD": "on", "KVTIER_OFFLOAD_CONFIG": "[1, 2]"},
     "KVTIER_OFFLOAD_CONFIG must be a JSON object"),
    ({"KVTIER_OFFLOAD": "on", "KVTIER_OFFLOAD_CONFIG": '"kvtier"'},
     "KVTIER_OFFLOAD_CONFIG must be a JSON object"),
])
def test_bad_values(env, var):
    with pytest.raises(vo.OffloadConfigError) as e:
        vo.requested(env)
    assert var in str(e.value)


def test_config():
    env = {"KVTIER_OFFLOAD": "on", "KVTIER_OFFLOAD_CONFIG": ' {"kvtier_segment": "s"} '}
    assert vo.requested(env) == {"kvtier_segment": "s"}


def test_no_config_written():
    cfg = vo.fold(None, MINE, KVTransferConfig)
    assert cfg.kv_connector == "KvtierConnector" and cfg.kv_role == "kv_both"
    assert cfg.kv_connector_extra_config == MINE


def test_another_connector_becomes_a_multi_of_both():
    pd = KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer",
                          kv_port=15000, kv_load_failure_policy="recompute",
                          kv_connector_extra_config={"backends": ["UCX"]})
    cfg = vo.fold(pd, MINE, KVTransferConfig)
    # the outer config keeps the launcher's fields: its role, its engine id
    assert cfg.kv_connector == "MultiConnector" and cfg.kv_role == "kv_producer"
    assert cfg.engine_id == pd.engine_id and cfg.kv_port == 15000
    first, second = children(cfg)
    assert first.kv_connector == "KvtierConnector" and first.kv_role == "kv_both"
    assert first.kv_connector_extra_config == MINE
    assert second.kv_connector == "NixlConnector" and second.kv_role == "kv_producer"
    assert second.kv_port == 15000 and second.kv_load_failure_policy == "recompute"
    assert second.kv_connector_extra_config == {"backends": ["UCX"]}
    assert "MultiConnector [KvtierConnector (kv_both), NixlConnector (kv_producer)]" in \
        vo.describe(cfg)


def test_module_path_connector_keeps_its_path():
    own = KVTransferConfig(kv_connector="TheirConnector", kv_role="kv_consumer",
                           kv_connector_module_path="their.module")
    _, second = children(vo.fold(own, MINE, KVTransferConfig))
    assert second.kv_connector_module_path == "their.module"
    assert second.kv_role == "kv_consumer"


def test_a_multi_gets_kvtier_first():
    multi = KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                             kv_connector_extra_config={"connectors": [
                                 {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
                                 {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                                  "kv_connector_extra_config": {"shared_storage_path": "/x"}}],
                                 "other": 1})
    cfg = vo.fold(multi, MINE, KVTransferConfig)
    names = [c.kv_connector for c in children(cfg)]
    assert names == ["KvtierConnector", "NixlConnector", "ExampleConnector"]
    assert cfg.kv_connector_extra_config["other"] == 1
    # the launcher's own object is not changed
    assert len(multi.kv_connector_extra_config["connectors"]) == 2


@pytest.mark.parametrize("cfg", [
    KVTransferConfig(kv_connector="KvtierConnector", kv_role="kv_both"),
    KVTransferConfig(kv_connector="Custom", kv_role="kv_both",
                     kv_connector_module_path="kvtier.vllm"),
    KVTransferConfig(kv_connector="MultiConnector", kv_role="kv_both",
                     kv_connector_extra_config={"connectors": [
                         {"kv_connector": "KvtierConnector", "kv_role": "kv_both"}]}),
])
def test_naming_kvtier_already_is_an_error(cfg):
    with pytest.raises(vo.OffloadConfigError) as e:
        vo.fold(cfg, MINE, KVTransferConfig)
    assert "KVTIER_OFFLOAD is on" in str(e.value) and "twice" in str(e.value)


def test_install_folds_once_and_logs():
    class Args:
        def __init__(self, cfg):
            self.kv_transfer_config = cfg

        def create_engine_config(self):
            return self.kv_transfer_config

    lines = []
    vo.install(Args, KVTransferConfig, lines.append)
    vo.install(Args, KVTransferConfig, lines.append)      # idempotent: wrapped once
    old = os.environ.get("KVTIER_OFFLOAD")
    os.environ["KVTIER_OFFLOAD"] = "on"
    try:
        a = Args(KVTransferConfig(kv_connector="ExampleConnector", kv_role="kv_both"))
        first = a.create_engine_config()
        again = a.create_engine_config()                  # folded once per EngineArgs
        assert [c.kv_connector for c in children(first)] == ["KvtierConnector",
                                                              "ExampleConnector"]
        assert again is first and len(lines) == 1, lines
        assert "ExampleConnector (kv_role kv_both) -> MultiConnector" in lines[0]
        os.environ["KVTIER_OFFLOAD"] = "off"
        b = Args(None)
        assert b.create_engine_config() is None and len(lines) == 1
    finally:
        if old is None:
            os.environ.pop("KVTIER_OFFLOAD", None)
        else:
            os.environ["KVTIER_OFFLOAD"] = old


def test_readme_block():
    """The README's environment block, as a shell would set it, asks for
    kvtier with a config the connector takes (its keys are kvtier_*)."""
    import shlex
    sys.path.insert(0, os.path.join(HERE, "..", "readme"))
    import readme_blocks as rb
    env = {}
    for line in rb.block("export KVTIER_OFFLOAD=on").splitlines():
        words = shlex.split(line)
        assert words[0] == "export", line
        k, v = words[1].split("=", 1)
        env[k] = v
    extra = vo.requested(env)
    assert extra and all(k.startswith("kvtier_") for k in extra), extra
    cfg = vo.fold(KVTransferConfig(kv_connector="NixlConnector", kv_role="kv_producer"),
                  extra, KVTransferConfig)
    assert vo.describe(cfg) == ("MultiConnector [KvtierConnector (kv_both), NixlConnector "
                                "(kv_producer)] (kv_role kv_producer)")
