"""A real vLLM engine (the CPU build) with LMCache's own connector,
LMCacheMPConnector from the pinned lmcache wheel, served by kvtierd's
LMCache front end instead of `lmcache server`: nothing of kvtier in the
engine's process.  vLLM's CPU tensors make LMCache's client use the
lmcache_driven transfers with cpu_shm descriptors (set in
kv_connector_extra_config: its CPU default is the engine-driven pool,
which kvtierd refuses by name).

The wheel is installed without its dependencies into a folder beside the
vLLM environment (tests/lmcache/setup-engine.sh; vLLM's environment has all
the client imports but sortedcontainers), put first on the engine's
PYTHONPATH.  Run by scripts/test.sh after the vLLM 0.32 environment is
made; the comparisons follow test_vllm_kvtier.py's rules (a model shown to
follow its context, and the tier's chunks overwritten with noise change the
output)."""

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from test_vllm_kvtier import (  # noqa: E402
    LONG, OTHERS, SHORT, Engine, changed, corrupt_arena, model, model_dir, sensitive, start_all)

_ = (model, model_dir)  # the fixtures, from test_vllm_kvtier
BUILD = os.environ.get("KVTIER_BUILD", os.path.join(REPO, "build"))
KVTIERD = os.path.join(BUILD, "tier", "daemon", "kvtierd")
TARGET = os.environ.get("KVTIER_VLLM_LMCACHE", os.path.join(BUILD, "vllm-lmcache"))
# the tiny llama's vLLM CPU cache, per layer [blocks, 2 KV heads, 32, 2 x 64]
# bf16: one plane a layer of 2 x 2 x 64 x 2 = 512 bytes a token
GROUP = "2:512"
CHUNK = 64            # LMCache's chunk: two vLLM blocks of 32


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Kvtierd:
    def __init__(self, name):
        self.name, self.port, self.http = name, free_port(), free_port()
        self.logf = tempfile.NamedTemporaryFile(prefix="kvtierd-lmc-", suffix=".log",
                                                delete=False)
        self.p = subprocess.Popen(
            [KVTIERD, "--segment", name, "--group", GROUP, "--world", "1", "--instances", "3",
             "--chunk-tokens", str(CHUNK), "--slots", "256", "--model", "lmcache-engines",
             "--http", "127.0.0.1:%d" % self.http, "--log", self.logf.name, "--lmcache-port",
             str(self.port), "--unlink", "--recreate"],
            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        end = time.monotonic() + 60
        while self.get("/healthcheck")[0] != 200:
            assert self.p.poll() is None and time.monotonic() < end, self.log()
            time.sleep(0.1)

    def get(self, path):
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.http, path),
                                        timeout=5) as r:
                return r.status, r.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name):
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise AssertionError("no %s in kvtierd's /metrics" % name)

    def log(self):
        with open(self.logf.name) as f:
            return f.read()

    def close(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            self.p.wait(timeout=60)
        if not os.environ.get("KVTIER_TEST_KEEP_LOGS"):
            os.unlink(self.logf.name)


def transfer(port):
    """The README's kv-transfer-config for LMCacheMPConnector (its
    LMCACHE='...' block), the port this test's kvtierd's."""
    sys.path.insert(0, os.path.join(REPO, "tests", "readme"))
    import json

    import readme_blocks as rb
    b = rb.block("LMCACHE='")
    c = json.loads(b.split("'")[1])
    assert c["kv_connector_extra_config"]["lmcache.mp.port"] == 8750, c
    c["kv_connector_extra_config"]["lmcache.mp.port"] = port
    return c


def lmcache_env():
    assert os.path.isdir(os.path.join(TARGET, "lmcache")), \
        "tests/lmcache/setup-engine.sh installs LMCache's wheel at %s" % TARGET
    return {"PYTHONPATH": TARGET, "DO_NOT_TRACK": "1", "LMCACHE_TRACK_USAGE": "false"}


def test_lmcache_mp_connector_served_by_kvtierd(model):
    """Engine 1 (LMCacheMPConnector) gives the baseline's outputs and
    stores its prompts' chunks in kvtierd; engine 2, another process,
    gets the long prompt's chunks back from kvtierd (vLLM counts them as
    external prefix-cache hits) and gives the baseline's output; with the
    tier's chunks overwritten with noise, the same load changes it."""
    d = Kvtierd("vllm-lmc-%d" % os.getpid())
    engines = []
    try:
        base = Engine(model, None, expect_ready=False)
        e1 = Engine(model, transfer=transfer(d.port), env=lmcache_env(), expect_ready=False)
        engines += [base, e1]
        start_all(base, e1)
        assert "Using external LMCacheMPConnector from lmcache" in e1.tail(2000)
        want = sensitive(base, LONG, changed(LONG, 900, 1100, 41))
        base_short = base.generate(SHORT)
        assert e1.generate(SHORT + [LONG]) == base_short + [want]
        # LMCache's connector stores after the step's forward and reports
        # the stores done later: wait for every full chunk of the prompts
        n = sum(len(p) // CHUNK for p in SHORT + [LONG])
        end = time.monotonic() + 120
        while d.metric("kvtier_saved_chunks_total") < n:
            assert time.monotonic() < end, (d.metric("kvtier_saved_chunks_total"), n, d.log())
            time.sleep(0.1)

        e2 = Engine(model, transfer=transfer(d.port), env=lmcache_env())
        engines.append(e2)
        h0, m0 = d.metric("kvtier_hit_tokens_total"), e2.metrics()
        r0, x0 = d.metric("kvtier_lmcache_retrieved_total"), d.metric("kvtier_lmcache_misses_total")
        got = e2.generate([LONG])
        # the README's policy recomputes a failed load: the output alone
        # cannot say the chunks came from the tier; kvtierd's counters do
        why = (got, d.log()[-4000:], e2.tail(80))
        assert got == [want], why
        assert d.metric("kvtier_lmcache_misses_total") == x0, why
        assert d.metric("kvtier_lmcache_retrieved_total") - r0 >= len(LONG) // CHUNK - 1, why
        ext = e2.metrics().get("vllm:external_prefix_cache_hits", 0) - \
            m0.get("vllm:external_prefix_cache_hits", 0)
        hit = d.metric("kvtier_hit_tokens_total") - h0
        assert ext >= (len(LONG) // CHUNK - 1) * CHUNK, (ext, hit)
        assert hit >= ext, (hit, ext)

        # the self-test: engine 2's own prefix cache evicted (64 blocks of
        # 32 tokens hold one prompt), the tier's chunks overwritten
        for p in OTHERS:
            e2.generate([p])
        assert corrupt_arena(d.name) > 0
        m1, r1 = e2.metrics(), d.metric("kvtier_lmcache_retrieved_total")
        got = e2.generate([LONG])
        assert d.metric("kvtier_lmcache_retrieved_total") - r1 >= len(LONG) // CHUNK - 1
        ext = e2.metrics().get("vllm:external_prefix_cache_hits", 0) - \
            m1.get("vllm:external_prefix_cache_hits", 0)
        assert ext >= (len(LONG) // CHUNK - 1) * CHUNK, ext     # loaded from the tier...
        assert got != [want], "noise in the KV did not change the output"   # ...and seen
    finally:
        for e in engines:
            e.close()
        d.close()
