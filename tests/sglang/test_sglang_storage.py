"""kvtier.sglang against SGLang's own code (the pinned release, installed
without its GPU dependencies by tests/sglang/setup-venv.sh): its backend
factory loads the backend by module path, its own device and host pool
classes hold the pages (CPU tensors), and its own HybridCacheController
-- built by its constructor, the backend attached by its attach path --
drives the backend from its own prefetch, I/O, sync and backup threads.

Instance 0 runs in a process of its own (hicache_node.py), instance 1 in
this one; each instance has two TP ranks.  What runs of SGLang and what
does not is in the README's SGLang section."""
import errno
import json
import os
import signal
import subprocess
import sys
import time
import uuid

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import hicache_node as node  # noqa: E402
import kvtier  # noqa: E402
import kvtier.sglang as ks  # noqa: E402


@pytest.fixture(scope="module")
def rc():
    return node.publish(2)


@pytest.fixture
def segment():
    name = "sgl-" + uuid.uuid4().hex[:10]
    yield name
    try:
        kvtier.unlink(name)
    except kvtier.KvtierError:
        pass


def other_process(spec, env=None, wait=True):
    """hicache_node.py as a process of its own (another instance)."""
    cmd = [sys.executable, os.path.join(HERE, "hicache_node.py"), json.dumps(spec)]
    e = dict(os.environ, **(env or {}))
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=e)
    if not wait:
        return p
    out, _ = p.communicate(timeout=600)
    lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
    assert p.returncode == 0 and lines, out[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def client(name):
    return kvtier.Tier(segment=name, role="client", world=None)


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct",
                                    "page_head"])
def test_ranks_and_instances_share_one_segment(rc, segment, layout):
    """Instance 0's two ranks back pages up (another process); instance
    1's two ranks prefetch them: every byte of each rank's shard as
    written, through SGLang's controller threads; a longer prompt hits
    only the pages that were stored."""
    w = other_process({"world": 2, "instance": 0, "ranks": [0, 1], "layout": layout,
                       "kind": "mha", "segment": segment, "seed": 11, "pages": 9,
                       "action": "write"})
    assert [r["stored"] for r in w["ranks"]] == [9 * node.PAGE] * 2
    assert w["saved_chunks"] == 18       # 9 pages x 2 shards
    for rank in (0, 1):
        cc = node.controller(rc, rank, layout, "mha",
                             node.extra_config(segment, kvtier_instance=1))
        try:
            assert type(cc.storage_backend).__name__ == "KvtierStorage"
            # interface_v1: SGLang picked the zero-copy calls
            assert cc.page_get_func.__name__ == "_page_get_zero_copy"
            hit, done, bad = node.read(cc, 11, rank, 12)
            assert (hit, done, bad) == (9 * node.PAGE, 9 * node.PAGE, [])
            m = cc.storage_backend.get_stats()
            assert m.prefetch_pgs == [9] and m.prefetch_bandwidth[0] > 0
            st = cc.storage_backend._tier.stats()
            assert st["slots_pinned"] == 0 and st["leases_live"] == 0
            assert st["double_unpins"] == 0
        finally:
            cc.detach_storage_backend()


def test_mla_is_written_once_and_read_by_every_rank(rc, segment):
    """MLA: SGLang's one storage writer (rank 0) saves, rank 1's backup is
    skipped by SGLang's controller; one copy in the segment; both ranks of
    the other instance read the same bytes."""
    w = other_process({"world": 2, "instance": 0, "ranks": [0, 1], "layout": "page_first",
                       "kind": "mla", "segment": segment, "seed": 23, "pages": 6,
                       "action": "write"})
    assert w["ranks"][0]["stored"] == 6 * node.PAGE
    assert w["saved_chunks"] == 6        # once, not once per rank
    for rank in (0, 1):
        cc = node.controller(rc, rank, "page_first", "mla",
                             node.extra_config(segment, kvtier_instance=1))
        try:
            assert cc.storage_backend.replicated
            assert cc.storage_backend.writer == (rank == 0)
            assert node.read(cc, 23, 0, 6) == (6 * node.PAGE, 6 * node.PAGE, [])
        finally:
            cc.detach_storage_backend()


def test_dsa_indexer_rides_on_the_kv_pages(rc, segment):
    """DeepSeek V3.2 / GLM-5 (DSA): SGLang's MLA host pool and its indexer
    host pool beside it (the tree's KV-derived sidecar transfer, v2 calls):
    both pools' bytes of a page in one chunk, once, read back byte-exact
    by both ranks of the other instance."""
    w = other_process({"world": 2, "instance": 0, "ranks": [0, 1], "layout": "page_first",
                       "kind": "dsa", "segment": segment, "seed": 41, "pages": 5,
                       "action": "write"})
    assert w["ranks"][0]["stored"] == 5 * node.PAGE
    assert w["saved_chunks"] == 5
    for rank in (0, 1):
        cc = node.controller(rc, rank, "page_first", "dsa",
                             node.extra_config(segment, kvtier_instance=1))
        try:
            b = cc.storage_backend
            assert b.folded == ["indexer"] and ";+indexer=DSAIndexerPoolHost" in b.model
            assert len(node.pools_of(cc)) == 2
            assert node.read(cc, 41, 0, 5) == (5 * node.PAGE, 5 * node.PAGE, [])
        finally:
            cc.detach_storage_backend()


def test_unsupported_layout_is_refused_by_name(rc, segment):
    with pytest.raises(ValueError, match="page_unified"):
        node.controller(rc, 0, "page_unified", "mha", node.extra_config(segment))


def test_a_second_pool_is_refused_by_name(rc, segment):
    """A hybrid model's second host pool (here an SWA pool beside the KV
    anchor) is refused at attach, naming it: kvtier would store half of
    what a page needs."""
    with pytest.raises(ValueError, match="'swa'"):
        node.controller(rc, 0, "page_first", "mha", node.extra_config(segment),
                        pools=("kv", "swa"))


def test_wrong_world_is_refused(rc, segment):
    """A segment of a TP2 engine; a rank that thinks the world is 1."""
    cc = node.controller(rc, 0, "page_first", "mha", node.extra_config(segment))
    try:
        node.publish(1)
        with pytest.raises(kvtier.KvtierError, match="world") as ei:
            node.controller(rc, 0, "page_first", "mha",
                            node.extra_config(segment, kvtier_instance=1))
        assert ei.value.errno in (errno.ESTALE, errno.EINVAL)
    finally:
        node.publish(2)
        cc.detach_storage_backend()


def test_bad_settings_are_refused(rc, segment, monkeypatch):
    with pytest.raises(ValueError, match="'/'"):
        node.controller(rc, 0, "page_first", "mha", node.extra_config("a/b"))
    with pytest.raises(ValueError, match="kvtier_tier_gib"):
        node.controller(rc, 0, "page_first", "mha",
                        node.extra_config(segment, kvtier_tier_gib="lots"))
    monkeypatch.setenv("KVTIER_PROMOTE_WAIT_MS", "")
    with pytest.raises(ValueError, match="KVTIER_PROMOTE_WAIT_MS"):
        node.controller(rc, 0, "page_first", "mha", node.extra_config(segment))


def test_other_sglang_versions_are_refused(monkeypatch):
    monkeypatch.delenv("KVTIER_SGLANG_ANY_VERSION", raising=False)
    with pytest.raises(ImportError, match="0.5.23"):
        ks.check_version("0.5.22")
    ks.check_version(ks.TESTED[0])
    monkeypatch.setenv("KVTIER_SGLANG_ANY_VERSION", "1")
    ks.check_version("0.6.0")


def test_killed_rank_leaves_nothing_pinned(rc, segment, tmp_path):
    """A rank killed (SIGKILL) in the middle of a prefetch, holding the
    pins of its lookup: once reaped, nothing is pinned and no lease
    lives, and the pages are still there for the next reader."""
    w = other_process({"world": 2, "instance": 0, "ranks": [0, 1], "layout": "page_first",
                       "kind": "mha", "segment": segment, "seed": 31, "pages": 5,
                       "action": "write"})
    assert w["saved_chunks"] == 10
    hold = str(tmp_path / "holding")
    p = other_process({"world": 2, "instance": 1, "ranks": [0], "layout": "page_first",
                       "kind": "mha", "segment": segment, "seed": 31, "pages": 5,
                       "action": "read"}, env={"KVTIER_SGLANG_TEST_HOLD": hold}, wait=False)
    try:
        deadline = time.monotonic() + 300
        while not os.path.exists(hold):
            assert p.poll() is None, p.stdout.read()[-4000:]
            assert time.monotonic() < deadline, "the reader never reached its load"
            time.sleep(0.1)
        with client(segment) as c:
            st = c.stats()
            assert st["slots_pinned"] == 5 and st["leases_live"] == 1
            p.send_signal(signal.SIGKILL)
            p.wait(timeout=60)
            deadline = time.monotonic() + 60
            while c.reap() == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            st = c.stats()
            assert st["slots_pinned"] == 0 and st["leases_live"] == 0, st
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    cc = node.controller(rc, 1, "page_first", "mha",
                         node.extra_config(segment, kvtier_instance=1))
    try:
        assert node.read(cc, 31, 1, 5) == (5 * node.PAGE, 5 * node.PAGE, [])
    finally:
        cc.detach_storage_backend()
