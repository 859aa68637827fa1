"""kvtierd's LMCache front end (--lmcache-port) against LMCache's own
client: the pinned lmcache wheel (tests/lmcache/setup-venv.sh), its
ZeroMQ client and IPC descriptors, with CPU KV caches in POSIX shared
memory (cpu_shm) laid out as vLLM's CPU backend lays them out.  Every
client is a process of its own (tests/lmcache/lmc_client.py); the daemon
is the real kvtierd.  Run by scripts/test.sh with the venv's python;
KVTIER_BUILD names the build directory (default: build/)."""

import glob
import hashlib
import json
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
BUILD = os.environ.get("KVTIER_BUILD", os.path.join(REPO, "build"))
KVTIERD = os.path.join(BUILD, "tier", "daemon", "kvtierd")
T = 30.0

# vLLM CPU's per-layer cache [2, blocks, heads, block, head_size], fp16:
# a plane (K or V of a layer) holds HEADS * HEAD * 2 bytes a token
LAYERS, HEADS, HEAD, BLOCK, CHUNK = 4, 2, 8, 4, 16
BPT = HEADS * HEAD * 2
MODEL = "org/model-a"


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


class Daemon:
    def __init__(self, name, layers=2 * LAYERS, bpt=BPT, world=1, instances=2, slots=64,
                 extra=(), port=None, env=None):
        self.name = name
        self.port, self.http = port or free_port(), free_port()
        self.url = "tcp://127.0.0.1:%d" % self.port
        self.logf = tempfile.NamedTemporaryFile(prefix="kvtierd-lmc-", suffix=".log",
                                                delete=False)
        self.p = subprocess.Popen(
            [KVTIERD, "--segment", name, "--group", "%d:%d" % (layers, bpt), "--world",
             str(world), "--instances", str(instances), "--chunk-tokens", str(CHUNK),
             "--slots", str(slots), "--model", "lmc-test", "--http",
             "127.0.0.1:%d" % self.http, "--log", self.logf.name, "--lmcache-port",
             str(self.port), "--unlink", "--recreate", "--reap-interval", "0.1"] + list(extra),
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        until(lambda: self.p.poll() is not None or self.get("/healthcheck")[0] == 200,
              "kvtierd up")
        assert self.p.poll() is None, self.log()

    def get(self, path):
        try:
            with urllib.request.urlopen("http://127.0.0.1:%d%s" % (self.http, path),
                                        timeout=5) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    def metric(self, name):
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(name + " "):
                return float(line.split()[-1])
        raise AssertionError("no %s in /metrics" % name)

    def log(self):
        with open(self.logf.name) as f:
            return f.read()

    def close(self):
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=T)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()
                pytest.fail("kvtierd did not stop on SIGTERM")
        out = self.p.stdout.read()
        log = self.log()
        os.unlink(self.logf.name)
        # a clean stop (under a sanitizer's build, no report either)
        assert self.p.returncode == 0, "kvtierd exited %s:\n%s\n%s" % (
            self.p.returncode, out[-4000:], log[-4000:])


class Proc:
    """An LMCache client process (lmc_client.py)."""

    def __init__(self, url, env=None):
        self.p = subprocess.Popen([sys.executable, os.path.join(HERE, "lmc_client.py"), url],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.DEVNULL, text=True, env=env)

    def __call__(self, **cmd):
        self.p.stdin.write(json.dumps(cmd) + "\n")
        self.p.stdin.flush()
        line = self.p.stdout.readline()
        assert line, "the client process died (%s)" % cmd["op"]
        return json.loads(line)

    def ok(self, **cmd):
        r = self(**cmd)
        assert "err" not in r, r
        return r["ok"]

    def kill(self):
        self.p.kill()
        self.p.wait()
        # its KV cache's shared memory (LMCache's wrappers unlink it at exit)
        for n in glob.glob("/dev/shm/lmcache_kv_%d_*" % self.p.pid):
            os.unlink(n)

    def close(self):
        if self.p.poll() is None:
            try:
                self(op="exit")
            except (AssertionError, BrokenPipeError):
                pass
            self.p.wait(timeout=T)


def kv(p, seed=None, blocks=64, layout="HND"):
    return p.ok(op="kv", layers=LAYERS, blocks=blocks, heads=HEADS, block=BLOCK, head=HEAD,
                seed=seed, layout=layout)


@pytest.fixture
def daemon(request):
    d = Daemon("lmt%d" % os.getpid())
    yield d
    d.close()


@pytest.fixture
def procs():
    made = []

    def make(url, env=None):
        p = Proc(url, env)
        made.append(p)
        return p
    yield make
    for p in made:
        p.close()
    # none leaves its KV caches' shared memory behind: a name left
    # (/lmcache_kv_PID_N) fails a later client that gets the same pid
    left = [n for p in made for n in glob.glob("/dev/shm/lmcache_kv_%d_*" % p.p.pid)]
    for n in left:
        os.unlink(n)
    assert not left, left


def prompt(n_chunks, base=1000):
    return list(range(base, base + n_chunks * CHUNK))


def test_every_rpc_and_bytes_across_processes(daemon, procs):
    """A writer stores three chunks; a reader in another process looks them
    up and retrieves them into other blocks of its own KV cache: byte-exact.
    Every other RPC the engines' clients call answers as LMCache's server
    does."""
    a, b = procs(daemon.url), procs(daemon.url)
    assert a.ok(op="chunk") == CHUNK
    assert a.ok(op="rpc", name="noop") == "OK"
    assert a.ok(op="rpc", name="get_experimental") == []
    assert a.ok(op="rpc", name="ping", args=[None]) is True
    kv(a, seed=1)
    assert a.ok(op="register", iid=11, model=MODEL, world=1, groups_tpb=BLOCK) is None
    assert a.ok(op="rpc", name="ping", args=[11]) is True
    toks = prompt(3)
    blocks = list(range(1, 13))
    assert a.ok(op="store", model=MODEL, world=1, worker=0, tokens=toks, start=0, end=48,
                iid=11, blocks=blocks) == ["stub_ipc_handle", True]
    want = a.ok(op="bytes", blocks=blocks)

    kv(b)
    b.ok(op="register", iid=22, model=MODEL, world=1, groups_tpb=BLOCK)
    # a lookup, its result once, then 0 (LMCache's query semantics)
    assert b.ok(op="lookup", model=MODEL, world=1, tokens=toks + [7, 8, 9], end=51,
                rid="s1") == 3
    assert b.ok(op="query", rid="s1") == 0
    dst = list(range(20, 32))
    assert b.ok(op="bytes", blocks=dst) != want
    assert b.ok(op="retrieve", model=MODEL, world=1, worker=0, tokens=toks, start=0, end=48,
                rid="s1", iid=22, blocks=dst) == ["stub_ipc_handle", True]
    assert b.ok(op="bytes", blocks=dst) == want
    # a prefix that differs in chunk 1: one hit; another model name: none
    other = toks[:20] + [5] * 28
    assert b.ok(op="lookup", model=MODEL, world=1, tokens=other, end=48, rid="s2") == 1
    assert b.ok(op="lookup", model="org/model-b", world=1, tokens=toks, end=48,
                rid="s3") == 0
    # skip_first_n_tokens: the first block of the range is not written
    dst2 = list(range(40, 52))
    zero = b.ok(op="bytes", blocks=dst2[:1])
    assert b.ok(op="lookup", model=MODEL, world=1, tokens=toks, end=48, rid="s4") == 3
    assert b.ok(op="retrieve", model=MODEL, world=1, worker=0, tokens=toks, start=0, end=48,
                rid="s4", iid=22, blocks=dst2, skip=BLOCK)[1] is True
    assert b.ok(op="bytes", blocks=dst2[:1]) == zero
    assert b.ok(op="bytes", blocks=dst2[1:]) == a.ok(op="bytes", blocks=blocks[1:])
    # a retrieve of chunks nobody stored: a miss (ok false), the engine recomputes
    assert b.ok(op="retrieve", model=MODEL, world=1, worker=0, tokens=prompt(2, 9000),
                start=0, end=32, rid="s5", iid=22, blocks=dst[:8])[1] is False
    # the rest of the engines' calls
    assert b.ok(op="rpc", name="free_lookup_locks",
                key=dict(model=MODEL, world=1, tokens=toks, start=0, end=48, rid="s2")) is None
    assert b.ok(op="rpc", name="end_session", args=["s3"]) is None
    assert b.ok(op="rpc", name="report_block_allocation", args=[1, MODEL, []]) is None
    until(lambda: daemon.metric("kvtier_leases_live") == 0, "every lease released")
    # the front end's figures on /metrics
    assert daemon.metric("kvtier_lmcache_stored_total") == 3
    assert daemon.metric("kvtier_lmcache_retrieved_total") == 3 + 3
    assert daemon.metric("kvtier_lmcache_misses_total") == 1
    assert daemon.metric("kvtier_lmcache_clients") == 2
    # clear(): what was stored before is no longer served
    assert b.ok(op="rpc", name="clear", args=[False]) is None
    assert b.ok(op="lookup", model=MODEL, world=1, tokens=toks, end=48, rid="s6") == 0
    assert b.ok(op="rpc", name="unregister_kv_cache", args=[22]) is None
    # an unregistered instance: LMCache's (b"", False)
    assert b.ok(op="retrieve", model=MODEL, world=1, worker=0, tokens=toks, start=0, end=48,
                rid="s6", iid=22, blocks=dst) == ["", False]


def test_killed_client_frees_its_lookup_locks(daemon, procs):
    """A scheduler killed while its lookups hold chunks: kvtierd sees the
    connection go and releases their leases."""
    a = procs(daemon.url)
    kv(a, seed=2)
    a.ok(op="register", iid=11, model=MODEL, world=1, groups_tpb=BLOCK)
    toks = prompt(2)
    a.ok(op="store", model=MODEL, world=1, worker=0, tokens=toks, start=0, end=32, iid=11,
         blocks=list(range(1, 9)))
    s = procs(daemon.url)
    for i in range(3):
        assert s.ok(op="lookup", model=MODEL, world=1, tokens=toks, end=32, rid="r%d" % i) == 2
    assert daemon.metric("kvtier_leases_live") == 3
    s.kill()
    until(lambda: daemon.metric("kvtier_leases_live") == 0, "the killed client's leases")
    until(lambda: "a client went away: 3 lookup lease(s) released" in daemon.log(),
          "the disconnect's log line")
    assert daemon.metric("kvtier_lmcache_disconnects_total") >= 1


def test_restarted_kvtierd_gets_the_registration_back(procs):
    """kvtierd restarted on the same port under a live engine rank:
    LMCache's own heartbeat thread (its vLLM worker adapter's) has its ping
    answered false once by the new kvtierd, which knows no registration of
    that instance; on the next ping, true, LMCache's recovery callback
    registers the KV cache again, and the rank's stores and retrieves are
    served again, byte-exact.  (LMCache's own server answers every ping
    true: its client would be answered ok=false for ever.)"""
    name = "lmr%d" % os.getpid()
    d = Daemon(name)
    port = d.port
    a = procs(d.url)
    kv(a, seed=5)
    a.ok(op="register", iid=31, model=MODEL, world=1, groups_tpb=BLOCK)
    # (a ping's timeout is the interval: on a loaded machine one may time
    # out and the callback run again, so what counts is one run more)
    a.ok(op="heartbeat", interval=0.5)
    toks, blocks, dst = prompt(2, 5000), list(range(1, 9)), list(range(20, 28))
    store = dict(op="store", model=MODEL, world=1, worker=0, tokens=toks, start=0, end=32,
                 iid=31, blocks=blocks)
    assert a.ok(**store)[1] is True
    d.close()
    runs = a.ok(op="health")[1]
    d = Daemon(name, port=port)
    try:
        until(lambda: a.ok(op="health")[0] and a.ok(op="health")[1] > runs,
              "the client's registration again")
        assert "answered false once" in d.log()
        assert a.ok(**store)[1] is True
        assert a.ok(op="lookup", model=MODEL, world=1, tokens=toks, end=32, rid="rr") == 2
        assert a.ok(op="retrieve", model=MODEL, world=1, worker=0, tokens=toks, start=0,
                    end=32, rid="rr", iid=31, blocks=dst) == ["stub_ipc_handle", True]
        assert a.ok(op="bytes", blocks=dst) == a.ok(op="bytes", blocks=blocks)
    finally:
        d.close()


def test_long_prompt_208_chunks_exact(procs):
    """LMCache's #5151 shape: prompts of more than 114-128 chunks restored
    wrong.  208 chunks stored by one process, retrieved by another: every
    block byte-exact, and a retrieve of a later window of it too."""
    n = 208
    d = Daemon("lml%d" % os.getpid(), slots=512)
    try:
        blocks_n = n * (CHUNK // BLOCK)
        a, b = procs(d.url), procs(d.url)
        kv(a, seed=3, blocks=blocks_n + 8)
        a.ok(op="register", iid=1, model=MODEL, world=1, groups_tpb=BLOCK)
        toks = prompt(n, 50000)
        src = list(range(1, blocks_n + 1))
        assert a.ok(op="store", model=MODEL, world=1, worker=0, tokens=toks, start=0,
                    end=n * CHUNK, iid=1, blocks=src)[1] is True
        kv(b, blocks=blocks_n + 8)
        b.ok(op="register", iid=2, model=MODEL, world=1, groups_tpb=BLOCK)
        assert b.ok(op="lookup", model=MODEL, world=1, tokens=toks, end=n * CHUNK,
                    rid="long") == n
        dst = list(range(blocks_n + 7, 6, -1))[:blocks_n]  # other blocks, reversed order
        assert b.ok(op="retrieve", model=MODEL, world=1, worker=0, tokens=toks, start=0,
                    end=n * CHUNK, rid="long", iid=2, blocks=dst)[1] is True
        for lo in range(0, blocks_n, 128):
            hi = min(lo + 128, blocks_n)
            assert b.ok(op="bytes", blocks=dst[lo:hi]) == a.ok(op="bytes", blocks=src[lo:hi]), \
                "blocks %d..%d" % (lo, hi)
    finally:
        d.close()


def test_refusals_name_the_reason(daemon, procs):
    """What kvtierd does not serve is refused at once, the reason in the
    client's exception, never left to LMCache's 300 s timeout."""
    a = procs(daemon.url)
    # another layout than the segment's: the kvtierd line that would fit
    a.ok(op="kv", layers=LAYERS, blocks=16, heads=4, block=BLOCK, head=HEAD)
    r = a(op="register", iid=1, model=MODEL, world=1, groups_tpb=BLOCK)
    assert "kvtierd --group %d:%d --world 1 --chunk-tokens %d" % (2 * LAYERS, 2 * BPT, CHUNK) \
        in r["err"].replace("start kvtierd with", "kvtierd"), r
    # another world size
    kv(a)
    r = a(op="register", iid=1, model=MODEL, world=2, groups_tpb=BLOCK)
    assert "world_size 2: the segment is laid out for 1 ranks" in r["err"], r
    # NHD after HND under one model name
    a.ok(op="register", iid=1, model=MODEL, world=1, groups_tpb=BLOCK)
    b = procs(daemon.url)
    kv(b, layout="NHD")
    r = b(op="register", iid=2, model=MODEL, world=1, groups_tpb=BLOCK, layout="NHD")
    assert "was registered with another KV layout" in r["err"], r
    # a sliding-window group (vLLM's hybrid KV cache manager on): refused,
    # naming vLLM's switch that keeps every layer whole in one group
    r = a(op="register", iid=4, model=MODEL, world=1, groups_tpb=BLOCK, sw=64)
    assert "a sliding-window group" in r["err"] and \
        "--disable-hybrid-kv-cache-manager" in r["err"], r
    # engine-driven transfers: the setting that selects lmcache_driven
    r = a(op="rpc", name="unregister_kv_cache_engine_driven_context", args=[1])
    assert "lmcache.mp.mp_transfer_mode=lmcache_driven" in r["err"], r
    # an older client's key (no num_kv_readers)
    r = a(op="lookup", model=MODEL, world=1, tokens=prompt(1), end=16, rid="x", readers=0)
    assert "older than 0.5.6" in r["err"], r
    # another user's memory (the test runs as root, as kvtierd: a root
    # kvtierd would map anyone's)
    if os.geteuid() == 0:
        c = procs(daemon.url)
        for n in kv(c):
            os.chown("/dev/shm" + n, 65534, 65534)
        r = c(op="register", iid=3, model=MODEL, world=1, groups_tpb=BLOCK)
        assert "belongs to uid 65534, kvtierd runs as uid 0" in r["err"], r
    # the daemon still serves
    assert a.ok(op="chunk") == CHUNK


def test_forged_block_size_refused_not_fatal(daemon, procs):
    """A descriptor whose MLA view claims blocks of 2^32 tokens (which
    once truncated to a block size of 0 and divided by it): refused by
    name, before anything is mapped; kvtierd serves on (and stops cleanly:
    the fixture's close checks its exit)."""
    a = procs(daemon.url)
    r = a(op="forged", iid=61, shape=[1, 2 ** 32, 1], stride=[2 ** 32, 1, 1])
    assert "blocks of 4294967296 tokens" in r.get("err", ""), r
    assert a.ok(op="chunk") == CHUNK


def test_healthcheck_in_lmcache_form(daemon):
    assert daemon.get("/healthcheck") == (200, '{"status":"healthy"}')


def test_client_of_another_version_refused(daemon, procs):
    """LMCache 0.5.0's own client numbers its operations otherwise: its
    get_chunk_size (#18) is 0.5.6's prepare_retrieve, its noop (#21)
    0.5.6's get_chunk_size.  kvtierd refuses its first message, naming
    both numberings, and every later one: the noop that would have parsed
    is not answered either (never half-served).  A 0.5.6 client is served
    on beside it."""
    old = os.path.join(os.path.dirname(os.path.dirname(sys.executable)), "lmcache-0.5.0")
    assert os.path.isdir(old), "tests/lmcache/setup-venv.sh installs LMCache 0.5.0 there"
    env = dict(os.environ, PYTHONPATH=old)
    p = subprocess.run([sys.executable, os.path.join(HERE, "old_client.py"), daemon.url, "3"],
                       env=env, capture_output=True, text=True, timeout=120)
    out = p.stdout
    assert "lmcache from %s" % os.path.join(old, "lmcache") in out, out
    # no answer it can read: 0.5.0 decodes the reply's operation as its enum
    assert "GET_CHUNK_SIZE raised" in out and "NOOP raised" in out, out
    log = daemon.log()
    assert "a client of another LMCache version: operation #18 came with 0 payload " \
        "frame(s); in LMCache 0.5.6's protocol #18 is prepare_retrieve and takes 2 (in " \
        "LMCache 0.5.0's numbering, #18 was get_chunk_size)" in log, log
    # 0.5.0's polling thread died on the reply (its traceback names the
    # decode), so its noop never left; the same two frames, sent raw:
    import msgspec
    import zmq
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.connect(daemon.url)
    try:
        for uid, op in ((0, 18), (1, 21)):
            s.send_multipart([msgspec.msgpack.encode(uid), msgspec.msgpack.encode(op)])
            assert s.poll(int(T * 1000)), "no answer to #%d" % op
            fr = s.recv_multipart()
            assert len(fr) == 2 and msgspec.msgpack.decode(fr[0]) == uid, fr
            reason = msgspec.msgpack.decode(fr[1])
            assert isinstance(reason, str) and "another LMCache version" in reason, reason
    finally:
        s.close(linger=0)
    log = daemon.log()
    assert "refused get_chunk_size: a client of another LMCache version" in log, log
    a = procs(daemon.url)
    assert a.ok(op="chunk") == CHUNK


def test_more_clients_than_the_peer_table(daemon):
    """kvtierd keeps a table of its clients (256) only to release what each
    holds when it goes away.  300 clients connected at once, none holding
    anything: every one is answered (an entry that holds nothing is taken
    for a new client), none refused as one too many."""
    import msgspec
    import zmq
    ctx = zmq.Context.instance()
    socks = []
    try:
        for i in range(300):
            s = ctx.socket(zmq.DEALER)
            s.connect(daemon.url)
            socks.append(s)
            s.send_multipart([msgspec.msgpack.encode(i), msgspec.msgpack.encode("noop")])
            assert s.poll(int(T * 1000)), "no answer to client %d" % i
            fr = s.recv_multipart()
            assert [msgspec.msgpack.decode(x) for x in fr] == [i, "noop", "OK"], \
                (i, [msgspec.msgpack.decode(x) for x in fr])
    finally:
        for s in socks:
            s.close(linger=0)
    assert "clients are connected" not in daemon.log()


def test_two_ranks_share_one_lookup(procs):
    """World 2: a chunk is a hit only once both ranks stored their shard;
    one scheduler lookup's locks serve both ranks' retrieves, and are
    released when the second rank has loaded (no free_lookup_locks, no
    end_session)."""
    d = Daemon("lm2%d" % os.getpid(), world=2)
    try:
        w = [procs(d.url), procs(d.url)]
        for r in (0, 1):
            kv(w[r], seed=10 + r)
            w[r].ok(op="register", iid=100 + r, model=MODEL, world=2, groups_tpb=BLOCK)
        toks, src, dst = prompt(3), list(range(1, 13)), list(range(30, 42))
        s = procs(d.url)
        w[0].ok(op="store", model=MODEL, world=2, worker=0, tokens=toks, start=0, end=48,
                iid=100, blocks=src)
        assert s.ok(op="lookup", model=MODEL, world=2, tokens=toks, end=48, rid="a") == 0
        w[1].ok(op="store", model=MODEL, world=2, worker=1, tokens=toks, start=0, end=48,
                iid=101, blocks=src)
        assert s.ok(op="lookup", model=MODEL, world=2, tokens=toks, end=48, rid="b") == 3
        assert d.metric("kvtier_leases_live") == 1
        rd = [procs(d.url), procs(d.url)]
        for r in (0, 1):
            kv(rd[r])
            rd[r].ok(op="register", iid=200 + r, model=MODEL, world=2, groups_tpb=BLOCK)
            assert rd[r].ok(op="retrieve", model=MODEL, world=2, worker=r, tokens=toks,
                            start=0, end=48, rid="b", iid=200 + r, blocks=dst)[1] is True
            assert rd[r].ok(op="bytes", blocks=dst) == w[r].ok(op="bytes", blocks=src)
        until(lambda: d.metric("kvtier_leases_live") == 0, "the lease released by the loads")
    finally:
        d.close()


def test_sglang_pools_stored_and_retrieved_exact(procs):
    """SGLang's MHA pools as LMCache's SGLang connectors register them
    (engine sglang, every layer's K then V; [token slots, heads, head_dim]
    with the page size in the hints, or the unified connector's [pages,
    page, heads, head_dim] views): pages stored by one process are
    retrieved byte-exact into other pages by another, through either
    connector's registration, the retrieve's skipped pages left alone; a
    vLLM cache under the same model name (another layout) is refused by
    name."""
    daemon = Daemon("lms%d" % os.getpid(), instances=3)
    try:
        model = "org/model-sgl"
        a, b = procs(daemon.url), procs(daemon.url)
        kv(a, seed=21, layout="SGL")
        a.ok(op="register", iid=41, model=model, world=1, layout="SGL")
        toks, src = prompt(4, 3000), list(range(1, 17))
        assert a.ok(op="store", model=model, world=1, worker=0, tokens=toks, start=0, end=64,
                    iid=41, blocks=src)[1] is True
        kv(b, layout="SGL")
        b.ok(op="register", iid=42, model=model, world=1, layout="SGL")
        dst = list(range(40, 56))
        assert b.ok(op="lookup", model=model, world=1, tokens=toks, end=64, rid="g1") == 4
        before = b.ok(op="bytes", blocks=dst[:4])
        # SGLang's retrieve of a prompt whose first chunk its radix tree has:
        # from token 16, the first chunk's pages skipped
        assert b.ok(op="retrieve", model=model, world=1, worker=0, tokens=toks, start=16,
                    end=64, rid="g1", iid=42, blocks=dst[4:], skip=0)[1] is True
        assert b.ok(op="bytes", blocks=dst[:4]) == before
        assert b.ok(op="bytes", blocks=dst[4:]) == a.ok(op="bytes", blocks=src[4:])
        # SGLang 0.5.23's unified connector (pages as [pages, page, heads,
        # head_dim] views, an engine group): the same pages, the same chunks
        u = procs(daemon.url)
        kv(u, layout="SGLU")
        u.ok(op="register", iid=44, model=model, world=1, layout="SGLU")
        assert u.ok(op="lookup", model=model, world=1, tokens=toks, end=64, rid="g2") == 4
        assert u.ok(op="retrieve", model=model, world=1, worker=0, tokens=toks, start=0,
                    end=64, rid="g2", iid=44, blocks=dst)[1] is True
        assert u.ok(op="bytes", blocks=dst) == a.ok(op="bytes", blocks=src)
        # a vLLM cache under the SGLang layout's model name: refused, named
        c = procs(daemon.url)
        kv(c)
        r = c(op="register", iid=43, model=model, world=1, groups_tpb=BLOCK)
        assert "another KV layout" in r.get("err", ""), r
    finally:
        daemon.close()


def test_vllm_mla_with_dsa_indexer_caches(procs):
    """vLLM's caches of a DeepSeek V3.2 / GLM-5 model as LMCache's vLLM
    adapter registers them: the MLA latent a layer and the DSA indexer's
    cache on some layers (GLM-5.2: 21 of 78), [blocks, block, bytes]:
    the indexer caches are the segment's second group, loaded with the
    latent's blocks, byte-exact in another process."""
    idx = 132                          # a token's fp8 index key and its scale
    d = Daemon("lmv%d" % os.getpid(), layers=LAYERS, bpt=BPT,
               extra=["--group", "2:%d" % idx, "--replicated"])
    try:
        model = "org/glm-like"
        a, b = procs(d.url), procs(d.url)
        for p, seed in ((a, 41), (b, None)):
            p.ok(op="kv", layers=LAYERS, blocks=32, heads=HEADS, block=BLOCK, head=HEAD,
                 seed=seed, layout="MLA", index=idx, index_layers=2)
        a.ok(op="register", iid=61, model=model, world=1, groups_tpb=BLOCK, layout="MLA")
        b.ok(op="register", iid=62, model=model, world=1, groups_tpb=BLOCK, layout="MLA")
        toks, src, dst = prompt(3, 7000), list(range(1, 13)), list(range(16, 28))
        assert a.ok(op="store", model=model, world=1, worker=0, tokens=toks, start=0, end=48,
                    iid=61, blocks=src)[1] is True
        for only in ("indexer", None):
            assert b.ok(op="bytes", blocks=dst, only=only) != \
                a.ok(op="bytes", blocks=src, only=only)
        assert b.ok(op="lookup", model=model, world=1, tokens=toks, end=48, rid="v1") == 3
        assert b.ok(op="retrieve", model=model, world=1, worker=0, tokens=toks, start=0,
                    end=48, rid="v1", iid=62, blocks=dst)[1] is True
        for only in ("indexer", None):
            assert b.ok(op="bytes", blocks=dst, only=only) == \
                a.ok(op="bytes", blocks=src, only=only)
        assert d.metric("kvtier_lmcache_misses_total") == 0
    finally:
        d.close()


def sglang_mla_engines(procs, d, model, seed, iid, base):
    """An SGLang MLA writer (instance iid, its pool filled from seed) that
    stored a 4-chunk prompt from blocks 1-16, and the two TP ranks of a
    reader engine (instances iid+1, iid+2), registered, their pools zero:
    (writer, (rank 0, rank 1), tokens, source blocks, destination blocks)."""
    a, readers = procs(d.url), (procs(d.url), procs(d.url))
    kv(a, seed=seed, layout="SGLM")
    a.ok(op="register", iid=iid, model=model, world=1, layout="SGLM")
    toks, src, dst = prompt(4, base), list(range(1, 17)), list(range(30, 46))
    assert a.ok(op="store", model=model, world=1, worker=0, tokens=toks, start=0, end=64,
                iid=iid, blocks=src)[1] is True
    for i, r in enumerate(readers):
        kv(r, layout="SGLM")
        r.ok(op="register", iid=iid + 1 + i, model=model, world=1, layout="SGLM")
    return a, readers, toks, src, dst


def test_sglang_mla_pool_read_by_every_tp_rank(procs):
    """SGLang's MLA pool as its unified connector registers it (engine
    sglang, "unified", per layer [pages, page, width]; one KV world, the
    TP ranks its num_kv_readers): one rank's pages are read byte-exact by
    both ranks of another engine, each into its own pool, kept once
    (--replicated)."""
    d = Daemon("lmm%d" % os.getpid(), layers=LAYERS, bpt=BPT, instances=3,
               extra=["--replicated"])
    try:
        model = "org/model-sgl-mla"
        a, (r0, r1), toks, src, dst = sglang_mla_engines(procs, d, model, 31, 51, 5000)
        for r in (r0, r1):
            assert r.ok(op="bytes", blocks=dst) != a.ok(op="bytes", blocks=src)
        assert r0.ok(op="lookup", model=model, world=1, tokens=toks, end=64, rid="m1",
                     readers=2) == 4
        for iid, r in ((52, r0), (53, r1)):
            assert r.ok(op="retrieve", model=model, world=1, worker=0, tokens=toks, start=0,
                        end=64, rid="m1", iid=iid, blocks=dst)[1] is True
            assert r.ok(op="bytes", blocks=dst) == a.ok(op="bytes", blocks=src)
        assert d.metric("kvtier_lmcache_misses_total") == 0
        until(lambda: d.metric("kvtier_leases_live") == 0, "the lookup's lease released")
    finally:
        d.close()


def test_lookup_locks_hold_for_every_reader(procs):
    """A lookup with num_kv_readers N over one replicated KV world locks its
    hits for N retrieves (LMCache's read locks): after the first TP rank
    loaded, a tier filled with other prompts evicts everything it may, and
    the second rank's retrieve is still a hit, byte-exact -- not a lookup
    of its own that finds the chunks gone.  free_lookup_locks then
    releases what no reader took."""
    d = Daemon("lmr%d" % os.getpid(), layers=LAYERS, bpt=BPT, instances=3, slots=8,
               extra=["--replicated"])
    try:
        model = "org/model-readers"
        a, (r0, r1), toks, src, dst = sglang_mla_engines(procs, d, model, 37, 61, 7000)
        assert r0.ok(op="lookup", model=model, world=1, tokens=toks, end=64, rid="n1",
                     readers=2) == 4
        assert r0.ok(op="retrieve", model=model, world=1, worker=0, tokens=toks, start=0,
                      end=64, rid="n1", iid=62, blocks=dst)[1] is True
        for seed in range(4):  # 16 chunks of other prompts through an 8-chunk tier
            assert a.ok(op="store", model=model, world=1, worker=0,
                        tokens=prompt(4, 8000 + 100 * seed), start=0, end=64, iid=61,
                        blocks=src)[1] is True
        assert r1.ok(op="retrieve", model=model, world=1, worker=0, tokens=toks, start=0,
                      end=64, rid="n1", iid=63, blocks=dst)[1] is True
        assert r1.ok(op="bytes", blocks=dst) == a.ok(op="bytes", blocks=src)
        assert d.metric("kvtier_lmcache_misses_total") == 0
        until(lambda: d.metric("kvtier_leases_live") == 0, "both readers' locks released")
        # three readers: three locks, all released by free_lookup_locks
        assert r0.ok(op="lookup", model=model, world=1, tokens=toks, end=64, rid="n2",
                     readers=3) == 4
        assert d.metric("kvtier_leases_live") == 3
        assert r0.ok(op="rpc", name="free_lookup_locks",
                     key=dict(model=model, world=1, tokens=toks, start=0, end=64,
                              rid="n2")) is None
        until(lambda: d.metric("kvtier_leases_live") == 0, "free_lookup_locks released all 3")
    finally:
        d.close()


def test_atom_mla_caches_through_lmcache_atom_adapters(procs):
    """AMD's ATOM through LMCache's own ATOM adapters (its worker adapter
    registering the per-layer MLA latent caches [blocks, block, width],
    its scheduler adapter looking up): a writer's blocks retrieved
    byte-exact by a reader in another process; the latent kept once for
    every rank (--replicated).  A DeepSeek V3.2 engine's DSA index cache
    beside each layer's latent: a second group of the segment, stored and
    retrieved with the latent's blocks, byte-exact; on a segment without
    that group, refused with the line that fits."""
    width, index_width = 24, 66       # fp16: 48 and 132 bytes a token a layer
    d = Daemon("lma%d" % os.getpid(), layers=LAYERS, bpt=width * 2, extra=["--replicated"])
    try:
        model = "org/atom-mla"
        w, r = procs(d.url), procs(d.url)
        w.ok(op="atom", model=model, world=1, worker=0, layers=LAYERS, blocks=32,
             block=BLOCK, width=width, seed=9)
        toks, src, dst = prompt(3, 6000), list(range(1, 13)), list(range(16, 28))
        assert w.ok(op="atom_store", rid="a1", tokens=toks, blocks=src, start=0,
                    end=48) is True
        r.ok(op="atom", model=model, world=1, worker=0, layers=LAYERS, blocks=32,
             block=BLOCK, width=width)
        assert r.ok(op="bytes", blocks=dst) != w.ok(op="bytes", blocks=src)
        assert r.ok(op="atom_lookup", rid="a2", tokens=toks + [1, 2]) == 48
        assert r.ok(op="atom_retrieve", rid="a2", tokens=toks, blocks=dst, start=0,
                    end=48) is True
        assert r.ok(op="bytes", blocks=dst) == w.ok(op="bytes", blocks=src)
        x = procs(d.url)
        e = x(op="atom", model="org/atom-dsa", world=1, worker=0, layers=LAYERS, blocks=32,
              block=BLOCK, width=width, index_width=index_width)
        assert "--group %d:%d --group %d:%d --replicated" % (
            LAYERS, width * 2, LAYERS, index_width * 2) in e.get("err", ""), e
    finally:
        d.close()
    d = Daemon("lmx%d" % os.getpid(), layers=LAYERS, bpt=width * 2,
               extra=["--group", "%d:%d" % (LAYERS, index_width * 2), "--replicated"])
    try:
        model = "org/atom-dsa"
        w, r = procs(d.url), procs(d.url)
        w.ok(op="atom", model=model, world=1, worker=0, layers=LAYERS, blocks=32,
             block=BLOCK, width=width, index_width=index_width, seed=11)
        toks, src, dst = prompt(3, 6100), list(range(1, 13)), list(range(16, 28))
        assert w.ok(op="atom_store", rid="x1", tokens=toks, blocks=src, start=0,
                    end=48) is True
        r.ok(op="atom", model=model, world=1, worker=0, layers=LAYERS, blocks=32,
             block=BLOCK, width=width, index_width=index_width)
        # each layer's latent and index cache, every block: can differ
        assert r.ok(op="bytes", blocks=dst, only="index") != \
            w.ok(op="bytes", blocks=src, only="index")
        assert r.ok(op="atom_lookup", rid="x2", tokens=toks) == 48
        assert r.ok(op="atom_retrieve", rid="x2", tokens=toks, blocks=dst, start=0,
                    end=48) is True
        assert r.ok(op="bytes", blocks=dst, only="latent") == \
            w.ok(op="bytes", blocks=src, only="latent")
        assert r.ok(op="bytes", blocks=dst, only="index") == \
            w.ok(op="bytes", blocks=src, only="index")
        assert d.metric("kvtier_lmcache_misses_total") == 0
    finally:
        d.close()


def test_readme_kvtierd_line_serves_a_vllm_cpu_engine_shape(procs, tmp_path):
    """The README's `lmcache server` replacement, run as written (its
    segment, ports, log and capacity this test's): it serves a vLLM CPU
    engine's cache of Llama-3.1-8B's shape (32 layers, 8 KV heads of 128,
    bf16: one plane a layer of 4,096 bytes a token) and answers
    /healthcheck as LMCache's server does."""
    sys.path.insert(0, os.path.join(REPO, "tests", "readme"))
    import readme_blocks as rb
    env, argv = rb.command(rb.block("kvtierd --segment lmcache --group 32:4096"))
    port, http = free_port(), free_port()
    argv = [KVTIERD] + argv[1:]
    for flag, value in (("--segment", "lmr%d" % os.getpid()), ("--lmcache-port", str(port)),
                        ("--http", "127.0.0.1:%d" % http), ("--log", str(tmp_path / "d.log")),
                        ("--tier-gib", "0.25")):
        argv = rb.replace_arg(argv, flag, value)
    p = subprocess.Popen(argv + ["--unlink"], env=dict(os.environ, **env))
    try:
        url = "tcp://127.0.0.1:%d" % port
        until(lambda: p.poll() is not None or _get(http, "/healthcheck")[0] == 200,
              "the README's kvtierd")
        assert p.poll() is None, (tmp_path / "d.log").read_text()
        assert _get(http, "/healthcheck") == (200, '{"status":"healthy"}')
        a = procs(url)
        assert a.ok(op="chunk") == 256
        a.ok(op="kv", layers=32, blocks=40, heads=8, block=16, head=128, seed=5, layout="CPU4")
        a.ok(op="register", iid=1, model="meta-llama/Llama-3.1-8B", world=1, groups_tpb=16,
             layout="CPU4")
        toks = prompt(2 * 256 // CHUNK, 7)
        src = list(range(1, 33))
        assert a.ok(op="store", model="meta-llama/Llama-3.1-8B", world=1, worker=0,
                    tokens=toks, start=0, end=512, iid=1, blocks=src)[1] is True
        assert a.ok(op="lookup", model="meta-llama/Llama-3.1-8B", world=1, tokens=toks,
                    end=512, rid="q") == 2
    finally:
        p.send_signal(signal.SIGTERM)
        p.wait(timeout=T)


def _get(port, path):
    try:
        with urllib.request.urlopen("http://127.0.0.1:%d%s" % (port, path), timeout=5) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


# The project's fake CUDA driver (tests/fakes/fake_cuda.c), for the GPU
# descriptors: the engine processes use it through fake_gpu.py, kvtierd as
# its libcuda (KVTIER_CUDA_LIBRARY); its IPC handles cross processes as
# the driver's do (memfds, events on shared pages).
# (A sanitized build's engines, plain Python processes, load its plain twin.)
FAKE_CUDA = os.path.join(BUILD, "tests", "dma", "fakes", "cuda", "libcuda.so.1")
FAKE_CUDA_PLAIN = os.path.join(BUILD, "tests", "dma", "fakes", "cuda-plain", "libcuda.so.1")


def gpu_env(**more):
    if not os.path.exists(FAKE_CUDA):
        pytest.skip("no fake libcuda in this build (built without the CUDA headers)")
    engine = FAKE_CUDA_PLAIN if os.path.exists(FAKE_CUDA_PLAIN) else FAKE_CUDA
    e = dict(os.environ, KVTIER_FAKE_CUDA=engine, KVTIER_CUDA_LIBRARY=FAKE_CUDA,
             FAKE_CUDA_DEVICES="2")
    e.update(more)
    return e


# ROCm: the fake HSA runtime and HIP on it (tests/fakes/fake_hsa.c,
# fake_hip.c), kvtierd's hsa backend opening HIP's IPC handles; kvtierd
# keeps the fake libcuda too (its devices' UUIDs are not the engine's: the
# hsa backend is the one that has them).
FAKES = os.path.join(BUILD, "tests", "dma", "fakes")


def hip_env(engine=False, **more):
    sfx = "-plain" if engine and os.path.exists(os.path.join(FAKES, "hip-plain")) else ""
    hip = os.path.join(FAKES, "hip" + sfx, "libamdhip64.so.5")
    if not os.path.exists(hip):
        pytest.skip("no fake HIP in this build (built without the HIP headers)")
    e = gpu_env(KVTIER_HSA_LIBRARY=os.path.join(FAKES, "hsa56" + sfx, "libhsa-runtime64.so.1"),
                FAKE_HSA_GPUS="2", **more)
    e["KVTIER_FAKE_HIP" if engine else "KVTIER_HIP_LIBRARY"] = hip
    return e


def gpu_kv(p, seed, **more):
    return p.ok(op="gpu_kv", layers=LAYERS, blocks=64, heads=HEADS, block=BLOCK, head=HEAD,
                seed=seed, **more)


@pytest.mark.parametrize("mode", ["ipc_events", "timeline", "rocm"])
def test_gpu_descriptors_ordered_by_the_engines_events(procs, mode):
    """A GPU engine's KV cache as LMCache's adapters register it -- torch's
    "cuda" descriptors (one cudaMalloc block, a layer at an offset) from
    one process, "cuda_raw" ones (a driver handle a layer, on the second
    GPU) from another -- served in lmcache_driven mode: kvtierd opens the
    engines' memory through the driver's IPC, copies with the cuda backend,
    and orders it by the engines' events both ways.
      * A store waits for the engine's event: the blocks a late forward
        pass (a fake kernel on the engine's stream) is still writing are
        saved as it wrote them, not as they were.
      * The answer's completion event completes only after the copies: the
        reader's stream waits on it, then reads its blocks at once, while
        kvtierd's copies run late (FAKE_GPU_JITTER_US) -- byte-exact.
    timeline: the same with LMCache's isolated-IPC events (timeline
    semaphores in IPC memory, for engines in containers without the
    host's /dev/shm), answered in the same form (81 bytes).
    rocm: ROCm engines -- the same descriptors with HIP's handles inside
    (torch's ROCm build), kvtierd finding the device among the hsa
    backend's, opening them with HIP, copying with SDMA, ordering with
    HIP's events."""
    timeline = mode == "timeline"
    env = hip_env if mode == "rocm" else lambda engine=False, **more: gpu_env(**more)
    d = Daemon("lmg%d" % os.getpid(), env=env(FAKE_GPU_JITTER_US="3000"))
    try:
        a, b = procs(d.url, env(engine=True)), procs(d.url, env(engine=True))
        gpu_kv(a, 1)
        gpu_kv(b, 2, raw=True, device=1)
        assert a.ok(op="register", iid=31, model=MODEL, world=1, groups_tpb=BLOCK) is None
        assert b.ok(op="register", iid=32, model=MODEL, world=1, groups_tpb=BLOCK) is None
        key = dict(model=MODEL, world=1, worker=0, start=0, end=48, timeline=timeline)
        done = [81 if timeline else 64, True]
        toks, src, dst = prompt(3), list(range(1, 13)), list(range(20, 32))
        assert a.ok(op="gpu_store", tokens=toks, iid=31, blocks=src, **key) == done
        want = a.ok(op="bytes", blocks=src)
        assert b.ok(op="lookup", model=MODEL, world=1, tokens=toks, end=48, rid="g1") == 3
        assert b.ok(op="bytes", blocks=dst) != want
        assert b.ok(op="gpu_retrieve", tokens=toks, rid="g1", iid=32, blocks=dst,
                    **key) == done
        assert b.ok(op="bytes", blocks=dst) == want

        # the forward pass writes blocks 40..51 late (0.3 s); its event is
        # recorded after it, and the store sent at once
        late = list(range(40, 52))
        a.ok(op="gpu_late", block_ids=late, byte=0x5A, delay_us=300000)
        toks2 = prompt(3, 5000)
        assert a.ok(op="gpu_store", tokens=toks2, iid=31, blocks=late, **key) == done
        assert b.ok(op="lookup", model=MODEL, world=1, tokens=toks2, end=48, rid="g2") == 3
        assert b.ok(op="gpu_retrieve", tokens=toks2, rid="g2", iid=32, blocks=dst,
                    **key) == done
        n = LAYERS * 2 * len(late) * HEADS * BLOCK * HEAD * 2
        assert b.ok(op="bytes", blocks=dst) == hashlib.sha256(b"\x5a" * n).hexdigest()
        assert d.metric("kvtier_lmcache_retrieved_total") == 6
        until(lambda: d.metric("kvtier_leases_live") == 0, "every lease released")
        # an engine killed: its registration goes (its memory closed, its
        # fence gone -- a sanitized kvtierd's exit says what leaked)
        b.kill()
        until(lambda: d.metric("kvtier_lmcache_clients") == 1, "the killed engine gone")
    finally:
        d.close()


def test_rocm_descriptors_checked_against_the_runtime(procs):
    """ROCm's descriptors are checked as NVIDIA's: a raw descriptor that
    claims more than its allocation holds (HIP's hipMemGetAddressRange
    says how much), refused by name.  And GPUs the driver gives no
    unique id ("GPU-XX", the same UUID on every one): kvtierd cannot tell
    which is the engine's, and says so rather than guess."""
    d = Daemon("lmr%d" % os.getpid(), env=hip_env())
    try:
        a = procs(d.url, hip_env(engine=True))
        gpu_kv(a, 1, raw=True, forge=True)
        r = a(op="register", iid=51, model=MODEL, world=1, groups_tpb=BLOCK)
        assert "of an allocation of" in r.get("err", ""), r
    finally:
        d.close()
    d = Daemon("lms%d" % os.getpid(), env=hip_env(FAKE_HSA_UUID_XX="1"))
    try:
        a = procs(d.url, hip_env(engine=True, FAKE_HSA_UUID_XX="1"))
        assert gpu_kv(a, 1) == "58580000-0000-0000-0000-000000000000"  # "XX", as ROCm gives
        r = a(op="register", iid=52, model=MODEL, world=1, groups_tpb=BLOCK)
        assert "2 GPUs here have that UUID" in r.get("err", ""), r
    finally:
        d.close()


def test_gpu_descriptors_checked_against_the_driver(procs):
    """What a GPU descriptor claims is checked against what the driver
    says: a view past the engine's allocation, a device this node does not
    have -- each refused by name, kvtierd serving on (and a cuda_vmm
    descriptor, whose fds LMCache passes out of band: refused, named).  So is a timeline
    semaphore's word: past LMCache's 4096 words (the protocol's bound), or
    past the engine's semaphore buffer (the driver's size): ok=false, an
    answer in the same form, nothing copied."""
    d = Daemon("lmh%d" % os.getpid(), env=gpu_env())
    try:
        a = procs(d.url, gpu_env())
        gpu_kv(a, 1, raw=True, forge=True)
        r = a(op="register", iid=41, model=MODEL, world=1, groups_tpb=BLOCK)
        assert "of an allocation of" in r.get("err", ""), r
        gpu_kv(a, 1, uuid="00000000-1111-2222-3333-444444444444")
        r = a(op="register", iid=42, model=MODEL, world=1, groups_tpb=BLOCK)
        assert "no device here has that UUID" in r.get("err", ""), r
        gpu_kv(a, 1, vmm=True)
        r = a(op="register", iid=40, model=MODEL, world=1, groups_tpb=BLOCK)
        assert "cuda_vmm, LMCache's use_vmm_api, is not built" in r.get("err", ""), r
        gpu_kv(a, 1)
        assert a.ok(op="register", iid=43, model=MODEL, world=1, groups_tpb=BLOCK) is None
        key = dict(model=MODEL, world=1, worker=0, start=0, end=16, iid=43, blocks=[1, 2, 3, 4],
                   timeline=True, sem_words=2)
        assert a.ok(op="gpu_store", tokens=prompt(1), sem_offset=8 * 4096, **key) == [81, False]
        assert "a timeline semaphore handle of version 1 at offset 32768" in d.log()
        assert a.ok(op="gpu_store", tokens=prompt(1), sem_offset=8 * 100, **key) == [81, False]
        assert "a semaphore at offset 800 of an allocation of 16 bytes" in d.log()
        assert a.ok(op="gpu_store", tokens=prompt(1), **key) == [81, True]
        assert d.metric("kvtier_lmcache_stored_total") == 1
    finally:
        d.close()
    # a kvtierd whose node has no CUDA driver it can load: refused, saying so
    d = Daemon("lmi%d" % os.getpid(), env=gpu_env(KVTIER_CUDA_LIBRARY="/nonexistent/libcuda.so.1"))
    try:
        c = procs(d.url, gpu_env())
        gpu_kv(c, 1)
        r = c(op="register", iid=44, model=MODEL, world=1, groups_tpb=BLOCK)
        assert "kvtierd cannot use a GPU driver here (CUDA: " in r.get("err", ""), r
    finally:
        d.close()
