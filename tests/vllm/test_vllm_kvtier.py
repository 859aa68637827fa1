"""kvtier inside a real vLLM engine (vLLM's CPU build, a tiny Llama-shaped
model made here: a config.json and dummy weights, prompts as token ids,
greedy sampling).  Each engine is a process of tests/vllm/engine.py; the
tests read kvtier's counters through the Python binding and vLLM's through
its own metrics.  Run by tests/vllm/run.sh (the README's test command calls
it), with the virtual environment it makes."""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, os.path.join(REPO, "bindings", "python"))
import kvtier  # noqa: E402

START_TIMEOUT = 300
CMD_TIMEOUT = 300
BLOCKS = 64          # vLLM's own KV cache: 64 blocks of 32 tokens = 2,048 tokens
CHUNK = 32           # kvtier chunk = vLLM block


def tokens(n, seed):
    x, out = seed * 7919 + 13, []
    for _ in range(n):
        x = (x * 1103515245 + 12345) & 0x7fffffff
        out.append(3 + x % 1000)
    return out


LONG = tokens(1200, 1)                    # 37 full chunks
OTHERS = [tokens(1100, s) for s in (2, 3, 4)]
SHORT = [tokens(100, 5), tokens(300, 6), tokens(700, 7)]


class Engine:
    def __init__(self, model, kv=None, blocks=BLOCKS, tp=1, env=None, expect_ready=True,
                 max_num_seqs=4, max_model_len=1536):
        opts = {"model": model, "kvtier": kv, "blocks": blocks, "tp": tp,
                "max_num_seqs": max_num_seqs, "max_model_len": max_model_len}
        e = dict(os.environ)
        e["PYTHONPATH"] = os.pathsep.join(
            [os.path.join(REPO, "bindings", "python")] +
            ([e["PYTHONPATH"]] if e.get("PYTHONPATH") else []))
        e.update(env or {})
        self.log = tempfile.NamedTemporaryFile(prefix="vllm-engine-", suffix=".log",
                                               delete=False)
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "engine.py"),
                                   json.dumps(opts)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, stderr=self.log, text=True, env=e,
                                  start_new_session=True)
        if expect_ready:
            r = self._read(START_TIMEOUT, "start")
            assert r.get("ready"), r
            self.pid, self.start_s = r["pid"], r["start_s"]

    def _read(self, timeout, what):
        r, _, _ = select.select([self.p.stdout], [], [], timeout)
        if not r:
            pytest.fail("engine: no answer to %s in %d s; log:\n%s" % (what, timeout, self.tail()))
        line = self.p.stdout.readline()
        if not line:
            pytest.fail("engine exited (%s) during %s; log:\n%s" % (self.p.wait(), what,
                                                                     self.tail()))
        return json.loads(line)

    def tail(self, n=60):
        with open(self.log.name, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def cmd(self, **m):
        self.p.stdin.write(json.dumps(m) + "\n")
        self.p.stdin.flush()
        return self._read(CMD_TIMEOUT, m["cmd"])

    def generate(self, prompts, max_tokens=8):
        return self.cmd(cmd="generate", prompts=prompts, max_tokens=max_tokens)["outputs"]

    def metrics(self):
        return self.cmd(cmd="metrics")

    def kill(self):
        """kill -9 of the whole engine: its front end, engine core and
        workers (one process group).  Only while the leader is unreaped:
        its pid, the group's id, cannot have been reused then."""
        if self.p.returncode is not None or self.p.pid <= 1:
            return
        try:
            os.killpg(self.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.p.wait()

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.write('{"cmd": "exit"}\n')
                self.p.stdin.flush()
                self.p.wait(timeout=60)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()
        if not os.environ.get("KVTIER_TEST_KEEP_LOGS"):
            os.unlink(self.log.name)


@pytest.fixture(scope="module")
def model():
    d = tempfile.mkdtemp(prefix="kvtier-tiny-llama-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
                   "vocab_size": 1024, "max_position_embeddings": 1536, "rms_norm_eps": 1e-5,
                   "rope_theta": 10000.0, "torch_dtype": "bfloat16",
                   "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2}, f)
    yield d


@pytest.fixture(scope="module")
def segment():
    name = "vllm-test-%d" % os.getpid()
    kvtier.unlink(name) if _exists(name) else None
    yield name
    if _exists(name):
        kvtier.unlink(name)


def _exists(name):
    try:
        kvtier.unlink  # noqa: B018
        with kvtier.Tier(segment=name, role="client"):
            return True
    except kvtier.KvtierError:
        return False


def kv(segment, instance=0, **more):
    c = {"kvtier_segment": segment, "kvtier_instance": instance, "kvtier_instances": 2,
         "kvtier_tier_gib": 0.25}
    c.update(more)
    return c


def stats(segment):
    with kvtier.Tier(segment=segment, role="client") as t:
        return t.stats()


@pytest.fixture(scope="module")
def engines(model, segment):
    """The baseline (no kvtier) and engine 1 (kvtier, instance 0), started
    together."""
    started = {}
    try:
        started["base"] = Engine(model, None, expect_ready=False)
        started["e1"] = Engine(model, kv(segment, 0), expect_ready=False)
        for e in started.values():
            r = e._read(START_TIMEOUT, "start")
            assert r.get("ready"), r
            e.pid, e.start_s = r["pid"], r["start_s"]
        yield started
    finally:
        for e in started.values():
            e.close()


def test_outputs_identical(engines):
    """Outputs with kvtier are the baseline's, token for token."""
    base = engines["base"].generate(SHORT + [LONG])
    assert engines["e1"].generate(SHORT + [LONG]) == base
    engines["base"].outputs = dict(zip(map(tuple, SHORT + [LONG]), base))


def test_evicted_prefix_is_loaded_from_kvtier(engines, segment):
    """The long prompt, then enough others to push it out of vLLM's own
    prefix cache, then the long prompt again: its prefix comes from kvtier
    (vLLM's external-prefix-cache counter and kvtier's hit tokens agree)."""
    e1, base = engines["e1"], engines["base"]
    want = base.outputs[tuple(LONG)]
    for p in OTHERS:
        e1.generate([p])
    s0, m0 = stats(segment), e1.metrics()
    assert e1.generate([LONG]) == [want]
    s1, m1 = stats(segment), e1.metrics()
    hit = s1["hit_tokens"] - s0["hit_tokens"]
    ext = m1.get("vllm:external_prefix_cache_hits", 0) - m0.get("vllm:external_prefix_cache_hits", 0)
    local = m1.get("vllm:prefix_cache_hits", 0) - m0.get("vllm:prefix_cache_hits", 0)
    assert hit >= 32 * CHUNK, (hit, local)       # most of its 37 chunks came back from kvtier
    assert ext == hit, ("vLLM external hits", ext, "kvtier hit tokens", hit)
    assert local + ext >= (len(LONG) - 1) // CHUNK * CHUNK
    assert s1["loaded_chunks"] - s0["loaded_chunks"] == hit // CHUNK
    assert s1["leases_live"] == 0 and s1["slots_pinned"] == 0


def test_second_engine_is_served_what_the_first_saved(engines, model, segment):
    """Another vLLM engine process (instance 1) on the same segment: its
    first request for a prompt engine 1 ran is loaded from kvtier."""
    e2 = Engine(model, kv(segment, 1))
    try:
        s0 = stats(segment)
        out = e2.generate([OTHERS[2]])
        s1 = stats(segment)
        assert out == engines["base"].generate([OTHERS[2]])
        assert s1["hit_tokens"] - s0["hit_tokens"] >= (len(OTHERS[2]) - 1) // CHUNK * CHUNK - CHUNK
        m = e2.metrics()
        assert m.get("vllm:external_prefix_cache_hits", 0) == s1["hit_tokens"] - s0["hit_tokens"]
    finally:
        e2.close()


def test_aborted_and_preempted_requests_leave_no_pin(engines, segment):
    e1 = engines["e1"]
    m0 = e1.metrics()
    # four long requests decoding at once overflow the 2,048-token cache:
    # vLLM preempts some of them
    outs = e1.generate([LONG[:900]] + [tokens(900, s) for s in (8, 9, 10)], max_tokens=120)
    assert len(outs) == 4
    m1 = e1.metrics()
    assert m1.get("vllm:num_preemptions", 0) > m0.get("vllm:num_preemptions", 0), \
        "the scenario did not preempt (vLLM's counter)"
    # aborted right after their lookups and first steps
    e1.cmd(cmd="abort", prompts=[LONG, OTHERS[0], OTHERS[1]], steps=2)
    st = stats(segment)
    assert st["leases_live"] == 0, st
    assert st["slots_pinned"] == 0, st


def test_restarted_engine_is_served_from_the_tier(engines, model, segment):
    """kill -9 of engine 1; a new engine in its place gets its first
    request from the segment, which outlived it."""
    engines["e1"].kill()
    e1b = Engine(model, kv(segment, 0))
    try:
        s0 = stats(segment)
        assert e1b.generate([LONG]) == [engines["base"].outputs[tuple(LONG)]]
        s1 = stats(segment)
        assert s1["hit_tokens"] - s0["hit_tokens"] >= 32 * CHUNK
        assert s1["reaped_ranks"] >= 1 or s0["reaped_ranks"] >= 1
        assert s1["leases_live"] == 0 and s1["slots_pinned"] == 0
    finally:
        e1b.close()


def _cpu_bind(n):
    """VLLM_CPU_OMP_THREADS_BIND for n workers: this process's CPUs split in
    n lists ("0|1" on two CPUs)."""
    cpus = sorted(os.sched_getaffinity(0))
    per = max(1, len(cpus) // n)
    parts = [cpus[i * per:(i + 1) * per] or cpus[-1:] for i in range(n)]
    return "|".join(",".join(map(str, p)) for p in parts)


def test_tensor_parallel_2(model):
    """TP 2 on the CPU: two workers, two kvtier ranks of world 2."""
    name = "vllm-tp2-%d" % os.getpid()
    # one NUMA node here: vLLM's CPU workers need their cores named
    e = Engine(model, {"kvtier_segment": name, "kvtier_tier_gib": 0.25}, tp=2,
               env={"VLLM_CPU_OMP_THREADS_BIND": _cpu_bind(2)})
    try:
        a = e.generate([LONG])
        for p in OTHERS:
            e.generate([p])
        s0 = stats(name)
        assert e.generate([LONG]) == a
        s1 = stats(name)
        assert s1["world"] == 2
        assert s1["hit_tokens"] - s0["hit_tokens"] >= 32 * CHUNK
        assert s1["leases_live"] == 0 and s1["slots_pinned"] == 0
    finally:
        e.close()
        try:
            kvtier.unlink(name)
        except kvtier.KvtierError:
            pass


class Kvtierd:
    """kvtierd owning a segment in the connector's layout (--vllm-block-size)."""

    def __init__(self, model, name, extra=()):
        import socket
        build = os.environ.get("KVTIER_BUILD", os.path.join(REPO, "build"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.p = subprocess.Popen(
            [os.path.join(build, "tier", "daemon", "kvtierd"), "--segment", name,
             "--model-config", os.path.join(model, "config.json"), "--tp", "1",
             "--vllm-block-size", "32", "--model", "tiny-llama/bf16",
             "--http", "127.0.0.1:%d" % self.port, "--unlink"] + list(extra),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + 60
        while self.get("/healthcheck/segment")[0] != 200:
            assert self.p.poll() is None, self.p.stdout.read()
            assert time.monotonic() < deadline, "kvtierd did not come up"
            time.sleep(0.1)

    def get(self, path):
        import urllib.request
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.port, path),
                                        timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    def until(self, pred, what, timeout=120):
        deadline = time.monotonic() + timeout
        while not pred():
            assert self.p.poll() is None, self.p.stdout.read()
            if time.monotonic() > deadline:
                self.p.kill()
                raise AssertionError("timed out waiting for %s; kvtierd's log:\n%s"
                                     % (what, self.p.stdout.read()))
            time.sleep(0.1)

    def metric(self, name):
        _, text = self.get("/metrics")
        vals = [float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith(name + " ")
                or ln.startswith(name + "{")]
        assert vals, "no %s in /metrics" % name
        return vals[0]

    def stop(self):
        self.p.send_signal(signal.SIGTERM)
        try:
            return self.p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def test_kvtierd_owns_the_segment(model):
    """The operator's path: kvtierd creates and owns the segment with the
    connector's layout (--vllm-block-size), the engine attaches to it
    (kvtier_create false), /healthcheck turns 200 once its rank is up, and
    the daemon's /metrics count the engine's hits."""
    name = "vllm-kvtierd-%d" % os.getpid()
    d = Kvtierd(model, name, ["--tier-gib", "0.25"])
    e = None
    try:
        assert d.get("/healthcheck")[0] == 503  # no rank yet
        e = Engine(model, {"kvtier_segment": name, "kvtier_create": False,
                           "kvtier_model": "tiny-llama/bf16"})
        assert d.get("/healthcheck")[0] == 200
        a = e.generate([LONG])
        for p in OTHERS:
            e.generate([p])
        assert e.generate([LONG]) == a
        assert d.metric('kvtier_instance_hit_tokens_total{engine="0"}') >= 32 * CHUNK
    finally:
        if e is not None:
            e.close()
        d.stop()


def test_kvtierd_disk_tier(model, tmp_path):
    """kvtierd with a disk tier under a DRAM tier too small for the traffic:
    the long prompt's chunks are demoted, evicted from DRAM by the others,
    and when it comes back the connector's lookup finds them on disk, answers
    vLLM "ask again" (None) while kvtierd reads them back, then loads them:
    the output is the same, and the daemon counts the promotions."""
    name = "vllm-disk-%d" % os.getpid()
    d = Kvtierd(model, name, ["--slots", "48", "--disk", str(tmp_path / "kvtier.disk"),
                              "--disk-gib", "0.0625"])
    e = None
    try:
        e = Engine(model, {"kvtier_segment": name, "kvtier_create": False,
                           "kvtier_model": "tiny-llama/bf16", "kvtier_disk_wait_ms": 5000})
        a = e.generate([LONG])
        # LONG's chunks on disk before the others push them out of DRAM:
        # kvtierd demotes in the background, and on a loaded machine it may
        # get no CPU while the engine saves (a CI run beside a parallel
        # build saw 0 writes when the check came right after the others)
        d.until(lambda: d.metric("kvtier_disk_writes_total") >= 37, "LONG demoted")
        for p in OTHERS:             # 102 chunks through 48 slots: LONG leaves DRAM
            e.generate([p])
        assert d.metric("kvtier_disk_writes_total") >= 37
        h0 = d.metric('kvtier_instance_hit_tokens_total{engine="0"}')
        assert e.generate([LONG]) == a
        assert d.metric("kvtier_promote_requests_total") > 0
        assert d.metric("kvtier_disk_reads_total") > 0
        assert d.metric("kvtier_disk_checksum_errors_total") == 0
        hit = d.metric('kvtier_instance_hit_tokens_total{engine="0"}') - h0
        assert hit >= 32 * CHUNK, hit  # the prefix came back: DRAM and promoted chunks
    finally:
        if e is not None:
            e.close()
        d.stop()
