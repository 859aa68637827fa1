"""kvtierd's L3 on a real Mooncake Store: mooncake_master from Mooncake's
wheel (scripts/mooncake.sh makes the environment; KVTIER_MOONCAKE_PYTHON
names its Python), two nodes -- two segments, two kvtierd, each in a
network namespace of its own on one bridge where the host allows, else on
loopback -- and each kvtierd's companion (tier/l3/l3_mooncake.py) contributing
a segment of its memory to the store.

Run by scripts/test.sh with the rest of tests/daemon."""

import json
import os
import subprocess
import time
import urllib.request

import pytest

from test_kvtierd import (KVTIER_STAT, T, WORLD, Daemon, Rank, TwoNets, expected_sha,  # noqa: F401
                          free_port, metric, name, procs, prompt, remove_segment, scheduler,
                          side_files, until)

MC_PY = os.environ.get("KVTIER_MOONCAKE_PYTHON", "")
# a client of the store with no fleet key: every kvt: object's key, and s
STORE_CLIENT = r"""
import struct, sys, urllib.request
from mooncake.store import MooncakeDistributedStore as S
master, admin = sys.argv[1], sys.argv[2]
body = urllib.request.urlopen("http://%s/get_all_keys" % admin, timeout=10).read().decode()
keys = [k for k in body.replace(",", " ").replace('"', " ").split() if k.startswith("kvt:")]
s = S()
# no segment of its own (0): what it writes lives in the nodes' segments
assert s.setup("127.0.0.1", "P2PHANDSHAKE", 0, 64 << 20, "tcp", "", master) == 0
"""
# one bit of every object's payload flipped, upserted: how many
FORGE = STORE_CLIENT + r"""
n = 0
for k in keys:
    v = s.get(k)
    if not v or len(v) < 81:
        continue
    b = bytearray(v)
    b[64 + (len(b) - 80) // 2] ^= 0x01          # one bit of the payload
    if s.upsert(k, bytes(b)) == 0:
        n += 1
print(n)
"""
# the header versions of every object: 1 clear, 2 encrypted (VERSION:COUNT)
VERSIONS = STORE_CLIENT + r"""
seen = {}
for k in keys:
    v = s.get(k)
    ver = struct.unpack_from("<I", v, 44)[0] if v and len(v) >= 64 else 0
    seen[ver] = seen.get(ver, 0) + 1
print(" ".join("%d:%d" % kv for kv in sorted(seen.items())))
"""


def need_mooncake():
    if not MC_PY or not os.access(MC_PY, os.X_OK):
        pytest.fail("KVTIER_MOONCAKE_PYTHON is not set to a Python with Mooncake's wheel "
                    "(scripts/mooncake.sh VENV makes one; scripts/test.sh does)")
    return os.path.join(os.path.dirname(MC_PY), "mooncake_master")


def gone(pid):
    try:
        return open("/proc/%d/stat" % pid).read().split(")")[1].split()[0] == "Z"
    except OSError:
        return True


def witness_of(pid):
    """The kvtier-witness process whose pidfd (its fd 4) is of pid."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            argv = open("/proc/%s/cmdline" % d, "rb").read().split(b"\0")[:2]
            if argv != [b"kvtier-witness", b"l3-mooncake"]:
                continue
            if "Pid:\t%d\n" % pid in open("/proc/%s/fdinfo/4" % d).read():
                return int(d)
        except OSError:
            continue
    return None


class Master:
    """A mooncake_master of the test's own: RPC on every address (the nodes'
    namespaces reach it over the bridge), its admin HTTP on loopback."""

    def __init__(self, tmp_path):
        self.bin = need_mooncake()
        self.port, self.admin = free_port(), free_port()
        self.logf = open(str(tmp_path / "master.log"), "ab")
        self.p = None
        self.start()

    def start(self):
        self.p = subprocess.Popen([self.bin, "--rpc_port=%d" % self.port,
                                   "--metrics_port=%d" % self.admin,
                                   "--http_metadata_server_host=127.0.0.1"],
                                  stdout=self.logf, stderr=subprocess.STDOUT,
                                  env=dict(os.environ, MC_LOG_LEVEL="WARNING",
                                           GLOG_minloglevel="1"))

        def up():
            assert self.p.poll() is None, "mooncake_master exited"
            try:
                urllib.request.urlopen("http://127.0.0.1:%d/health" % self.admin, timeout=2)
                return True
            except OSError:
                return False
        until(up, "mooncake_master up")

    def keys(self):
        body = urllib.request.urlopen("http://127.0.0.1:%d/get_all_keys" % self.admin,
                                      timeout=10).read().decode()
        return [k for k in body.replace(",", "\n").replace('"', " ").split()
                if k.startswith("kvt:")]

    def segments(self):
        """The mounted segments (a client with segment=0 mounts none)."""
        return urllib.request.urlopen("http://127.0.0.1:%d/get_all_segments" % self.admin,
                                      timeout=10).read().decode().split()

    def kill(self):
        if self.p and self.p.poll() is None:
            self.p.kill()
            self.p.wait()

    def close(self):
        self.kill()
        self.logf.close()


def fleet(procs, tmp_path):
    """Two nodes' networks (bridged), a master, where the fleet key and the
    held-get marker go."""
    net = TwoNets(bridged=True)
    procs.append(net)
    m = Master(tmp_path)
    procs.append(m)
    return net, m, str(tmp_path / "fleet.key"), str(tmp_path / "hold")


def test_l3_mooncake_two_nodes(name, procs, tmp_path):
    """Node A's prefix is a byte-exact hit on node B through Mooncake Store;
    a prefix no one has is a miss; a get torn and never answered is killed
    at its deadline and is a miss (the companion killed and waited for
    before its claim goes); kvtierd killed -9 with a get torn in flight:
    nothing half-got is ever a hit, and the restarted daemon gets the chunks
    byte-exact; the master killed: the L3 is down, the node degraded, DRAM
    still answers, and back up by itself once a master runs again; node A
    killed: its segment's objects are misses on B, never wrong; objects
    forged by a client without the fleet key (one bit flipped, upserted):
    refused, never served.  Node A encrypts (--l3-encrypt: its puts go
    from the staging its companion maps, the store holds version-2
    objects), node B does not: it reads them all the same."""
    net, m, key, hold = fleet(procs, tmp_path)

    def url(i, segment="64M"):
        return "mooncake://%s:%d?segment=%s" % (net.store[i], m.port, segment)

    common = ["--l3-key", key, "--l3-timeout-ms", "300", "--l3-negative-ms", "300",
              "--l3-python", MC_PY]
    name_b = name[:-2] + "-b"
    remove_segment(name_b)
    try:
        node_a = dict(instances=1, slots=64, prefix=net.prefix(0), host=net.node[0])
        a = Daemon(name, extra=["--l3", url(0), "--l3-admit", "all", "--l3-encrypt"] + common,
                   **node_a)
        procs.append(a)
        assert "l3 tier: mooncake store: master " in a.log(), a.log()
        assert "objects encrypted (staging " in a.log(), a.log()
        ranks_a = [Rank(name, 0, k) for k in range(WORLD)]
        procs.extend(ranks_a)
        for k in ranks_a:
            for seed in (21, 22, 24, 25, 30, 31):
                assert k.cmd(cmd="save", seed=seed, chunks=8)["count"] == 8
        until(lambda: metric(a.get("/metrics")[1], "kvtier_l3_puts_total") >= 48,
              "node A to put its 48 chunks")
        assert len(m.keys()) == 48 * WORLD  # one object per (chunk, shard)
        v = subprocess.run([MC_PY, "-c", VERSIONS, "127.0.0.1:%d" % m.port,
                            "127.0.0.1:%d" % m.admin], capture_output=True, text=True,
                           timeout=120, env=dict(os.environ, MC_LOG_LEVEL="ERROR"))
        assert v.returncode == 0 and v.stdout.split()[-1] == "2:%d" % (48 * WORLD), \
            v.stdout + v.stderr

        # node B: admission none, and no memory of its own in the store
        # (segment=0): every object lives in node A's segment
        node_b = dict(instances=1, slots=32, prefix=net.prefix(1), host=net.node[1])
        extra_b = ["--l3", url(1, "0"), "--l3-admit", "none"] + common
        b = Daemon(name_b, extra=extra_b, **node_b)
        procs.append(b)
        ranks_b = [Rank(name_b, 0, k) for k in range(WORLD)]
        procs.extend(ranks_b)
        s = scheduler(name_b, 0)
        procs.append(s)

        def promoted(keys, want):
            def f():
                s.step([])
                got = s.lookup_ex(keys)
                if got.hits == want:
                    return got
                got.release()
                return None
            return f

        def load_exact(keys, ranks, seed, what):
            lease = until(promoted(keys, 8), what)
            lid = lease.hand_off()
            s.step([lease])
            for k in ranks:
                assert k.cmd(cmd="load", lease=lid, chunks=8)["sha"] == \
                    expected_sha(k.r, seed, 8), "rank %d loaded other bytes (%s)" % (k.r, what)

        def never_hit(keys, what, rounds=10, first=0):
            """keys[first:] are never hits (the prefix stops before it)."""
            for _ in range(rounds):
                s.step([])
                g = s.lookup_ex(keys, promote=False)
                assert g.hits <= first, "%s: served" % what
                g.release()
                time.sleep(0.05)

        def held(keys):
            """The companion's held get: its pid, and which of keys its chunk
            is (the store key names it: kvt:{fingerprint hi lo}:shard).  The
            other chunks' gets, in other batches, may complete: hits, and
            exact (the loads check)."""
            until(lambda: os.path.exists(hold), "a get torn and held", timeout=60)
            pid, skey = open(hold).read().split()
            hi, lo = int(skey[21:37], 16), int(skey[37:53], 16)
            idx = [i for i, k in enumerate(keys) if (k.hi, k.lo) == (hi, lo)]
            assert len(idx) == 1, (skey, keys)
            return int(pid), idx[0]

        keys21 = s.hash_tokens(prompt(8, seed=21))
        first = s.lookup_ex(keys21)
        assert (first.hits, first.pending) == (0, 8), (first.hits, first.pending)
        first.release()
        load_exact(keys21, ranks_b, 21, "node B's lookups to hit A's chunks")
        _, mt = b.get("/metrics")
        assert metric(mt, "kvtier_l3_gets_total") == 8
        assert metric(mt, "kvtier_l3_refused_total") == 0
        assert metric(mt, "kvtier_l3_up") == 1
        st = subprocess.run([KVTIER_STAT, name_b], capture_output=True, text=True, timeout=30)
        l3line = [ln for ln in st.stdout.splitlines() if ln.startswith("l3 ")]
        assert l3line and " up  mooncake store" in l3line[0] and " 8 got " in l3line[0], \
            st.stdout

        # a prefix no node has: answered missing, then not pending
        cold = s.hash_tokens(prompt(4, seed=23))

        def answered():
            g = s.lookup_ex(cold)
            g.release()
            return g.pending == 0 and g.hits == 0
        until(answered, "the cold prefix to be answered missing")

        # a get torn and never answered: at the deadline (10 x 300 ms + 5 s)
        # kvtierd kills its companion, waits for it, and only then fails the
        # get -- a miss; a new companion then serves the same chunks exactly
        for x in ranks_b:
            x.close()
        s.close()
        assert b.stop() == 0
        b = Daemon(name_b, extra=extra_b, **dict(node_b, prefix=["env",
                   "KVTIER_TEST_MOONCAKE_HOLD=" + hold] + net.prefix(1)))
        procs.append(b)
        s = scheduler(name_b, 0)
        procs.append(s)
        ranks_b = [Rank(name_b, 0, k) for k in range(WORLD)]
        procs.extend(ranks_b)
        keys22 = s.hash_tokens(prompt(8, seed=22))
        g = s.lookup_ex(keys22)
        g.release()
        _, torn = held(keys22)
        never_hit(keys22, "a chunk of a torn get", first=torn)
        until(lambda: "did not answer within 8000 ms: killed" in b.log(),
              "the companion killed at the deadline", timeout=60)
        load_exact(keys22, ranks_b, 22, "the chunks from a new companion")
        # the held companion wrote junk every 20 ms while it lived: it no
        # longer does (killed before its get failed).  Node B's 32 slots
        # filled (the torn get's slot among them), nothing changes after.
        more = [(seed, s.hash_tokens(prompt(8, seed=seed))) for seed in (30, 31)]
        for seed, keys in more:
            load_exact(keys, ranks_b, seed, "B's slots filled")
        time.sleep(0.5)
        for seed, keys in more + [(22, keys22)]:
            load_exact(keys, ranks_b, seed, "the chunks, again")
        assert metric(b.get("/metrics")[1], "kvtier_l3_refused_total") == 0

        # kvtierd killed -9 with a torn get in flight: its companion dies
        # with it (and keeps the daemon's entry, hence the claims, alive
        # until it has exited); nothing half-got is a hit
        os.unlink(hold)
        keys24 = s.hash_tokens(prompt(8, seed=24))
        g = s.lookup_ex(keys24)
        g.release()
        companion, torn = held(keys24)
        # its exit witness holds the segment's description until it has
        # wholly exited (with RDMA, its NIC's last writes)
        w = witness_of(companion)
        assert w, "no exit witness watches the companion %d" % companion
        assert os.readlink("/proc/%d/fd/3" % w).endswith("kvtier." + name_b)
        b.p.kill()
        b.p.wait()
        until(lambda: gone(companion), "the companion gone with kvtierd")
        until(lambda: gone(w), "the witness gone after the companion")
        never_hit(keys24, "a chunk half-got by a killed kvtierd", first=torn)
        b = Daemon(name_b, extra=extra_b, **node_b)
        procs.append(b)
        load_exact(keys24, ranks_b, 24, "the restarted kvtierd to get the chunks")

        # the master killed: the L3 is down, the node degraded, DRAM answers
        m.kill()
        until(lambda: metric(b.get("/metrics")[1], "kvtier_l3_up") == 0, "the L3 marked down")
        code, body = b.get("/healthcheck")
        h = json.loads(body)
        assert code == 200 and h["l3"] == "down", body
        got = s.lookup_ex(keys24, promote=False)
        assert got.hits == 8  # DRAM still answers
        got.release()
        keys25 = s.hash_tokens(prompt(8, seed=25))
        never_hit(keys25, "a chunk asked of a store that is down", rounds=3)
        # back: the companions mount their segments on the new master by
        # themselves (its objects were lost with it: a restarted master
        # is empty); what A saves now is put, and B gets it exactly
        m.start()
        until(lambda: metric(b.get("/metrics")[1], "kvtier_l3_up") == 1, "the L3 up again")
        # (a put the store fails is dropped, not retried: A saves once its
        # companion has mounted its segment on the new master again)
        until(lambda: len(m.segments()) == 1, "node A's segment mounted again")
        for k in ranks_a:
            assert k.cmd(cmd="save", seed=26, chunks=8)["count"] == 8
        until(lambda: len(m.keys()) >= 8 * WORLD, "node A's new chunks put", timeout=60)
        load_exact(s.hash_tokens(prompt(8, seed=26)), ranks_b, 26, "chunks put after the restart")

        # forged: a client without the fleet key flips one payload bit of
        # every object in the store and upserts it
        for k in ranks_a:
            assert k.cmd(cmd="save", seed=27, chunks=8)["count"] == 8
        until(lambda: len(m.keys()) >= 16 * WORLD, "node A's seed-27 chunks put", timeout=60)
        fp = subprocess.run([MC_PY, "-c", FORGE, "127.0.0.1:%d" % m.port,
                             "127.0.0.1:%d" % m.admin], capture_output=True, text=True,
                            timeout=120, env=dict(os.environ, MC_LOG_LEVEL="ERROR"))
        assert fp.returncode == 0 and int(fp.stdout.split()[-1]) >= 8 * WORLD, fp.stdout + fp.stderr
        keys27 = s.hash_tokens(prompt(8, seed=27))
        before = metric(b.get("/metrics")[1], "kvtier_l3_refused_total")

        def refused_not_served():
            s.step([])
            g = s.lookup_ex(keys27)
            g.release()
            assert g.hits == 0, "a forged object: served"
            return metric(b.get("/metrics")[1], "kvtier_l3_refused_total") > before
        until(refused_not_served, "the forged objects refused")
        never_hit(keys27, "a forged object")

        # node A killed: the objects in its segment are misses on B
        for k in ranks_a:
            assert k.cmd(cmd="save", seed=28, chunks=8)["count"] == 8
        until(lambda: len(m.keys()) >= 24 * WORLD, "node A's seed-28 chunks put", timeout=60)
        for k in ranks_a:
            k.kill()
        a.p.kill()
        a.p.wait()
        keys28 = s.hash_tokens(prompt(8, seed=28))
        g = s.lookup_ex(keys28)
        g.release()
        never_hit(keys28, "a chunk of a node that is gone", rounds=20)
        assert b.p.poll() is None
        for x in ranks_b:
            x.close()
        s.close()
        assert b.stop() == 0
        assert "l3 tier closed" in b.log()
    finally:
        remove_segment(name_b)
        for f in side_files(name_b) + side_files(name):
            if os.path.exists(f):
                os.unlink(f)


def test_l3_mooncake_settings_refused(name, procs, tmp_path):
    """A bad mooncake:// URL, and a Python without Mooncake's wheel: the
    start fails, the reason named; nothing is left running."""
    need_mooncake()
    key = str(tmp_path / "fleet.key")
    for url, why in (("mooncake://host:99999", "bad master port"),
                     ("mooncake://h?protocol=udp", "protocol=udp: tcp or rdma"),
                     ("mooncake://h?protocol=rdma", "protocol=rdma needs device=DEV"),
                     ("mooncake://h?segment=lots", "segment=lots: a size"),
                     ("mooncake://h?colour=red", "unknown parameter 'colour'"),
                     ("mooncake://a/b", "is not a master's HOST[:PORT]")):
        d = Daemon(name, extra=["--l3", url, "--l3-key", key, "--l3-python", MC_PY],
                   instances=1, slots=32, expect=False)
        procs.append(d)
        assert d.p.wait(timeout=T) == 1, url
        assert why in d.log(), (url, d.log())
    d = Daemon(name, extra=["--l3", "mooncake://127.0.0.1:%d" % free_port(), "--l3-key", key,
                            "--l3-python", "/usr/bin/python3"], instances=1, slots=32,
               expect=False)
    procs.append(d)
    assert d.p.wait(timeout=60) == 1
    assert "has no Mooncake" in d.log() and "scripts/mooncake.sh" in d.log(), d.log()


PEER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                    "l3_mooncake_peer.py")


def attack(net, from_ns, node, daemon, segment):
    """tests/l3_mooncake_peer.py from node `from_ns`'s network against
    `daemon`'s companion on node `node`: a write of b"EVILEVIL" and a read
    at 16 places spread over the arena.  Returns its JSON."""
    p = subprocess.run(net.prefix(from_ns) + [MC_PY, PEER, str(daemon.p.pid), "kvtier." + segment,
                                              net.node[from_ns], net.node[node], "16"],
                       capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, MC_LOG_LEVEL="ERROR", GLOG_minloglevel="2"))
    assert p.returncode == 0, p.stdout + p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    print("peer: %d transfers in %.1f s" % (2 * len(r["writes"]), r.get("seconds", 0)))
    # it did reach the companion's transfer engine (the store's own
    # segment, reachable by design): a refusal below is the companion's
    assert r["reached"], r
    return r


def test_l3_mooncake_network_peer(name, procs, tmp_path):
    """The arena is not reachable from the store's network: a peer on
    another node, with no fleet key and no master (a plain Mooncake
    TransferEngine), asks a node's companion to WRITE b"EVILEVIL" and to
    READ at 16 places spread over the arena -- its READY chunks, put to
    the store, among them -- and, on a node whose get is held in flight
    (its sub-slot claimed and waited for), over that arena too: every
    transfer is refused, and every chunk loads byte-exact afterwards."""
    net, m, key, hold = fleet(procs, tmp_path)
    common = ["--l3-key", key, "--l3-timeout-ms", "300", "--l3-negative-ms", "300",
              "--l3-python", MC_PY]
    name_b = name[:-2] + "-b"
    remove_segment(name_b)
    try:
        a = Daemon(name, extra=["--l3", "mooncake://%s:%d?segment=64M" % (net.store[0], m.port),
                                "--l3-admit", "all"] + common,
                   instances=1, slots=64, prefix=net.prefix(0), host=net.node[0])
        procs.append(a)
        ranks_a = [Rank(name, 0, k) for k in range(WORLD)]
        procs.extend(ranks_a)
        for k in ranks_a:
            for seed in (21, 22):
                assert k.cmd(cmd="save", seed=seed, chunks=8)["count"] == 8
        until(lambda: metric(a.get("/metrics")[1], "kvtier_l3_puts_total") >= 16,
              "node A to put its chunks")
        r = attack(net, 1, 0, a, name)
        assert r["writes"] and all(rc != 0 for rc in r["writes"]), \
            "the peer wrote into node A's arena: %s" % r["writes"]
        assert all(rc != 0 for rc, _ in r["reads"]), \
            "the peer read node A's arena: %s" % [x for x in r["reads"] if x[0] == 0][:4]
        sa = scheduler(name, 0)
        procs.append(sa)
        for seed in (21, 22):
            with sa.lookup(sa.hash_tokens(prompt(8, seed=seed))) as lease:
                assert lease.hits == 8
                lid = lease.hand_off()
                sa.step([lease])
                for k in ranks_a:
                    assert k.cmd(cmd="load", lease=lid, chunks=8)["sha"] == \
                        expected_sha(k.r, seed, 8), "node A's chunk changed (rank %d)" % k.r

        # node B, its get of A's chunk held in flight (the test hook: the
        # companion never answers it); the peer, from node A's network
        b = Daemon(name_b, extra=["--l3", "mooncake://%s:%d?segment=16M" % (net.store[1], m.port),
                                  "--l3-admit", "none"] + common,
                   instances=1, slots=32, host=net.node[1],
                   prefix=["env", "KVTIER_TEST_MOONCAKE_HOLD=" + hold] + net.prefix(1))
        procs.append(b)
        s = scheduler(name_b, 0)
        procs.append(s)
        g = s.lookup_ex(s.hash_tokens(prompt(8, seed=21)))
        g.release()
        until(lambda: os.path.exists(hold), "a get held in flight", timeout=60)
        r = attack(net, 0, 1, b, name_b)
        assert all(rc != 0 for rc in r["writes"]), \
            "the peer wrote into node B's arena: %s" % r["writes"]
        assert all(rc != 0 for rc, _ in r["reads"]), "the peer read node B's arena"
        s.close()
        b.p.kill()
        b.p.wait()
    finally:
        remove_segment(name_b)
        for f in side_files(name_b) + side_files(name):
            if os.path.exists(f):
                os.unlink(f)


def test_l3_mooncake_rdma_needs_local_only_registration():
    """protocol=rdma only with a Mooncake that registers the arena for
    local access only (0.3.13, kvcache-ai/Mooncake#3151): an older one
    would grant every peer remote read and write of it.  The companion's
    own rule, and the version it reads from the installed wheel."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(
        "l3_mooncake", os.path.join(os.path.dirname(PEER), "..", "tier", "l3", "l3_mooncake.py"))
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    assert mc.rdma_refusal("rdma", (0, 3, 12)) and "0.3.13 or newer (this is 0.3.12)" in \
        mc.rdma_refusal("rdma", (0, 3, 12))
    assert mc.rdma_refusal("rdma", (0, 0, 0))            # a version it cannot read
    assert mc.rdma_refusal("rdma", (0, 3, 13)) is None
    assert mc.rdma_refusal("tcp", (0, 3, 12)) is None     # nothing registered over TCP
    need_mooncake()
    got = subprocess.run([MC_PY, "-c", "import importlib.util as u, sys; "
                          "s = u.spec_from_file_location('m', sys.argv[1]); "
                          "m = u.module_from_spec(s); s.loader.exec_module(m); "
                          "import importlib.metadata as md; "
                          "print(md.version('mooncake-transfer-engine-non-cuda')); "
                          "print(*m.mooncake_version())", spec.origin],
                         capture_output=True, text=True, timeout=60)
    assert got.returncode == 0, got.stderr
    text, nums = got.stdout.split("\n")[:2]     # "0.3.13.post1", "0 3 13"
    assert text.split(".")[:3] == nums.split(), got.stdout
