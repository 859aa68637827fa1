#!/usr/bin/env python3
"""A network peer of a kvtier node's Mooncake companion, as the store's
network lets anyone be one: a plain Mooncake TransferEngine in a process of
its own, holding no fleet key and talking to no master, that asks the
companion's transfer engine to READ and WRITE at addresses of kvtier's
arena (tests/l3_mooncake.c: test_network_peer_cannot_reach_the_arena).

  l3_mooncake_peer.py PARENT_PID MAPPING_NAME PEER_HOST NODE_HOST COUNT

The companion is PARENT_PID's child running l3_mooncake.py.  Where the arena
lies in it (the mapping whose path contains MAPPING_NAME) is read from its
/proc maps -- a shortcut for the test: a peer learns a registered buffer's
address from the segment descriptor the companion publishes.  Its listening
ports likewise from /proc (its namespace's tables).  The peer's transfer
engine runs on PEER_HOST and asks NODE_HOST, the node's address (another
network namespace, where the test makes them).  At COUNT offsets spread
evenly over the arena (each slot's first bytes, when COUNT is the slot
count) it writes
b"EVILEVIL" there and reads 8 bytes back, and says on stdout, as JSON,
which transfers the companion served:

  {"companion": pid, "reached": true|false, "arena": [lo, hi],
   "writes": [rc...], "reads": [[rc, hex]...]}

`reached`: the peer did reach the companion's transfer engine -- a read of
the first buffer it publishes (the store's own segment, reachable by
design) succeeded -- so a refused arena transfer is the companion's
refusal, not a peer that reached nothing.
"""
import json
import os
import sys
import time


def children(ppid):
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open("/proc/%s/stat" % d) as f:
                st = f.read()
            with open("/proc/%s/cmdline" % d, "rb") as f:
                cmd = f.read()
        except OSError:
            continue
        if int(st.rsplit(")", 1)[1].split()[1]) == ppid and b"l3_mooncake" in cmd:
            out.append(int(d))
    return out


def mapping(pid, name):
    with open("/proc/%d/maps" % pid) as f:
        for ln in f:
            if name in ln:
                lo, hi = ln.split()[0].split("-")
                return int(lo, 16), int(hi, 16)
    raise SystemExit("no mapping %r in %d" % (name, pid))


def listening_ports(pid):
    inodes = set()
    for fd in os.listdir("/proc/%d/fd" % pid):
        try:
            t = os.readlink("/proc/%d/fd/%s" % (pid, fd))
        except OSError:
            continue
        if t.startswith("socket:["):
            inodes.add(t[8:-1])
    ports = []
    for tab in ("/proc/%d/net/tcp" % pid, "/proc/%d/net/tcp6" % pid):
        try:
            with open(tab) as f:
                next(f)
                for ln in f:
                    c = ln.split()
                    if c[3] == "0A" and c[9] in inodes:  # LISTEN, its socket
                        ports.append(int(c[1].rsplit(":", 1)[1], 16))
        except OSError:
            pass
    return sorted(set(ports))


def main():
    ppid, name, me, node = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    count = int(sys.argv[5])
    kids = children(ppid)
    if len(kids) != 1:
        raise SystemExit("companions of %d: %s" % (ppid, kids))
    pid = kids[0]
    lo, hi = mapping(pid, name)
    offs = [i * (hi - lo) // count for i in range(count)]
    from mooncake.engine import TransferEngine
    te = TransferEngine()
    if te.initialize(me, "P2PHANDSHAKE", "tcp", ""):
        raise SystemExit("the peer's transfer engine did not start")
    buf = te.allocate_managed_buffer(1 << 16)
    te.write_bytes_to_buffer(buf, b"EVILEVIL", 8)
    res = {"companion": pid, "reached": False, "arena": [lo, hi], "writes": [], "reads": []}
    target = None
    for port in listening_ports(pid):
        seg = "%s:%d" % (node, port)
        try:
            first = te.get_first_buffer_address(seg)
        except Exception:  # noqa: BLE001 (not the handshake port)
            continue
        if first and first > 0 and te.transfer_sync_read(seg, buf + 4096, first, 8) == 0:
            res["reached"], target = True, seg
            break
    if target is None:
        print(json.dumps(res))
        return 0
    t0 = time.monotonic()
    for i, off in enumerate(offs):
        res["writes"].append(te.transfer_sync_write(target, buf, lo + off, 8))
        rc = te.transfer_sync_read(target, buf + 8192 + 64 * i, lo + off, 8)
        got = te.read_bytes_from_buffer(buf + 8192 + 64 * i, 8) if rc == 0 else b""
        res["reads"].append([rc, got.hex()])
    res["seconds"] = time.monotonic() - t0
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
