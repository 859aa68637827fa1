"""The README's GPU vLLM command, checked where it cannot run: vLLM's own
OpenAI-server argument parser takes every option it passes, and its KV
transfer config names this connector as the CPU command's does (the CPU
command runs: test_vllm_kvtier.py::test_openai_server)."""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "readme"))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(HERE)), "bindings", "python"))
import readme_blocks as rb  # noqa: E402


def test_gpu_vllm_command_parses():
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    env, argv = rb.command(rb.block("vllm serve "))
    assert argv[:2] == ["vllm", "serve"]
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(
        ["--model", argv[2]] + argv[3:])
    assert args.tensor_parallel_size == 4
    cfg = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    _, cpu = rb.command(rb.block("VLLM_SERVER_DEV_MODE=1"))
    cpu_cfg = json.loads(cpu[cpu.index("--kv-transfer-config") + 1])
    keys = ("kv_connector", "kv_connector_module_path", "kv_role")
    assert {k: cfg[k] for k in keys} == {k: cpu_cfg[k] for k in keys}
    # every extra key one the connector reads
    import kvtier.vllm as kv  # noqa: F401  (the connector imports with this vLLM)
    pkg = os.path.dirname(kv.__file__)   # the package's modules
    src = "".join(open(os.path.join(pkg, f)).read() for f in os.listdir(pkg) if f.endswith(".py"))
    for k in cfg["kv_connector_extra_config"]:
        assert '"%s"' % k in src, k
