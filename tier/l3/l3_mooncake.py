#!/usr/bin/env python3
"""kvtier-l3-mooncake: kvtierd's companion for a Mooncake Store L3.

kvtierd (tier/l3/l3_mooncake.c, whose comment has the design) starts this with
the Python that has Mooncake's wheel and drives it over a socketpair:

  fd 3  the channel (SOCK_SEQPACKET): requests in, answers out
  fd 4  the segment file, mapped at --mem-off for --mem-len bytes: the arena,
        so puts read the sub-slots where they lie and gets land in them; it
        is not registered with the transfer engine over TCP (so no peer can
        reach it), and registered for local access only over RDMA
  fd 5  the side buffer (--side-len bytes): the headers and tags
  fd 6  with --stage-len > 0: kvtierd's staging of encrypted puts (their
        ciphertext), held to the same rules as the arena

It moves bytes only: which chunk, which slot, whether what arrived is right
and whether it is published are kvtierd's.  It dies with kvtierd
(PR_SET_PDEATHSIG) and ends when the channel closes.  Nothing here checks an
object's content: a forged or torn object fails kvtierd's tag check.
"""
import argparse
import ctypes
import errno
import mmap
import os
import signal
import socket
import struct
import sys
import threading
import time

MAGIC, VERSION = 0x6b636d6b, 1
HELLO, REQ, DONE = 1, 2, 3
PUT, GET, EXISTS, PROBE = 1, 2, 3, 0
KEY_MAX = 96
REQ_HDR = struct.Struct("<IHHIIHHI")          # magic version kind slot gen op n_pieces n_keys
PIECE = struct.Struct("<QQII")                # off len side pad
PIECES = 8
DONE_HDR = struct.Struct("<IHHII")            # magic version kind n pad
DONE_ITEM = struct.Struct("<IIiIQ")           # slot gen status pad got
HELLO_MSG = struct.Struct("<IHHiI256s")
BATCH = 64
WORKERS = 4
# testing only: the first get after which this file does not exist lands
# half its payload, then junk (a transfer torn mid-way), makes the file and
# never answers, writing junk into that payload every 20 ms for as long as
# it lives, and no longer leaves when the channel closes (a transfer stuck
# in the kernel) -- the window in which kvtierd, or this process, is killed
HOLD = os.environ.get("KVTIER_TEST_MOONCAKE_HOLD")

# Mooncake's ErrorCode (mooncake-store/include/types.h) -> kvt_l3.h's statuses
MC_NOT_FOUND, MC_NO_HANDLE, MC_INVALID_PARAMS = -704, -200, -600
MC_ALREADY_EXISTS, MC_BUFFER_OVERFLOW = -705, -10


def status_of(code, op):
    if code >= 0:
        return 0
    if code == MC_NOT_FOUND:
        return -errno.ENOENT
    if code == MC_ALREADY_EXISTS and op == PUT:
        return 0  # another node put it first: it is there
    if code == MC_NO_HANDLE:
        return -errno.ENOSPC
    if code in (MC_INVALID_PARAMS, MC_BUFFER_OVERFLOW):
        return -errno.EMSGSIZE
    if code <= -900:
        return -errno.ENOTCONN  # RPC to the master (-900s), its metadata (-1000s)
    return -errno.EIO


def log(msg):
    sys.stderr.write("kvtier-l3-mooncake: %s\n" % msg)


def hello(sock, status, text):
    sock.send(HELLO_MSG.pack(MAGIC, VERSION, HELLO, status, 0, text.encode()[:255]))


def die_with_parent(ppid):
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except OSError:
        pass
    if os.getppid() != ppid:
        os._exit(1)  # kvtierd died before the prctl


def local_address(master):
    """The address this node reaches the master from: what other nodes use."""
    host, _, port = master.rpartition(":")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, int(port)))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


# Mooncake's first version whose RDMA registration honours
# remote_accessible=false: kvcache-ai/Mooncake#3151 was merged on
# 2026-07-30, after 0.3.12.post1 (2026-07-25); Mooncake's tree of
# 2026-08-22 has it and still calls itself 0.3.12.post1, so 0.3.13 is the
# first release that can have it.  (Read from the source; no RDMA NIC here.)
RDMA_LOCAL_ONLY = (0, 3, 13)


def mooncake_version():
    """The installed wheel's version as a tuple of its first three numbers
    ((0, 0, 0) when it cannot be read: treated as too old)."""
    import importlib.metadata as md
    for dist in ("mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        try:
            v = md.version(dist)
        except md.PackageNotFoundError:
            continue
        nums = []
        for part in v.split(".")[:3]:
            digits = "".join(ch for ch in part if ch.isdigit()) if part[:1].isdigit() else ""
            if not digits:
                break
            nums.append(int(digits))
        return tuple(nums + [0] * (3 - len(nums)))
    return (0, 0, 0)


def rdma_refusal(protocol, have):
    """Why this Mooncake may not run `protocol` (None: it may)."""
    if protocol == "rdma" and have < RDMA_LOCAL_ONLY:
        return ("protocol=rdma needs Mooncake %s or newer (this is %s): older versions "
                "register every buffer for remote read and write, which would open the "
                "arena to the store's network" % (".".join(map(str, RDMA_LOCAL_ONLY)),
                                                  ".".join(map(str, have))))
    return None


def human(n):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return "%g %s" % (round(n, 1), unit)
        n /= 1024.0


class Companion:
    def __init__(self, a, sock):
        self.a, self.sock = a, sock
        self.send_mu = threading.Lock()
        self.holding = False
        self.q_fast, self.q_put = [], []   # gets, exists, probes before puts
        self.mu = threading.Condition()
        size = os.fstat(4).st_size
        if a.mem_off + a.mem_len > size:
            raise ValueError("the arena [%d, +%d) is past the segment's end %d" %
                             (a.mem_off, a.mem_len, size))
        try:  # only the arena (the segment's 2 MiB-aligned part)
            self.mem = mmap.mmap(4, a.mem_len, mmap.MAP_SHARED,
                                 mmap.PROT_READ | mmap.PROT_WRITE, offset=a.mem_off)
            self.mem_base = ctypes.addressof(ctypes.c_char.from_buffer(self.mem))
        except (OSError, ValueError):
            self.mem = mmap.mmap(4, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            self.mem_base = ctypes.addressof(ctypes.c_char.from_buffer(self.mem)) + a.mem_off
        os.close(4)  # the mapping holds the description (kvtierd's liveness) now
        self.side = mmap.mmap(5, a.side_len, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.side_base = ctypes.addressof(ctypes.c_char.from_buffer(self.side))
        os.close(5)
        self.stage, self.stage_base = None, 0
        if a.stage_len:
            self.stage = mmap.mmap(6, a.stage_len, mmap.MAP_SHARED,
                                   mmap.PROT_READ | mmap.PROT_WRITE)
            self.stage_base = ctypes.addressof(ctypes.c_char.from_buffer(self.stage))
            os.close(6)
        # a piece's region (l3_mooncake.c's MC_IN_*): base, length
        self.regions = ((self.mem_base, a.mem_len), (self.side_base, a.side_len),
                        (self.stage_base, a.stage_len))

    def setup(self):
        from mooncake.store import MooncakeDistributedStore
        a = self.a
        why = rdma_refusal(a.protocol, mooncake_version())
        if why:
            return -1, why
        self.host = a.host or local_address(a.master)
        self.store = MooncakeDistributedStore()
        rc = self.store.setup(self.host, a.metadata, a.segment, 16 << 20, a.protocol,
                              a.device, a.master)
        if rc:
            return rc, "the store's setup failed (%d): master %s, metadata %s, %s" % (
                rc, a.master, a.metadata, a.protocol)
        # Nothing of kvtierd's is registered over TCP: Mooncake's TCP
        # transport publishes every registered buffer in this node's
        # segment descriptor and serves any peer's READ or WRITE inside one
        # (it ignores register_buffer's remote_accessible=false), while its
        # own transfers read and write unregistered memory as well.  Over
        # RDMA the NIC needs the buffers registered; register_buffer asks
        # for local access only (IBV_ACCESS_LOCAL_WRITE, no rkey published),
        # which Mooncake honours from 0.3.13 on (#3151): older versions
        # granted remote read and write to every registered buffer.
        if a.protocol == "rdma":
            for base, n, what in ((self.mem_base, a.mem_len, "the arena"),
                                  (self.side_base, a.side_len, "the side buffer"),
                                  (self.stage_base, a.stage_len, "the staging")):
                if not n:
                    continue
                rc = self.store.register_buffer(base, n)
                if rc:
                    return rc, "register_buffer of %s (%s) failed (%d)" % (what, human(n), rc)
        return 0, "mooncake store: master %s, %s, this node %s contributes %s" % (
            a.master, a.protocol + ((" " + a.device) if a.device else ""), self.host,
            human(a.segment))

    # ---- the channel ----

    def parse(self, msg):
        if len(msg) < REQ_HDR.size + PIECES * PIECE.size:
            raise ValueError("short request")
        magic, ver, kind, slot, gen, op, n_pieces, n_keys = REQ_HDR.unpack_from(msg)
        if magic != MAGIC or ver != VERSION or kind != REQ or n_pieces > PIECES or n_keys > 64:
            raise ValueError("bad request header")
        base = REQ_HDR.size + PIECES * PIECE.size
        if len(msg) != base + n_keys * KEY_MAX:
            raise ValueError("bad request length")
        keys = [msg[base + i * KEY_MAX: base + (i + 1) * KEY_MAX].split(b"\0", 1)[0].decode()
                for i in range(n_keys)]
        ptrs, sizes = [], []
        for i in range(n_pieces):
            off, n, side, _ = PIECE.unpack_from(msg, REQ_HDR.size + i * PIECE.size)
            if side >= len(self.regions) or off + n > self.regions[side][1]:
                raise ValueError("a piece past its buffer")
            ptrs.append(self.regions[side][0] + off)
            sizes.append(n)
        return (slot, gen, op, keys, ptrs, sizes)

    def reader(self):
        """Takes every request that came (one blocking read, then what else
        is there) before a worker is woken: a worker then runs them as one
        batch call, not one call per request."""
        while True:
            got, flags = [], 0
            while True:
                try:
                    msg = self.sock.recv(8192, flags)
                except BlockingIOError:
                    break
                except OSError:
                    msg = b""
                if not msg and self.holding:
                    threading.Event().wait()  # testing: held, it stays (a stuck transfer)
                if not msg:  # kvtierd closed the channel (or died)
                    self.leave()
                try:
                    got.append(self.parse(msg))
                except (ValueError, UnicodeDecodeError) as e:
                    log("refused a request: %s" % e)
                    os._exit(3)
                flags = socket.MSG_DONTWAIT
            with self.mu:
                for r in got:
                    (self.q_put if r[2] == PUT else self.q_fast).append(r)
                self.mu.notify_all() if len(got) > BATCH else self.mu.notify()

    def leave(self):
        """Unmounts this node's segment, so that the master drops the
        objects in it now rather than when this client's lease runs out
        (meanwhile they would be listed, a put of one of their keys would
        be taken as done, and every get of them would fail); bounded: kvtierd
        kills what lingers."""
        threading.Timer(2.0, os._exit, (0,)).start()
        try:
            self.store.close()
        except Exception as e:  # noqa: BLE001 (the store's binding)
            log("close: %s" % e)
        os._exit(0)

    def take(self):
        """Up to BATCH requests of one op, gets and exists before puts."""
        with self.mu:
            while not self.q_fast and not self.q_put:
                self.mu.wait()
            q = self.q_fast if self.q_fast else self.q_put
            op = q[0][2]
            batch = [r for r in q if r[2] == op][:BATCH]
            taken = set(id(r) for r in batch)
            q[:] = [r for r in q if id(r) not in taken]
            return op, batch

    def run(self, op, batch):
        st = self.store
        if op == PUT:
            res = st.batch_put_from_multi_buffers([r[3][0] for r in batch],
                                                  [r[4] for r in batch],
                                                  [r[5] for r in batch])
            return [(status_of(c, op), 0) for c in res]
        if op == GET:
            res = st.batch_get_into_multi_buffers([r[3][0] for r in batch],
                                                  [r[4] for r in batch],
                                                  [r[5] for r in batch])
            if HOLD and not os.path.exists(HOLD):
                self.hold(batch[0])
            out = []
            for c, r in zip(res, batch):
                if c >= 0 and c != sum(r[5]):
                    out.append((-errno.EMSGSIZE, c))
                else:
                    out.append((status_of(c, op), max(c, 0)))
            return out
        if op == EXISTS:
            keys = [k for r in batch for k in r[3]]
            res = st.batch_is_exist(keys)
            out, i = [], 0
            for r in batch:
                got = res[i:i + len(r[3])]
                i += len(r[3])
                if any(c < 0 for c in got):
                    out.append((-errno.ENOTCONN, 0))
                else:
                    out.append((0 if all(c == 1 for c in got) else -errno.ENOENT, 0))
            return out
        # PROBE: is the master there (one existence check of a key no one puts)
        res = st.batch_is_exist(["kvt:probe"] * len(batch))
        return [(0 if c >= 0 else -errno.ENOTCONN, 0) for c in res]

    def hold(self, r):
        self.holding = True
        n = max(r[5])
        p = r[4][r[5].index(n)]
        ctypes.memset(p + n // 2, 0x47, n - n // 2)
        with open(HOLD + ".tmp", "w") as f:
            f.write("%d %s\n" % (os.getpid(), r[3][0]))
        os.rename(HOLD + ".tmp", HOLD)
        log("testing: a get torn and held (%s)" % HOLD)
        while True:
            time.sleep(0.02)
            ctypes.memset(p + n // 2, 0x47, n - n // 2)

    def worker(self):
        while True:
            op, batch = self.take()
            try:
                res = self.run(op, batch)
                if len(res) != len(batch):
                    raise RuntimeError("the store answered %d of %d" % (len(res), len(batch)))
            except Exception as e:  # the store's binding raising: every request fails
                log("op %d: %s" % (op, e))
                res = [(-errno.EIO, 0)] * len(batch)
            msg = bytearray(DONE_HDR.pack(MAGIC, VERSION, DONE, len(batch), 0))
            for r, (status, got) in zip(batch, res):
                msg += DONE_ITEM.pack(r[0], r[1], status, 0, got)
            with self.send_mu:
                try:
                    self.sock.send(msg)
                except OSError:
                    os._exit(0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--master", required=True)
    p.add_argument("--metadata", default="P2PHANDSHAKE")
    p.add_argument("--protocol", default="tcp")
    p.add_argument("--device", default="")
    p.add_argument("--host", default="")
    p.add_argument("--segment", type=int, default=1 << 30)
    p.add_argument("--mem-off", type=int, required=True)
    p.add_argument("--mem-len", type=int, required=True)
    p.add_argument("--side-len", type=int, required=True)
    p.add_argument("--stage-len", type=int, default=0)
    p.add_argument("--ppid", type=int, required=True)
    p.add_argument("--timeout-ms", type=int, default=1000)
    a = p.parse_args()
    die_with_parent(a.ppid)
    sock = socket.socket(fileno=3)
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        hello(sock, -errno.ENOSYS, "%s has no Mooncake (%s): scripts/mooncake.sh VENV "
              "installs it; kvtierd --l3-python VENV/bin/python" % (sys.executable, e))
        return 1
    try:
        c = Companion(a, sock)
    except (OSError, ValueError) as e:
        hello(sock, -errno.EINVAL, "the arena: %s" % e)
        return 1
    rc, text = c.setup()
    if rc:
        hello(sock, -errno.ECONNREFUSED, text)
        return 1
    hello(sock, 0, text)
    for _ in range(WORKERS):
        threading.Thread(target=c.worker, daemon=True).start()
    c.reader()


if __name__ == "__main__":
    sys.exit(main())
