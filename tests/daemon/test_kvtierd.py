"""kvtierd with real clients: the daemon, real rank processes (the Python
binding with host DMA), curl, promtool, a real Prometheus server and
kvtier-stat in a real terminal (tmux).  Every port is on loopback, every
wait is bounded, and every process a test starts is stopped by it.

Run by scripts/test.sh with Debian's python3 and pytest; KVTIER_BUILD names
the build directory (default: build/)."""

import hashlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from daemon_geo import CHUNK_TOKENS, MODEL, WORLD, daemon_layout_args, groups  # noqa: E402
from kvt_testlib import REPO_ROOT, block_table, kv_cache, prompt, remove_segment, segment_paths  # noqa: E402,E501
import kvtier  # noqa: E402

BUILD = os.environ.get("KVTIER_BUILD", os.path.join(REPO_ROOT, "build"))
KVTIERD = os.path.join(BUILD, "tier", "daemon", "kvtierd")
KVTIER_STAT = os.path.join(BUILD, "tier", "daemon", "kvtier-stat")
T = 20.0  # the bound of every wait


def need(tool):
    if not shutil.which(tool):
        pytest.fail("%s is not installed (scripts/deps.sh installs it)" % tool)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def until(pred, what, timeout=T):
    end = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > end:
            pytest.fail("timed out (%.0f s) waiting for %s" % (timeout, what))
        time.sleep(0.05)


def curl(port, path, host="127.0.0.1"):
    """GET with curl: (status, body)."""
    p = subprocess.run(["curl", "-s", "--max-time", "5", "-w", "\n%{http_code}",
                        "http://%s:%d%s" % (host, port, path)],
                       capture_output=True, text=True, timeout=10)
    body, _, code = p.stdout.rpartition("\n")
    return int(code or 0), body


def metric(text, name, labels=""):
    key = name + ("{%s}" % labels if labels else "")
    for line in text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    raise AssertionError("no %s in /metrics" % key)


class Daemon:
    def __init__(self, name, extra=(), instances=2, slots=64, expect=True, prefix=(),
                 host="127.0.0.1"):
        """prefix: run under it (`ip netns exec NS`); host: the HTTP address."""
        self.name, self.port, self.host = name, free_port(), host
        self.logf = tempfile.NamedTemporaryFile(prefix="kvtierd-", suffix=".log", delete=False)
        self.args = list(prefix) + [KVTIERD, "--segment", name, "--http",
                                    "%s:%d" % (host, self.port),
                     "--log", self.logf.name, "--reap-interval", "0.1"] + \
            daemon_layout_args(instances, slots) + list(extra)
        self.p = subprocess.Popen(self.args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  text=True)
        if expect:
            until(lambda: self.p.poll() is not None or self.get("/healthcheck/segment")[0] == 200,
                  "kvtierd up")
            assert self.p.poll() is None, self.log()

    def get(self, path):
        try:
            return curl(self.port, path, self.host)
        except subprocess.TimeoutExpired:
            return 0, ""

    def log(self):
        with open(self.logf.name) as f:
            return f.read()

    def stop(self, sig=signal.SIGTERM, timeout=T):
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            return self.p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()
            pytest.fail("kvtierd did not stop on %s" % sig)

    def close(self):
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()
        os.unlink(self.logf.name)


class Rank:
    """A rank process (tests/daemon/rank_worker.py)."""

    def __init__(self, name, inst, r):
        self.inst, self.r = inst, r
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "rank_worker.py"), name,
                                   str(inst), str(r)], stdin=subprocess.PIPE,
                                  stdout=subprocess.PIPE, text=True)
        self.pid = self.read()["pid"]

    def read(self):
        r, _, _ = select.select([self.p.stdout], [], [], T)
        if not r:
            pytest.fail("rank (%d, %d): no answer in %.0f s" % (self.inst, self.r, T))
        line = self.p.stdout.readline()
        if not line:
            pytest.fail("rank (%d, %d) exited: %s" % (self.inst, self.r, self.p.wait()))
        return json.loads(line)

    def cmd(self, **m):
        self.p.stdin.write(json.dumps(m) + "\n")
        self.p.stdin.flush()
        return self.read()

    def kill(self):
        self.p.kill()
        self.p.wait()

    def close(self):
        if self.p.poll() is None:
            try:
                self.p.stdin.write('{"cmd": "exit"}\n')
                self.p.stdin.flush()
                self.p.wait(timeout=T)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.p.kill()
                self.p.wait()


def scheduler(name, inst):
    return kvtier.Tier(segment=name, role="scheduler", world=WORLD, instance=inst,
                       groups=groups(), chunk_tokens=CHUNK_TOKENS, model=MODEL)


def expected_sha(r, seed, chunks):
    kv = kv_cache(seed=100 + r)
    h = hashlib.sha256()
    for a in kv:
        h.update(a[block_table(chunks, seed=seed)].tobytes())
    return h.hexdigest()


@pytest.fixture
def name(request):
    n = "kvd-%d-%s" % (os.getpid(), request.node.name[5:25].replace("_", "-"))
    remove_segment(n)
    yield n
    remove_segment(n)


@pytest.fixture
def procs():
    """What a test starts, stopped at its end whatever happens."""
    started = []
    yield started
    for x in reversed(started):
        x.close()


def problems(port):
    code, body = curl(port, "/healthcheck")
    return code, json.loads(body)["problems"]


def test_lifecycle(name, procs):
    """503 until every rank attaches; two instances share the segment;
    kill -9 -> 503 naming the rank, reaped; re-attach -> 200; SIGTERM
    drains; a restart keeps the chunks; a second daemon refuses."""
    d = Daemon(name)
    procs.append(d)
    code, probs = problems(d.port)
    assert code == 503 and len(probs) == 4
    assert {(p["instance"], p["rank"], p["state"]) for p in probs} == \
        {(i, r, "missing") for i in (0, 1) for r in (0, 1)}

    ranks = {}
    for i, r in [(0, 0), (0, 1), (1, 0)]:
        ranks[i, r] = Rank(name, i, r)
        procs.append(ranks[i, r])
    code, probs = problems(d.port)
    assert code == 503 and [(p["instance"], p["rank"]) for p in probs] == [(1, 1)]
    ranks[1, 1] = Rank(name, 1, 1)
    procs.append(ranks[1, 1])
    until(lambda: d.get("/healthcheck")[0] == 200, "200 once every rank attached")

    # instance 0's ranks save; instance 1's scheduler hits it, its ranks load it
    for r in (0, 1):
        assert ranks[0, r].cmd(cmd="save", seed=5, chunks=4)["count"] == 4
    s1 = scheduler(name, 1)
    procs.append(s1)
    keys = s1.hash_tokens(prompt(4, seed=5))
    lease = s1.lookup(keys)
    assert lease.hits == 4
    lid = lease.hand_off()
    s1.step([lease])
    for r in (0, 1):
        got = ranks[1, r].cmd(cmd="load", lease=lid, chunks=4)["sha"]
        assert got == expected_sha(r, 5, 4), "instance 1 rank %d loaded other bytes" % r
    st = s1.stats()
    assert st["leases_live"] == 0 and st["slots_pinned"] == 0
    _, m = d.get("/metrics")
    assert metric(m, "kvtier_instance_hit_chunks_total", 'engine="1"') == 4
    assert metric(m, "kvtier_instance_saved_chunks_total", 'engine="0"') == 8
    assert metric(m, "kvtier_instance_loaded_chunks_total", 'engine="1"') == 8
    assert metric(m, "kvtier_rank_up", 'engine="1",rank="1"') == 1
    # the exit witness's holds listen; host-DMA ranks ask for none (the
    # holds themselves: tests/core_witness.c, with this daemon)
    assert metric(m, "kvtier_daemon_witness_up") == 1
    assert metric(m, "kvtier_daemon_witness_ranks") == 0
    assert metric(m, "kvtier_daemon_witness_refused_total") == 0
    assert metric(m, "kvtier_load_duration_seconds_count") == 2
    assert metric(m, "kvtier_lookup_duration_seconds_count") == 1
    assert metric(m, "kvtier_save_duration_seconds_count") == 2

    # kill -9 a rank that a lease waits for: 503 naming it; the reaper
    # frees the lease and its pins
    s0 = scheduler(name, 0)
    procs.append(s0)
    lease0 = s0.lookup(s0.hash_tokens(prompt(4, seed=5)))
    assert lease0.hits == 4
    lid0 = lease0.hand_off()
    ranks[0, 0].cmd(cmd="load", lease=lid0, chunks=4)
    assert s0.stats()["slots_pinned"] == 4
    dead = ranks[0, 1].pid
    ranks[0, 1].kill()
    code, probs = problems(d.port)
    assert code == 503 and [(p["instance"], p["rank"]) for p in probs] == [(0, 1)]
    until(lambda: s0.stats()["leases_live"] == 0 and s0.stats()["slots_pinned"] == 0,
          "the reaper to free the dead rank's lease", timeout=5)
    # a death is told as what it left (the lease that waited for its load)
    assert ("rank 1 of instance 0 (pid %d) died: repaired 0 slot(s) it was writing or "
            "evicting, released 1 lease(s)" % dead) in d.log(), d.log()
    _, m = d.get("/metrics")
    assert metric(m, "kvtier_rank_up", 'engine="0",rank="1"') == 0
    assert metric(m, "kvtier_reaped_entries_total") >= 1
    ranks[0, 1] = Rank(name, 0, 1)
    procs.append(ranks[0, 1])
    until(lambda: d.get("/healthcheck")[0] == 200, "200 after the re-attach")
    until(lambda: "rank 1 of instance 0 attached (pid %d)" % ranks[0, 1].pid in d.log(),
          "the attach logged")
    # a clean detach is logged as one, at info; a process killed holding
    # nothing (an engine's scheduler its parent killed at shutdown) is an
    # exit without a detach, at info too: neither is a death to repair
    left = ranks[1, 1].pid
    ranks[1, 1].close()
    until(lambda: "rank 1 of instance 1 (pid %d) detached" % left in d.log(),
          "the detach logged")
    ranks[1, 1] = Rank(name, 1, 1)
    procs.append(ranks[1, 1])
    gone = ranks[1, 0].pid
    ranks[1, 0].kill()
    until(lambda: "rank 0 of instance 1 (pid %d) exited without detaching; it held nothing"
          % gone in d.log(), "the exit logged")
    ranks[1, 0] = Rank(name, 1, 0)
    procs.append(ranks[1, 0])
    for ln in d.log().splitlines():
        if "(pid %d)" % gone in ln or "(pid %d)" % left in ln:
            assert " info: " in ln, ln

    # SIGTERM with a live lease: draining (503, attaches refused) until it goes
    held = s1.lookup(keys)
    assert held.hits == 4
    d.p.send_signal(signal.SIGTERM)
    until(lambda: json.loads(d.get("/healthcheck")[1] or "{}").get("draining"), "draining")
    assert d.get("/healthcheck")[0] == 503
    with pytest.raises(kvtier.KvtierError) as e:
        scheduler(name, 0)  # instance 0's scheduler entry is still s0's: use s0's slot?
    assert "draining" in str(e.value) or "attached by a live process" in str(e.value)
    s0.close()
    with pytest.raises(kvtier.KvtierError) as e:
        scheduler(name, 0)
    assert "draining" in str(e.value)
    assert d.p.poll() is None  # waits for the lease
    held.release()
    assert d.stop() == 0
    log = d.log()
    assert "drained: no live lease" in log and "stays for the next start" in log

    # warm restart: the chunks saved before it are still there
    d2 = Daemon(name)
    procs.append(d2)
    assert "warm restart" in d2.log() and "4 READY chunks kept" in d2.log()
    with s1.lookup(keys) as again:
        assert again.hits == 4
    until(lambda: d2.get("/healthcheck")[0] == 200, "200 after the restart (ranks stayed)")

    # a second daemon on the same name refuses, naming the owner
    d3 = Daemon(name, expect=False)
    procs.append(d3)
    assert d3.p.wait(timeout=T) == 3
    assert "owned by a live kvtierd (pid %d" % d2.p.pid in d3.log()
    assert d2.p.poll() is None and d2.get("/healthcheck")[0] == 200


def test_metrics_promtool_and_prometheus(name, procs):
    """/metrics passes promtool; a real Prometheus scrapes it and answers
    queries with the values the test's saves and lookups made."""
    need("promtool")
    need("prometheus")
    d = Daemon(name, instances=1)
    procs.append(d)
    ranks = [Rank(name, 0, r) for r in (0, 1)]
    procs.extend(ranks)
    for r in ranks:
        assert r.cmd(cmd="save", seed=9, chunks=3)["count"] == 3
    s = scheduler(name, 0)
    procs.append(s)
    keys = s.hash_tokens(prompt(5, seed=9))  # 3 of 5 chunks are there
    for _ in range(3):
        with s.lookup(keys) as lease:
            assert lease.hits == 3
    code, text = d.get("/metrics")
    assert code == 200
    p = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True,
                       text=True, timeout=30)
    assert p.returncode == 0, p.stdout + p.stderr
    assert metric(text, "kvtier_lookups_total") == 3
    assert metric(text, "kvtier_hit_chunks_total") == 9
    assert metric(text, "kvtier_lookup_chunks_total") == 15
    assert metric(text, "kvtier_saved_chunks_total") == 6
    assert metric(text, 'kvtier_lookup_duration_seconds_bucket', 'le="+Inf"') == 3

    work = tempfile.mkdtemp(prefix="kvtier-prom-")
    pport = free_port()
    with open(os.path.join(work, "prometheus.yml"), "w") as f:
        f.write("global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
                "scrape_configs:\n  - job_name: kvtier\n    static_configs:\n"
                "      - targets: ['127.0.0.1:%d']\n" % d.port)
    prom = subprocess.Popen(["prometheus", "--config.file", os.path.join(work, "prometheus.yml"),
                             "--storage.tsdb.path", os.path.join(work, "data"),
                             "--web.listen-address", "127.0.0.1:%d" % pport],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    def query(q):
        code, body = curl(pport, "/api/v1/query?query=" + urllib.parse.quote(q))
        if code != 200:
            return None
        res = json.loads(body)["data"]["result"]
        return float(res[0]["value"][1]) if res else None

    try:
        until(lambda: query("kvtier_lookups_total") == 3, "Prometheus to scrape kvtierd",
              timeout=60)
        assert query("kvtier_hit_chunks_total") == 9
        assert query('kvtier_instance_hit_tokens_total{engine="0"}') == 9 * CHUNK_TOKENS
        assert query("up{job=\"kvtier\"}") == 1
        assert query("histogram_quantile(0.5,kvtier_lookup_duration_seconds_bucket)") > 0
    finally:
        prom.terminate()
        try:
            prom.wait(timeout=T)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()
        shutil.rmtree(work, ignore_errors=True)


def test_write_only_tier_is_reported(name, procs):
    """Ranks save, the scheduler never looks up: /status warns and the
    metric says so; a lookup clears the totals verdict."""
    d = Daemon(name, instances=1)
    procs.append(d)
    ranks = [Rank(name, 0, r) for r in (0, 1)]
    procs.extend(ranks)
    _, m = d.get("/metrics")
    assert metric(m, "kvtier_instance_write_only", 'engine="0"') == 0
    # unknown paths and other methods change nothing
    assert d.get("/")[0] == 404 and d.get("/metrics/x")[0] == 404
    p = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-X", "POST",
                        "http://127.0.0.1:%d/healthcheck" % d.port], capture_output=True,
                       text=True, timeout=10)
    assert p.stdout == "405"
    # SIGHUP reopens the log (logrotate moved it away)
    rotated = d.logf.name + ".1"
    os.rename(d.logf.name, rotated)
    d.p.send_signal(signal.SIGHUP)
    until(lambda: os.path.exists(d.logf.name) and "log reopened" in d.log(), "the new log")
    os.unlink(rotated)
    for r in ranks:
        r.cmd(cmd="save", seed=3, chunks=2)
    _, m = d.get("/metrics")
    assert metric(m, "kvtier_instance_write_only", 'engine="0"') == 1
    st = json.loads(d.get("/status")[1])
    inst = st["instances"][0]
    assert inst["write_only"] and "write-only" in inst["warnings"][0]
    until(lambda: "instance 0 is write-only" in d.log(), "the daemon's warning", timeout=5)
    s = scheduler(name, 0)
    procs.append(s)
    with s.lookup(s.hash_tokens(prompt(2, seed=3))) as lease:
        assert lease.hits == 2
    until(lambda: metric(d.get("/metrics")[1], "kvtier_instance_write_only",
                         'engine="0"') == 0, "the verdict to clear", timeout=5)


def test_unshared_instances_are_reported(name, procs):
    """Instance 0's ranks save; instance 1's scheduler looks up as many
    chunks and finds none of them (keys of other prompts: what another
    hash seed or salt would give): /metrics, /status and the log say
    instance 1 is unshared, not instance 0.  Once it hits chunks instance 0
    saved, the verdict clears and the shared-hit counter has them."""
    d = Daemon(name, instances=2, slots=128)
    procs.append(d)
    ranks = [Rank(name, 0, r) for r in range(WORLD)]
    procs.extend(ranks)
    n = 8    # chunks a save; 4 prompts x WORLD shards: KVTD_UNSHARED_MIN (64)
    for seed in (5, 6, 7, 8):
        for r in ranks:
            assert r.cmd(cmd="save", seed=seed, chunks=n)["count"] == n
    s = scheduler(name, 1)
    procs.append(s)
    s0 = scheduler(name, 0)
    procs.append(s0)
    with s.lookup(s.hash_tokens(prompt(64, seed=9))) as lease:
        assert lease.hits == 0
    with s0.lookup(s0.hash_tokens(prompt(n, seed=5))) as lease:   # its own: not shared
        assert lease.hits == n
    _, m = d.get("/metrics")
    assert metric(m, "kvtier_instance_unshared", 'engine="1"') == 1
    assert metric(m, "kvtier_instance_unshared", 'engine="0"') == 0
    inst = json.loads(d.get("/status")[1])["instances"]
    assert inst[1]["unshared"] and "unshared" in inst[1]["warnings"][0]
    assert not inst[0]["unshared"] and inst[0]["shared_hit_chunks"] == 0
    until(lambda: "instance 1 is unshared" in d.log(), "the daemon's warning", timeout=5)
    with s.lookup(s.hash_tokens(prompt(n, seed=5))) as lease:
        assert lease.hits == n
    until(lambda: metric(d.get("/metrics")[1], "kvtier_instance_unshared",
                         'engine="1"') == 0, "the verdict to clear", timeout=5)
    _, m = d.get("/metrics")
    assert metric(m, "kvtier_instance_shared_hit_chunks_total", 'engine="1"') == n
    assert metric(m, "kvtier_instance_shared_hit_chunks_total", 'engine="0"') == 0


def test_start_under_systemd(name, procs, tmp_path, monkeypatch):
    """systemd's notify protocol, from a socket as systemd makes it: while
    the segment is made, EXTEND_TIMEOUT_USEC (so a start that works is not
    killed at TimeoutStartSec) with a STATUS line, then READY=1 once it
    serves.  The arena (1 GiB+ a shard) is prefaulted by two threads, and
    the log says how fast."""
    from kvt_testlib import BYTES_PER_TOKEN, N_LAYERS
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    path = str(tmp_path / "notify")
    sock.bind(path)
    sock.settimeout(T)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    monkeypatch.setenv("KVTIER_PREFAULT_THREADS", "2")
    monkeypatch.setenv("KVTIER_HUGEPAGES", "off")
    chunk = CHUNK_TOKENS * N_LAYERS * BYTES_PER_TOKEN      # one shard's
    slots = (1 << 30) // chunk + 8
    d = Daemon(name, instances=1, slots=slots, expect=False,
               extra=["--unlink", "--no-lock"])
    procs.append(d)
    msgs = []
    try:
        while not any(m.startswith("READY=1") for m in msgs):
            msgs.append(sock.recv(4096).decode())
    finally:
        sock.close()
    first = msgs[0].split("\n")
    assert first[0] == "EXTEND_TIMEOUT_USEC=60000000", msgs
    assert first[1].startswith("STATUS=making segment '%s'" % name), msgs
    assert msgs[-1] == "READY=1\nSTATUS=serving segment", msgs
    until(lambda: d.get("/healthcheck/segment")[0] == 200, "kvtierd up")
    log = d.log()
    assert "prefault: 1.0 GiB in " in log and " GiB/s, 2 threads)" in log, log
    import re    # the library's lines are the daemon's: timestamped, with a level
    assert re.search(r"^\d{4}-\d\d-\d\dT[\d:.]+Z kvtierd\[\d+\] info: kvtier: prefault: ",
                     log, re.M), log
    assert d.stop() == 0


def test_remove_segment(name, procs):
    """kvtier-stat --remove: refused while processes have the segment
    attached (each named with its pid) or when it cannot be read, unless
    --force; a segment nobody uses is removed."""
    def rm(*extra):
        p = subprocess.run([KVTIER_STAT, name, "--remove"] + list(extra), capture_output=True,
                           text=True, timeout=T)
        return p.returncode, p.stdout + p.stderr

    def exists():
        return any(os.path.exists(p) for p in segment_paths(name))

    rc, out = rm()
    assert rc == 1 and "no segment '%s'" % name in out, out
    assert rm("--force", "--json")[0] == 2
    d = Daemon(name, instances=1)
    procs.append(d)
    r0 = Rank(name, 0, 0)
    procs.append(r0)
    rc, out = rm()
    assert rc == 1 and exists(), out
    assert "kvtierd (pid %d, its owner)" % d.p.pid in out, out
    assert "rank 0 of instance 0 (pid %d)" % r0.pid in out, out
    assert "in use by 2 processes" in out, out
    r0.close()
    assert d.stop() == 0
    assert exists()                     # kvtierd keeps it for a warm restart
    rc, out = rm()
    assert rc == 0 and "removed segment '%s'" % name in out and not exists(), out
    # --force while attached: removed; the process keeps its mapping
    t = kvtier.Tier(segment=name, role="scheduler", world=WORLD, instance=0, groups=groups(),
                    chunk_tokens=CHUNK_TOKENS, model=MODEL, create=True, n_instances=1,
                    tier_bytes=1 << 24)
    procs.append(t)
    rc, out = rm()
    assert rc == 1 and "the scheduler of instance 0 (pid %d)" % os.getpid() in out, out
    rc, out = rm("--force")
    assert rc == 0 and "still mapped by: the scheduler of instance 0" in out and not exists()
    assert t.stats() is not None
    t.close()
    # a segment that cannot be read: whether it is used is unknown
    t = kvtier.Tier(segment=name, role="scheduler", world=WORLD, instance=0, groups=groups(),
                    chunk_tokens=CHUNK_TOKENS, model=MODEL, create=True, n_instances=1,
                    tier_bytes=1 << 24)
    t.close()
    path = [p for p in segment_paths(name) if os.path.exists(p)][0]
    import mmap
    with open(path, "r+b") as f:        # (mapped: hugetlbfs has no write())
        m = mmap.mmap(f.fileno(), min(os.fstat(f.fileno()).st_size, 2 << 20))
        m[0:8] = b"XXXXXXXX"            # the magic
        m.close()
    rc, out = rm()
    assert rc == 1 and "cannot be read" in out and "--force" in out and exists(), out
    rc, out = rm("--force")
    assert rc == 0 and not exists(), out


def test_stat_watch_in_a_terminal(name, procs):
    """kvtier-stat --watch in tmux: the screen shows the segment, and its
    figures change after a save."""
    need("tmux")
    d = Daemon(name, instances=1)
    procs.append(d)
    ranks = [Rank(name, 0, r) for r in (0, 1)]
    procs.extend(ranks)
    sess = "kvstat-%d" % os.getpid()
    subprocess.run(["tmux", "kill-session", "-t", sess], capture_output=True)
    subprocess.run(["tmux", "new-session", "-d", "-s", sess, "-x", "140", "-y", "60",
                    "%s %s --watch 0.2" % (KVTIER_STAT, name)], check=True, timeout=10)

    def screen():
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", sess], capture_output=True,
                              text=True, timeout=10).stdout

    def saved(text):
        for line in text.splitlines():
            if line.startswith("saved_chunks"):
                return int(line.split()[1])
        return None

    try:
        until(lambda: "segment '%s'" % name in screen(), "kvtier-stat's screen")
        s0 = screen()
        assert "owner      kvtierd pid %d" % d.p.pid in s0
        assert "instance 0: 2/2 ranks up" in s0
        assert saved(s0) == 0
        for r in ranks:
            r.cmd(cmd="save", seed=4, chunks=3)
        until(lambda: saved(screen()) == 6, "the saves on the screen")
        assert "ready 3 " in screen()
        subprocess.run(["tmux", "send-keys", "-t", sess, "q"], timeout=10)
        until(lambda: subprocess.run(["tmux", "has-session", "-t", sess],
                                     capture_output=True).returncode != 0,
              "q to end kvtier-stat")
    finally:
        subprocess.run(["tmux", "kill-session", "-t", sess], capture_output=True)

    # one-shot and JSON, no daemon needed
    assert d.stop() == 0
    out = subprocess.run([KVTIER_STAT, name, "--json"], capture_output=True, text=True,
                         timeout=10)
    st = json.loads(out.stdout)
    assert st["occupancy"]["ready"] == 3 and st["owner_pid"] == 0
    # the model kvtierd made the segment for (its header keeps it), as /status
    assert st["model"] == MODEL, st["model"]


def test_stat_json_is_status(name, procs):
    """kvtier-stat --json prints what kvtierd's /status does (the README
    says "the same object"), read from the segment with no daemon asked:
    equal but for the clock's fields (the time, the heartbeats' ages)."""
    d = Daemon(name, instances=1)
    procs.append(d)
    r = Rank(name, 0, 0)
    procs.append(r)
    r.cmd(cmd="save", seed=2, chunks=2)

    def strip(x):
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items() if k not in ("time", "heartbeat_age_s")}
        if isinstance(x, list):
            return [strip(v) for v in x]
        return x
    status = json.loads(d.get("/status")[1])
    out = subprocess.run([KVTIER_STAT, name, "--json"], capture_output=True, text=True,
                         timeout=10)
    assert strip(json.loads(out.stdout)) == strip(status)
    assert status["model"] == MODEL and status["instances"][0]["saved_chunks"] == 2


def test_bad_settings_are_refused(name, procs):
    def run(args, env=None):
        e = dict(os.environ)
        e.update(env or {})
        p = subprocess.run([KVTIERD, "--no-http"] + args, capture_output=True, text=True,
                           timeout=30, env=e)
        return p.returncode, p.stdout + p.stderr

    rc, out = run(["--segment", "a/b"] + daemon_layout_args())
    assert rc == 2 and "no '/'" in out
    rc, out = run(["--segment", name, "--http", "localhost"] + daemon_layout_args())
    assert rc == 2 and "ADDR:PORT" in out
    rc, out = run(["--segment", name, "--group", "6"] + daemon_layout_args()[2:])
    assert rc == 2 and "LAYERS:BYTES_PER_TOKEN" in out
    # a variable is read for what no flag set, as strictly as kvt_open reads it
    rc, out = run(["--segment", name, "--group", "6:128", "--world", "2", "--slots", "64"],
                  {"KVTIER_CHUNK_TOKENS": "lots"})
    assert rc == 2 and "KVTIER_CHUNK_TOKENS" in out
    rc, out = run(["--segment", name, "--world", "2"])
    assert rc == 2 and "KV layout is needed" in out
    rc, out = run(["--segment", name, "--l3-encrypt"] + daemon_layout_args())
    assert rc == 2 and "--l3-encrypt go with --l3 URL" in out, out
    cfg = tempfile.NamedTemporaryFile("w", suffix=".conf", delete=False)
    cfg.write("# comment\nsegment = %s\nworlds = 2\n" % name)
    cfg.close()
    rc, out = run(["--config", cfg.name])
    os.unlink(cfg.name)
    assert rc == 2 and "unknown key 'worlds'" in out
    assert not os.path.exists("/dev/shm/kvtier." + name)

    # another layout on the name: refused, then replaced with --recreate
    d = Daemon(name, instances=1)
    procs.append(d)
    assert d.stop() == 0
    d2 = Daemon(name, instances=1, slots=32, expect=False)
    procs.append(d2)
    assert d2.p.wait(timeout=T) == 6   # EXIT_INCOMPATIBLE: no restart
    assert "capacity: the segment has 64 slots, 32 asked" in d2.log()
    assert "--recreate" in d2.log()
    d3 = Daemon(name, extra=["--recreate", "--unlink"], instances=1, slots=32)
    procs.append(d3)
    st = json.loads(d3.get("/status")[1])
    assert st["geometry"]["slots"] == 32
    assert d3.stop() == 0
    assert "removed (--unlink)" in d3.log()


def test_disk_tier_end_to_end(name, procs, tmp_path):
    """kvtierd with a disk tier: ranks save, the daemon demotes in the
    background, newer saves evict the chunks from DRAM, the scheduler's
    kvt_lookup_ex reports them pending and asks them back, asks again until
    they are hits, the ranks load the very bytes they saved; a restart
    replays the disk; bad disk settings are refused with the path named."""
    disk = str(tmp_path / "kvtier-disk.img")
    extra = ["--disk", disk, "--disk-gib", "0.02", "--disk-admit", "all"]
    d = Daemon(name, extra=extra, instances=1, slots=16)
    procs.append(d)
    assert "disk tier: %s" % disk in d.log()
    ranks = [Rank(name, 0, r) for r in (0, 1)]
    procs.extend(ranks)
    for r in ranks:
        assert r.cmd(cmd="save", seed=5, chunks=8)["count"] == 8
    until(lambda: metric(d.get("/metrics")[1], "kvtier_disk_writes_total") >= 8,
          "the daemon to demote the 8 chunks")
    for seed in (6, 7, 8, 9):  # 32 newer chunks through 16 slots
        for r in ranks:
            r.cmd(cmd="save", seed=seed, chunks=8)
    s = scheduler(name, 0)
    procs.append(s)
    keys = s.hash_tokens(prompt(8, seed=5))
    first = s.lookup_ex(keys)
    assert first.hits < 8 and first.hits + first.pending == 8, (first.hits, first.pending)
    assert first.requested == first.pending
    first.release()
    steps = 0

    def promoted():
        nonlocal steps
        steps += 1
        s.step([])
        got = s.lookup_ex(keys)
        if got.hits == 8:
            return got
        got.release()
        return None

    lease = until(promoted, "the disk chunks to be promoted (asking again each step)")
    lid = lease.hand_off()
    s.step([lease])
    for r in ranks:
        assert r.cmd(cmd="load", lease=lid, chunks=8)["sha"] == expected_sha(r.r, 5, 8), \
            "rank %d loaded other bytes than it saved" % r.r
    _, m = d.get("/metrics")
    assert metric(m, "kvtier_disk_reads_total") >= 8 - first.hits
    assert metric(m, "kvtier_disk_read_bytes_total") > 0
    assert metric(m, "kvtier_promote_requests_total") >= 8 - first.hits
    assert metric(m, "kvtier_disk_checksum_errors_total") == 0
    assert metric(m, "kvtier_disk_up") == 1
    assert metric(m, "kvtier_disk_chunks") >= 8
    assert metric(m, "kvtier_disk_read_duration_seconds_count") >= 8 - first.hits
    if shutil.which("promtool"):
        p = subprocess.run(["promtool", "check", "metrics"], input=m, capture_output=True,
                           text=True, timeout=30)
        assert p.returncode == 0, p.stdout + p.stderr
    st = json.loads(d.get("/status")[1])
    assert st["disk"]["online"] and st["disk"]["path"] == disk
    used = st["disk"]["used"]
    for r in ranks:
        r.close()
    s.close()
    assert d.stop() == 0
    assert "disk tier closed" in d.log()

    # restart: the disk's records are replayed
    d2 = Daemon(name, extra=extra, instances=1, slots=16)
    procs.append(d2)
    assert "%d replayed" % used in d2.log(), d2.log()
    assert d2.stop() == 0

    # refusals: direct forced on tmpfs; a file too small
    shm = "/dev/shm/kvtier-disk-%d.img" % os.getpid()
    try:
        bad = Daemon(name, extra=["--disk", shm, "--disk-gib", "0.01", "--disk-direct", "on"],
                     instances=1, slots=16, expect=False)
        procs.append(bad)
        assert bad.p.wait(timeout=T) == 1
        assert shm in bad.log() and "tmpfs" in bad.log()
    finally:
        if os.path.exists(shm):
            os.unlink(shm)
    small = str(tmp_path / "small.img")
    bad = Daemon(name, extra=["--disk", small, "--disk-gib", "0.001"], instances=1, slots=16,
                 expect=False)
    procs.append(bad)
    assert bad.p.wait(timeout=T) == 2
    assert small in bad.log() and "hold no chunk" in bad.log()


def test_truncated_segment_exits_cleanly(name, procs):
    """A process of the service's uid truncates the live segment's file:
    kvtierd logs what happened and exits 4 instead of dying of SIGBUS
    silently (exit 135).  Twice: caught by the loop's size check, and by
    the SIGBUS handler when an HTTP scrape touches the truncated pages
    before the loop looks (reap interval 60 s)."""
    for extra, how in (([], "loop"), (["--reap-interval", "60"], "sigbus")):
        d = Daemon(name, extra=extra + ["--unlink"], instances=1, slots=16)
        procs.append(d)
        # on /dev/shm, or on a hugetlbfs mount (which truncates only to
        # huge page multiples: 0)
        path = [p for p in segment_paths(name) if os.path.exists(p)][0]
        assert os.path.getsize(path) > 4096
        os.truncate(path, 0)
        if how == "sigbus":
            d.get("/status")  # the HTTP thread reads the segment: SIGBUS
        assert d.p.wait(timeout=T) == 4, (how, d.p.returncode, d.log())
        out = d.log() + (d.p.stdout.read() or "")
        assert "was truncated under the daemon" in out, (how, out)
        # the loop names the sizes; the handler cannot (async-signal-safe)
        assert ("its file is 0 bytes" in out) == (how == "loop"), (how, out)
        remove_segment(name)


def test_stopped_rank_is_reported(name, procs):
    """A live rank stopped by SIGSTOP, then frozen by the cgroup freezer
    (docker pause): /healthcheck is 503 naming it "stopped" and
    kvtier_rank_stopped is 1; resumed, 200 again.  Before, a stopped rank
    looked healthy (only its heartbeat's age grew)."""
    d = Daemon(name, instances=1)
    procs.append(d)
    ranks = [Rank(name, 0, r) for r in (0, 1)]
    procs.extend(ranks)
    until(lambda: d.get("/healthcheck")[0] == 200, "200 once both ranks attached")

    def stopped_then_back(stop, resume, how):
        stop()
        try:
            until(lambda: problems(d.port) == (503, [{"instance": 0, "role": "rank", "rank": 1,
                                                      "state": "stopped",
                                                      "pid": ranks[1].pid}]),
                  "503 naming the %s rank" % how)
            _, m = d.get("/metrics")
            assert metric(m, "kvtier_rank_stopped", 'engine="0",rank="1"') == 1
            assert metric(m, "kvtier_rank_stopped", 'engine="0",rank="0"') == 0
        finally:
            resume()
        until(lambda: d.get("/healthcheck")[0] == 200, "200 once the %s rank resumed" % how)

    pid = ranks[1].pid
    stopped_then_back(lambda: os.kill(pid, signal.SIGSTOP),
                      lambda: os.kill(pid, signal.SIGCONT), "SIGSTOPped")
    fz = "/sys/fs/cgroup/freezer"
    if os.geteuid() != 0 or not os.access(os.path.join(fz, "cgroup.procs"), os.W_OK):
        return  # no cgroup-v1 freezer to drive here: the SIGSTOP half ran
    cg = os.path.join(fz, "kvtier-test-%d" % os.getpid())
    os.makedirs(cg, exist_ok=True)
    try:
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(pid))

        def state(s):
            with open(os.path.join(cg, "freezer.state"), "w") as f:
                f.write(s)
        stopped_then_back(lambda: state("FROZEN"), lambda: state("THAWED"), "frozen")
        with open(os.path.join(fz, "cgroup.procs"), "w") as f:
            f.write(str(pid))
    finally:
        try:
            os.rmdir(cg)
        except OSError:
            pass


def test_config_file_and_disk_trust(name, procs, tmp_path):
    """The config file through libinih: a comment of any length stays a
    comment (the old reader cut lines at 4,095 bytes and applied the tail);
    a directory, /dev/zero, a FIFO are refused at once; switches take a
    value. The disk file's rules and its MAC key, as the daemon reports
    them."""
    def run(args, timeout=30):
        p = subprocess.run([KVTIERD, "--no-http"] + args, capture_output=True, text=True,
                           timeout=timeout)
        return p.returncode, p.stdout + p.stderr

    cfg = tmp_path / "kvtierd.conf"
    # a 5,000-byte comment whose tail, cut at 4,095, would be an unknown key
    cfg.write_text("#" + "x" * 4094 + "worlds = 2\n# " + "y" * 9000 + "\nsegment = %s\n"
                   "recreate = yes\nunlink = yes\n" % name)
    d = Daemon(name, extra=["--config", str(cfg)], instances=2)
    procs.append(d)
    assert d.stop() == 0, d.log()
    assert not os.path.exists("/dev/shm/kvtier." + name)  # `unlink = yes` applied
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path, why in ((str(tmp_path), "a directory"), ("/dev/zero", "a character device"),
                      (str(fifo), "a FIFO")):
        rc, out = run(["--config", path] + daemon_layout_args(), timeout=10)
        assert rc == 2 and "not a regular file (%s)" % why in out, out
    for text, msg in (("recreate\n", "a switch takes a value too"),
                      ("recreate = maybe\n", "is a switch: yes or no"),
                      ("[kvtierd]\nworld = 2\n", "no [sections]"),
                      ("world = " + "1" * 300 + "\n", "at most 198 fit a line")):
        cfg.write_text(text)
        rc, out = run(["--config", str(cfg)] + daemon_layout_args())
        assert rc == 2 and msg in out, (text, out)
    rc, out = run(["--tier-gib", "nan", "--segment", name] + daemon_layout_args()[:-4])
    assert rc == 2 and "expected GiB from" in out, out

    # the disk file: planted world-writable, a link, a FIFO: refused, as is
    # a disk whose key is gone
    disk = tmp_path / "disk.img"
    disk.write_bytes(b"")
    os.chmod(disk, 0o666)
    layout = daemon_layout_args(instances=1)
    rc, out = run(["--segment", name, "--unlink", "--disk", str(disk), "--disk-gib", "0.05"]
                  + layout)
    assert rc == 1 and "mode 0666" in out and "chmod 600" in out, out
    disk.unlink()
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    os.symlink(victim, disk)
    rc, out = run(["--segment", name, "--unlink", "--disk", str(disk), "--disk-gib", "0.05",
                   "--disk-reset"] + layout)
    assert rc == 1 and "symbolic link" in out, out
    assert victim.read_bytes() == b"precious"
    disk.unlink()
    os.mkfifo(disk)
    rc, out = run(["--segment", name, "--unlink", "--disk", str(disk)] + layout, timeout=10)
    assert rc == 2 and "FIFO" in out, out
    disk.unlink()
    d = Daemon(name, extra=["--disk", str(disk), "--disk-gib", "0.05", "--unlink"],
               instances=1)
    procs.append(d)
    assert d.stop() == 0, d.log()
    assert oct(os.stat(disk).st_mode & 0o777) == "0o600"
    key = str(disk) + ".key"
    assert os.stat(key).st_size == 32 and os.stat(key).st_mode & 0o077 == 0
    os.rename(key, key + ".gone")
    rc, out = run(["--segment", name, "--unlink", "--disk", str(disk)] + layout)
    assert rc == 1 and "MAC key" in out and "missing" in out, out
    assert not os.path.exists(key)  # not made behind the operator's back


def test_segment_name_squatting(name, procs, tmp_path):
    """Another uid (nobody) takes the segment's name in /dev/shm first: a
    file, a link, a directory. kvtierd cannot remove it there, so it exits
    5 (no restart loop: the unit's RestartPreventExitStatus) with the cure;
    in a segment directory of its own nobody can squat, and --recreate
    replaces whatever is at the name."""
    if os.geteuid() != 0:
        pytest.skip("needs root to act as another uid")
    import pwd
    nobody = pwd.getpwnam("nobody")

    def as_nobody(fn):
        pid = os.fork()
        if pid == 0:
            try:
                os.setgid(nobody.pw_gid)
                os.setuid(nobody.pw_uid)
                fn()
                os._exit(0)
            except OSError:
                os._exit(1)
        return os.waitpid(pid, 0)[1] == 0

    def run(args, env=None):
        e = dict(os.environ)
        e.update(env or {})
        p = subprocess.run([KVTIERD, "--no-http", "--segment", name, "--no-lock"] + args +
                           daemon_layout_args(instances=1), capture_output=True, text=True,
                           timeout=30, env=e)
        return p.returncode, p.stdout + p.stderr

    path = "/dev/shm/kvtier." + name
    squats = (("a file", lambda: open(path, "w").close()),
              ("a symbolic link", lambda: os.symlink("/etc/passwd", path)),
              ("a directory", lambda: os.mkdir(path)))
    try:
        for what, make in squats:
            assert as_nobody(make)
            rc, out = run(["--recreate", "--unlink"])
            assert rc == 5, out
            assert "segment name taken" in out and what in out and "KVTIER_SEGMENT_DIR" in out
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            else:
                os.unlink(path)
    finally:
        if os.path.lexists(path):
            (os.rmdir if os.path.isdir(path) and not os.path.islink(path) else os.unlink)(path)

    # a directory of the service's own: nobody cannot create the name ...
    own = tmp_path / "segments"
    own.mkdir(mode=0o750)
    os.chmod(tmp_path, 0o755)
    assert not as_nobody(lambda: open(str(own / ("kvtier." + name)), "w").close())
    # ... and what is at the name is the service's to replace
    (own / ("kvtier." + name)).mkdir()
    env = {"KVTIER_SEGMENT_DIR": str(own)}
    rc, out = run(["--unlink"], env)
    assert rc == 1 and "--recreate" in out, out
    d = Daemon(name, extra=["--recreate", "--unlink", "--no-lock", "--segment-dir", str(own)],
               instances=1)
    procs.append(d)
    assert "removed" in d.log()
    assert os.path.isfile(own / ("kvtier." + name))
    assert d.stop() == 0


def http_raw(port, data, timeout=10.0):
    """Bytes to the daemon, everything back until it closes: (status,
    headers with lower-case names, body).  Status 0: closed or reset with no
    answer, or no answer in timeout."""
    head = b""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            try:
                s.sendall(data)
            except OSError:
                pass  # refused mid-request: read what it said
            while True:
                b = s.recv(65536)
                if not b:
                    break
                head += b
    except OSError:
        pass  # a timeout or a reset: what came before it counts
    top, _, body = head.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return 0, {}, b""
    hdrs = {k.strip().lower(): v.strip() for k, _, v in (x.partition(":") for x in lines[1:])}
    return int(parts[1]), hdrs, body


def test_http_slow_connection_flood(name, procs):
    """300 connections that each send one byte of a request line a second
    (libmicrohttpd alone held 64 and no probe got in) do not keep the
    probes out: /healthcheck/segment and /healthcheck answer 20 of 20 while
    the flood goes on; the daemon closes every slow connection within its
    header deadline (5 s) plus slack, says so in its log once, and is
    healthy after."""
    import selectors
    import threading
    d = Daemon(name, instances=1)
    procs.append(d)
    flood, cap, deadline, slack = 300, 3000, 5.0, 10.0
    line = b"GET /healthcheck/segment?" + b"a" * 2000 + b" HTTP/1.1\r\n"
    sel = selectors.DefaultSelector()
    live = {}  # socket -> [opened, bytes sent]
    lived, answered_408 = [], [0]
    opened, reopen, stop = [0], threading.Event(), threading.Event()
    reopen.set()

    def gone(s, now):
        sel.unregister(s)
        lived.append(now - live.pop(s)[0])
        s.close()

    def attacker():
        next_tick = 0.0
        while not stop.is_set():
            now = time.monotonic()
            if now >= next_tick:  # the tick: a byte each, the closed ones again
                next_tick = now + 1.0
                for s, st in list(live.items()):
                    try:
                        st[1] += s.send(line[st[1]:st[1] + 1])
                    except OSError:
                        gone(s, now)
                while reopen.is_set() and len(live) < flood and opened[0] < cap:
                    s = socket.create_connection(("127.0.0.1", d.port), timeout=5)
                    s.setblocking(False)
                    live[s] = [time.monotonic(), 0]
                    sel.register(s, selectors.EVENT_READ)
                    opened[0] += 1
            for key, _ in sel.select(timeout=0.05):
                s = key.fileobj
                try:
                    b = s.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    b = b""
                if b.startswith(b"HTTP/1.1 408"):
                    answered_408[0] += 1
                if not b:
                    gone(s, time.monotonic())

    t = threading.Thread(target=attacker, daemon=True)
    t.start()
    try:
        until(lambda: opened[0] >= flood, "the flood's %d connections" % flood)
        start = time.monotonic()
        answers, tried = [], 0
        # 20 probes while it goes on; a probe waits up to 10 s (a loaded
        # CI machine), the phase at most 60 s (without the front: 0 of 6)
        while tried < 20 and time.monotonic() - start < 60:
            path = "/healthcheck/segment" if tried % 2 == 0 else "/healthcheck"
            req = ("GET %s HTTP/1.1\r\nHost: x\r\n\r\n" % path).encode()
            answers.append(http_raw(d.port, req)[0])
            tried += 1
            time.sleep(0.2)
        ok = sum(1 for c in answers if c in (200, 503))
        # keep it up past the deadline, so connections meet it
        while time.monotonic() - start < deadline + 2:
            time.sleep(0.1)
        reopen.clear()
        end = time.monotonic() + deadline + slack
        while live and time.monotonic() < end:
            time.sleep(0.1)
        still = len(live)
    finally:
        stop.set()
        t.join(timeout=T)
        for s in list(live):
            s.close()
    assert ok == 20, "probes answered under the flood: %d of %d (%s)" % (ok, tried, answers)
    assert still == 0, "%d slow connections still open %.0f s after the flood" % (
        still, deadline + slack)
    assert lived and max(lived) <= deadline + slack, "a slow connection lived %.1f s" % max(lived)
    assert answered_408[0] > 0  # some met the deadline (the others made room)
    print("flood: %d connections, %d probes answered of %d, longest lived %.1f s, %d got 408"
          % (opened[0], ok, tried, max(lived), answered_408[0]))
    assert d.get("/healthcheck/segment")[0] == 200
    # reported at once, then at most once a minute: one line, not one a connection
    assert d.log().count("HTTP: connections closed") == 1, d.log()
    assert d.stop() == 0


def test_http_requests_refused(name, procs):
    """A GET that announces a body (Content-Length 5, or chunked) gets 400;
    a header block over 8 KiB is refused (431, or closed), never answered;
    POST gets 405 with Allow; every answer says Connection: close and the
    daemon closes the connection after it; empty lines before a request
    line do not let an unfinished request past the front."""
    d = Daemon(name, instances=1)
    procs.append(d)
    get = "GET /healthcheck/segment HTTP/1.1\r\nHost: x\r\n"
    code, h, body = http_raw(d.port, (get + "\r\n").encode())
    assert code == 200 and h.get("connection") == "close" and b'"status":"ok"' in body
    code, h, body = http_raw(d.port, (get + "Content-Length: 0\r\n\r\n").encode())
    assert code == 200
    code, h, body = http_raw(d.port, (get + "Content-Length: 5\r\n\r\nhello").encode())
    assert code == 400 and b"no body expected" in body, (code, body)
    assert h.get("connection") == "close"
    code, h, body = http_raw(d.port, (get + "Transfer-Encoding: chunked\r\n\r\n"
                                      "5\r\nhello\r\n0\r\n\r\n").encode())
    assert code == 400, (code, body)
    code, h, _ = http_raw(d.port, b"POST /healthcheck HTTP/1.1\r\nHost: x\r\n"
                          b"Content-Length: 2\r\n\r\nhi")
    assert code == 405 and h.get("allow") == "GET, HEAD"
    code, h, body = http_raw(d.port, b"HEAD /healthcheck/segment HTTP/1.1\r\nHost: x\r\n\r\n")
    assert code == 200 and body == b""
    big = (get + "X-Big: " + "a" * 9000 + "\r\n\r\n").encode()
    code, h, body = http_raw(d.port, big)
    assert code in (0, 431), (code, body[:80])
    # a client that asks to keep the connection is answered and closed too
    code, h, _ = http_raw(d.port, (get + "Connection: keep-alive\r\n\r\n").encode())
    assert code == 200 and h.get("connection") == "close"
    # empty lines before the request line do not make it whole: the front
    # keeps it and answers 408 at its deadline (libmicrohttpd would have
    # held it 10 s and closed it without a word)
    code, _, _ = http_raw(d.port, b"\r\n\r\n" + (get + "\r\n").encode())
    assert code == 200
    code, _, body = http_raw(d.port, b"\r\n\r\nGET /healthcheck", timeout=T)
    assert code == 408, (code, body)
    assert d.get("/healthcheck/segment")[0] == 200
    assert d.stop() == 0


class Redis:
    """A redis-server of the test's own on a loopback port (no persistence)."""

    def __init__(self, tmp_path, port=None, *extra):
        need("redis-server")
        need("redis-cli")
        self.port, self.extra, self.dir = port or free_port(), list(extra), str(tmp_path)
        self.p = None
        self.start()

    def start(self):
        self.p = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind",
                                   "127.0.0.1", "--save", "", "--appendonly", "no", "--dir",
                                   self.dir] + self.extra,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        until(lambda: self.cli("ping") in ("PONG", "NOAUTH"), "redis-server up")

    def cli(self, *args):
        p = subprocess.run(["redis-cli", "-p", str(self.port)] + list(args),
                           capture_output=True, text=True, timeout=10)
        return (p.stdout + p.stderr).strip().split(" ")[0]

    def kill(self):
        if self.p and self.p.poll() is None:
            self.p.kill()
            self.p.wait()

    def close(self):
        self.kill()


def test_l3_puts_and_store_failure(name, procs, tmp_path):
    """kvtierd with an L3 store (a real redis-server): the chunks ranks save
    are put, one sealed object per shard; the store killed, lookups still
    answer, /healthcheck stays 200 with the L3 down and the node degraded,
    kvtier_l3_up 0; the store back, the L3 is up again by itself and new
    chunks are put; a wrong password stops the start, named; --l3 without
    --l3-key is refused."""
    r = Redis(tmp_path)
    procs.append(r)
    key = str(tmp_path / "fleet.key")
    extra = ["--l3", "redis://127.0.0.1:%d" % r.port, "--l3-key", key, "--l3-admit", "all",
             "--l3-timeout-ms", "300", "--l3-negative-ms", "500"]
    d = Daemon(name, extra=extra, instances=1, slots=32)
    procs.append(d)
    assert "l3 tier: redis (one node)" in d.log(), d.log()
    assert os.stat(key).st_mode & 0o777 == 0o600
    ranks = [Rank(name, 0, k) for k in range(WORLD)]
    procs.extend(ranks)
    for k in ranks:
        assert k.cmd(cmd="save", seed=11, chunks=8)["count"] == 8
    until(lambda: metric(d.get("/metrics")[1], "kvtier_l3_puts_total") >= 8,
          "the daemon to put the 8 chunks")
    assert int(r.cli("dbsize")) == 8 * WORLD  # one object per (chunk, shard)
    _, m = d.get("/metrics")
    assert metric(m, "kvtier_l3_up") == 1
    assert metric(m, "kvtier_l3_put_bytes_total") > 0
    assert metric(m, "kvtier_l3_put_drops_total") == 0
    code, body = d.get("/healthcheck")
    assert code == 200 and json.loads(body)["l3"] == "up", body
    if shutil.which("promtool"):
        p = subprocess.run(["promtool", "check", "metrics"], input=m, capture_output=True,
                           text=True, timeout=30)
        assert p.returncode == 0, p.stdout + p.stderr
    st = json.loads(d.get("/status")[1])
    assert st["l3"]["up"] and st["l3"]["puts"] >= 8

    # the store goes away: puts fail, the node is degraded, not unhealthy
    r.kill()
    for k in ranks:
        k.cmd(cmd="save", seed=12, chunks=4)
    until(lambda: metric(d.get("/metrics")[1], "kvtier_l3_up") == 0, "the L3 marked down")
    code, body = d.get("/healthcheck")
    h = json.loads(body)
    assert code == 200 and h["l3"] == "down" and h["status"] == "degraded", body
    s = scheduler(name, 0)
    procs.append(s)
    got = s.lookup_ex(s.hash_tokens(prompt(8, seed=11)))
    assert got.hits == 8  # DRAM still answers
    got.release()
    assert "the store does not answer" in d.log()
    # back: up again by itself -- with no request to notice it (a failed
    # put is not retried) -- and what is saved now is put
    r.start()
    until(lambda: metric(d.get("/metrics")[1], "kvtier_l3_up") == 1, "the L3 up again")
    for k in ranks:
        k.cmd(cmd="save", seed=13, chunks=4)
    until(lambda: int(r.cli("dbsize")) >= 4 * WORLD, "the new chunks put")
    assert "the store answers again" in d.log()
    for k in ranks:
        k.close()
    s.close()
    assert d.stop() == 0
    assert "l3 tier closed" in d.log()

    # a password the store refuses: the start fails, the reason named
    r2 = Redis(tmp_path, None, "--requirepass", "right")
    procs.append(r2)
    auth = tmp_path / "auth"
    auth.write_text("wrong\n")
    os.chmod(auth, 0o600)
    bad = Daemon(name, extra=["--l3", "redis://127.0.0.1:%d" % r2.port, "--l3-key", key,
                              "--l3-auth-file", str(auth)], instances=1, slots=32, expect=False)
    procs.append(bad)
    assert bad.p.wait(timeout=T) == 1
    assert "AUTH refused" in bad.log(), bad.log()
    nokey = Daemon(name, extra=["--l3", "redis://127.0.0.1:%d" % r.port], instances=1,
                   slots=32, expect=False)
    procs.append(nokey)
    assert nokey.p.wait(timeout=T) != 0
    assert "--l3 needs --l3-key" in nokey.p.stdout.read()


class TearProxy:
    """A TCP proxy of the test's own in front of a redis-server.  Armed, it
    forwards the first bulk reply that comes from the server (a GET's
    object) up to half its value and holds the rest, and everything after
    it, until released: a shard lies half-read and no get can complete --
    gets in flight, deterministically, for as long as the test wants."""

    def __init__(self, target, host="127.0.0.1"):
        import threading
        self.threading = threading
        self.target = target
        self.ls = socket.socket()
        self.ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.ls.bind((host, 0))
        self.ls.listen(16)
        self.port = self.ls.getsockname()[1]
        self.armed = False
        self.torn = threading.Event()
        self.released = threading.Event()
        self.socks = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                c, _ = self.ls.accept()
            except OSError:
                return
            s = socket.create_connection(("127.0.0.1", self.target))
            self.socks += [c, s]
            self.threading.Thread(target=self._pipe, args=(c, s, False), daemon=True).start()
            self.threading.Thread(target=self._pipe, args=(s, c, True), daemon=True).start()

    def _pipe(self, src, dst, from_server):
        # the server's replies are followed as RESP (lines; a bulk's value
        # skipped by its length: a value's bytes may be anything): the
        # first bulk reply once armed is cut after half its value
        need, line, left = 0, b"", None  # in a value; a header so far; to forward
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if from_server and left is None:
                    i = 0
                    while i < len(data) and left is None:
                        if need:
                            k = min(need, len(data) - i)
                            i, need = i + k, need - k
                            continue
                        j = data.find(b"\r\n", i)
                        if j < 0:
                            line, i = line + data[i:], len(data)
                            break
                        head, line, i = line + data[i:j], b"", j + 2
                        if head[:1] == b"$" and int(head[1:]) >= 0:
                            if self.armed and not self.released.is_set():
                                left = i + int(head[1:]) // 2
                            else:
                                need = int(head[1:]) + 2
                if left is not None:
                    dst.sendall(data[:left])
                    left -= min(left, len(data))
                    if not left:
                        self.torn.set()
                        self.released.wait()
                        break
                    continue
                dst.sendall(data)
        except OSError:
            pass
        for x in (src, dst):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def release(self):
        self.armed = False
        self.released.set()

    def close(self):
        self.release()
        self.ls.close()
        for x in self.socks:
            x.close()


class TwoNets:
    """Node A's and node B's networks: a namespace each, with an address of
    its own on a veth pair to the host's namespace, where the store listens
    (`ip netns`, where the host allows it); else both on loopback.  The
    ranks reach their kvtierd through the sockets beside the segment, which
    every namespace of the same filesystem sees."""

    def __init__(self, bridged=False):
        """bridged: the nodes also reach each other (one bridge, one /24 --
        Mooncake's clients read from each other's segments); else each has
        a /30 to the host only."""
        pid = os.getpid()
        net = 10 + pid % 200
        self.ns, self.store, self.node = [], ["127.0.0.1"] * 2, ["127.0.0.1"] * 2
        self.bridge = None
        try:
            if bridged:
                net = 210 + pid % 40
                self.bridge = "kb%d" % pid
                self._ip("link", "add", self.bridge, "type", "bridge")
                self._ip("addr", "add", "10.214.%d.1/24" % net, "dev", self.bridge)
                self._ip("link", "set", self.bridge, "up")
            for i, ab in enumerate("ab"):
                ns, hv, nv = "kvt%d%s" % (pid, ab), "kh%d%s" % (pid, ab), "kn%d%s" % (pid, ab)
                if bridged:
                    hostip, nodeip, plen = "10.214.%d.1" % net, "10.214.%d.%d" % (net, 2 + i), 24
                else:
                    hostip, nodeip, plen = ("10.213.%d.%d" % (net, 4 * i + 1),
                                            "10.213.%d.%d" % (net, 4 * i + 2), 30)
                self._ip("netns", "add", ns)
                self.ns.append(ns)
                self._ip("link", "add", hv, "type", "veth", "peer", "name", nv)
                self._ip("link", "set", nv, "netns", ns)
                if bridged:
                    self._ip("link", "set", hv, "master", self.bridge)
                else:
                    self._ip("addr", "add", "%s/%d" % (hostip, plen), "dev", hv)
                self._ip("link", "set", hv, "up")
                for c in (("addr", "add", "%s/%d" % (nodeip, plen), "dev", nv),
                          ("link", "set", nv, "up"), ("link", "set", "lo", "up")):
                    self._ip("netns", "exec", ns, "ip", *c)
                self.store[i], self.node[i] = hostip, nodeip
        except (OSError, subprocess.CalledProcessError):
            self.close()
            self.store, self.node = ["127.0.0.1"] * 2, ["127.0.0.1"] * 2

    @staticmethod
    def _ip(*args):
        subprocess.run(["ip"] + list(args), check=True, capture_output=True, timeout=30)

    def prefix(self, i):
        return ["ip", "netns", "exec", self.ns[i]] if len(self.ns) == 2 else []

    def close(self):
        for ns in self.ns:  # its veth ends go with it
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        self.ns = []
        if self.bridge:
            subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)
            self.bridge = None


def side_files(name):
    """The sockets beside a segment's file, wherever it lives (/dev/shm, or
    a hugetlbfs mount when the library found huge pages)."""
    return [os.path.join(os.path.dirname(p), "kvtier-%s.%s" % (k, name))
            for p in segment_paths(name) for k in ("l3", "witness")]


def test_l3_two_nodes_and_kill_with_gets_in_flight(name, procs, tmp_path):
    """Two nodes (two segments, each with its own kvtierd) over one Redis:
    node A's ranks save a prefix, A's daemon puts it; on node B, which never
    saw it, the scheduler's kvt_lookup_ex (the Python binding) reports the
    chunks pending, asks kvtierd over the L3 channel, asks again each step
    until they are hits, and B's ranks load A's bytes exactly.  A prefix no
    one has is answered missing: not pending, recomputed.  Then node B's
    kvtierd is killed -9 with L3 gets in flight (a proxy holds the store's
    replies half-sent): nothing half-got is ever a hit, and the daemon
    restarted gets the chunks again, byte-exact.  Each node in a network
    namespace of its own where the host allows (TwoNets), else on loopback."""
    net = TwoNets()
    procs.append(net)
    # (reached from the nodes' own networks: not loopback, so not in
    # Redis's protected mode; it listens on the test's veth addresses only)
    r = Redis(tmp_path, None, "--protected-mode", "no", "--bind",
              *sorted(set(["127.0.0.1"] + net.store)))
    procs.append(r)
    key = str(tmp_path / "fleet.key")
    l3 = ["--l3-key", key, "--l3-timeout-ms", "1000", "--l3-negative-ms", "300"]
    name_b = name[:-2] + "-b"
    remove_segment(name_b)
    try:
        a = Daemon(name, extra=["--l3", "redis://%s:%d" % (net.store[0], r.port), "--l3-admit",
                                "all"] + l3, instances=1, slots=64, prefix=net.prefix(0),
                   host=net.node[0])
        procs.append(a)
        ranks_a = [Rank(name, 0, k) for k in range(WORLD)]
        procs.extend(ranks_a)
        for k in ranks_a:
            for seed in (21, 22, 24, 25):
                assert k.cmd(cmd="save", seed=seed, chunks=8)["count"] == 8
        until(lambda: metric(a.get("/metrics")[1], "kvtier_l3_puts_total") >= 32,
              "node A to put its 32 chunks")

        # node B, which never saw them; admission none: B puts nothing
        node_b = dict(instances=1, slots=32, prefix=net.prefix(1), host=net.node[1])
        b = Daemon(name_b, extra=["--l3", "redis://%s:%d" % (net.store[1], r.port), "--l3-admit",
                                  "none"] + l3, **node_b)
        procs.append(b)
        assert "l3: lookups ask at " in b.log() and "/kvtier-l3.%s\n" % name_b in b.log(), \
            b.log()
        assert "1 node (%s:%d)" % (net.store[1], r.port) in b.log(), b.log()
        ranks_b = [Rank(name_b, 0, k) for k in range(WORLD)]
        procs.extend(ranks_b)
        s = scheduler(name_b, 0)
        procs.append(s)

        def promoted_at(keys, want, depth):
            def f():
                s.step([])
                got = s.lookup_ex(keys, first_depth=depth)
                if got.hits == want:
                    got.release()
                    return got
                got.release()
                return None
            return f

        def promoted(keys, want):
            def f():
                s.step([])
                got = s.lookup_ex(keys)
                if got.hits == want:
                    return got
                assert got.hits + got.pending <= len(keys)
                got.release()
                return None
            return f

        def load_exact(keys, ranks, seed, what):
            """Asks again each step until all 8 are hits; node B's ranks
            load them: node A's bytes, exactly."""
            lease = until(promoted(keys, 8), what)
            lid = lease.hand_off()
            s.step([lease])
            for k in ranks:
                assert k.cmd(cmd="load", lease=lid, chunks=8)["sha"] == \
                    expected_sha(k.r, seed, 8), "rank %d loaded other bytes (%s)" % (k.r, what)

        keys = s.hash_tokens(prompt(8, seed=21))
        first = s.lookup_ex(keys)
        assert (first.hits, first.pending, first.requested) == (0, 8, 8), \
            (first.hits, first.pending, first.requested)
        first.release()
        load_exact(keys, ranks_b, 21, "node B's lookups to hit A's chunks")
        _, m = b.get("/metrics")
        assert metric(m, "kvtier_l3_gets_total") == 8
        assert metric(m, "kvtier_l3_asks_total") >= 8
        assert metric(m, "kvtier_l3_askers") == 1
        assert metric(m, "kvtier_l3_get_duration_seconds_count") == 8
        assert metric(m, "kvtier_l3_refused_total") == 0
        if shutil.which("promtool"):
            p = subprocess.run(["promtool", "check", "metrics"], input=m, capture_output=True,
                               text=True, timeout=30)
            assert p.returncode == 0, p.stdout + p.stderr
        # kvtier-stat, which reads the segment, asks the daemon for the L3's line
        st = subprocess.run([KVTIER_STAT, name_b], capture_output=True, text=True, timeout=30)
        assert st.returncode == 0, st.stderr
        l3line = [ln for ln in st.stdout.splitlines() if ln.startswith("l3 ")]
        assert l3line and " up  redis (one node)" in l3line[0] and " 8 got " in l3line[0], \
            st.stdout
        st = subprocess.run([KVTIER_STAT, name], capture_output=True, text=True, timeout=30)
        assert " 32 put " in [ln for ln in st.stdout.splitlines() if ln.startswith("l3 ")][0]

        # keys that do not start the prompt: asked at their depth
        # (first_depth), they are hits; asked as if they did, each object's
        # header names another depth -- refused, never served
        tail = s.hash_tokens(prompt(8, seed=24))[2:]
        until(promoted_at(tail, 6, 2), "the prefix's tail asked at its depth")
        wrong = s.hash_tokens(prompt(8, seed=25))[2:]
        got = s.lookup_ex(wrong)
        assert got.pending == 6, got.pending
        got.release()

        def settled():
            g = s.lookup_ex(wrong)
            g.release()
            assert g.hits == 0, "a chunk got at the wrong depth was served"
            return g.pending == 0

        until(settled, "the wrongly asked chunks to be refused")
        assert metric(b.get("/metrics")[1], "kvtier_l3_refused_total") >= 6

        # a prefix no node has: asked, answered missing, then not pending
        cold = s.hash_tokens(prompt(4, seed=23))
        got = s.lookup_ex(cold)
        assert (got.hits, got.pending) == (0, 4), (got.hits, got.pending)
        got.release()

        def answered():
            g = s.lookup_ex(cold)
            g.release()
            return g.pending == 0 and g.hits == 0

        until(answered, "the cold prefix to be answered missing")
        assert metric(b.get("/metrics")[1], "kvtier_l3_misses_total") >= 1
        # a long one: asked whole, in several messages of 64
        long_cold = s.hash_tokens(prompt(100, seed=26))
        got = s.lookup_ex(long_cold)
        assert (got.hits, got.pending, got.requested) == (0, 100, 100), \
            (got.hits, got.pending, got.requested)
        got.release()

        # node B's kvtierd killed -9 with gets in flight
        for x in ranks_b:
            x.close()
        s.close()
        assert b.stop() == 0
        assert not [f for f in side_files(name_b) if os.path.exists(f)]  # removed at a stop
        px = TearProxy(r.port, net.store[1])
        procs.append(px)
        b2 = Daemon(name_b, extra=["--l3", "redis://%s:%d" % (net.store[1], px.port),
                                   "--l3-admit", "none"] + l3, **node_b)
        procs.append(b2)
        s = scheduler(name_b, 0)
        procs.append(s)
        keys = s.hash_tokens(prompt(8, seed=22))
        px.armed = True
        got = s.lookup_ex(keys)
        assert (got.hits, got.pending) == (0, 8), (got.hits, got.pending)
        got.release()
        assert px.torn.wait(T), "no get reached the store"
        until(lambda: metric(b2.get("/metrics")[1], "kvtier_l3_inflight") > 0,
              "gets in flight")
        b2.p.kill()
        b2.p.wait()
        # the chunk whose reply was cut, and those after it: never hits
        # (the ones before it were got whole and checked: hits, and the
        # loads below check their bytes too)
        for _ in range(5):
            g = s.lookup_ex(keys, promote=False)
            assert g.hits < 8, "a chunk half-got by a killed kvtierd was served"
            g.release()
            time.sleep(0.05)
        px.release()
        b3 = Daemon(name_b, extra=["--l3", "redis://%s:%d" % (net.store[1], r.port),
                                   "--l3-admit", "none"] + l3, **node_b)
        procs.append(b3)
        ranks_b = [Rank(name_b, 0, k) for k in range(WORLD)]
        procs.extend(ranks_b)
        load_exact(keys, ranks_b, 22, "the restarted kvtierd to get the chunks again")
        assert metric(b3.get("/metrics")[1], "kvtier_l3_refused_total") == 0
        for x in ranks_b + ranks_a:
            x.close()
        s.close()
        assert b3.stop() == 0
        assert a.stop() == 0
    finally:
        remove_segment(name_b)
        for f in side_files(name_b) + side_files(name):
            if os.path.exists(f):
                os.unlink(f)


def test_model_config_of_deepseek_v4(name, tmp_path):
    """DeepSeek V4's layout is the KV cache groups vLLM's allocator forms:
    kvtierd --model-config does not guess it (it names the connector's
    logged --group line), and with the --group flags it takes the config
    for the identity only."""
    cfg = os.path.join(HERE, "..", "numa", "data", "deepseek-v4-flash.json")
    p = subprocess.run([KVTIERD, "--segment", name, "--model-config", cfg, "--tp", "8"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode != 0
    assert "--group flags the connector logs" in p.stderr, p.stderr
    assert not any(os.path.exists(p) for p in segment_paths(name))
