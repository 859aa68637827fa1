"""The layout the kvtierd tests give the daemon and their rank processes."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                "bindings", "python", "tests"))
from kvt_testlib import BYTES_PER_TOKEN, CHUNK_TOKENS, N_LAYERS  # noqa: E402,F401
import kvtier  # noqa: E402

WORLD = 2
BLOCK_SIZE = 16
MODEL = "kvtierd-test"


def groups():
    return [kvtier.Group(N_LAYERS, BYTES_PER_TOKEN, BLOCK_SIZE, False)]


def daemon_layout_args(instances=2, slots=64):
    return ["--group", "%d:%d" % (N_LAYERS, BYTES_PER_TOKEN), "--world", str(WORLD),
            "--instances", str(instances), "--chunk-tokens", str(CHUNK_TOKENS),
            "--slots", str(slots), "--model", MODEL]
