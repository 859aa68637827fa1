"""Tier, Lease, Op, Key, Group: the Python face of kvtier.h."""

import array
import ctypes
import errno as _errno
import operator
import os
from collections import namedtuple

from . import _lib as L
from ._errors import KvtierError

try:
    import numpy as _np
except ImportError:  # numpy is optional: lists work without it
    _np = None

_EINVAL = -_errno.EINVAL
_EALREADY = -_errno.EALREADY
_EINPROGRESS = -_errno.EINPROGRESS
_ETIMEDOUT = -_errno.ETIMEDOUT
_ESTALE = -_errno.ESTALE

_ROLES = {"rank": L.TIER_RANK, "scheduler": L.TIER_SCHEDULER, "client": L.TIER_CLIENT}
_ROLE_NAMES = {v: k for k, v in _ROLES.items()}


def strerror(code):
    """kvt_strerror(code): a negative errno as a sentence."""
    s = L.lib().kvt_strerror(int(code))
    return s.decode("utf-8", "replace") if s else ""


def last_error():
    """kvt_last_error(): the calling thread's message for its last failure."""
    s = L.lib().kvt_last_error()
    return s.decode("utf-8", "replace") if s else ""


def _raise(code, func):
    raise KvtierError(code, last_error(), strerror(code), func)


def _check(r, func):
    if r < 0:
        _raise(r, func)
    return r


def _invalid(msg, func=None):
    """An argument the binding refuses before calling C (same code C uses)."""
    return KvtierError(_EINVAL, msg, strerror(_EINVAL), func)


# ---- keys -------------------------------------------------------------------

class Key(namedtuple("Key", "lo hi")):
    """A 128-bit chunk key (struct kvt_key): two unsigned 64-bit halves."""
    __slots__ = ()

    @classmethod
    def from_int(cls, v):
        v = operator.index(v)
        if v < 0 or v >> 128:
            raise ValueError("a key is an unsigned 128-bit integer")
        return cls(v & 0xFFFFFFFFFFFFFFFF, v >> 64)

    def __int__(self):
        return self.lo | (self.hi << 64)

    def hex(self):
        return "%016x%016x" % (self.hi, self.lo)

    def __repr__(self):
        return "Key(lo=0x%016x, hi=0x%016x)" % (self.lo, self.hi)


if _np is not None:
    _U64 = _np.dtype(_np.uint64)
    _U32 = _np.dtype(_np.uint32)
    _I32 = _np.dtype(_np.int32)
    #: numpy dtype of one key as a 16-byte record; (n, 2) uint64 arrays
    #: (lo, hi rows) are accepted alike.
    KEY_DTYPE = _np.dtype([("lo", "<u8"), ("hi", "<u8")])
else:  # pragma: no cover - numpy is installed where the tests run
    _U64 = _U32 = _I32 = KEY_DTYPE = None


#: A block table entry naming no block (kvt_load leaves that block as it is;
#: kvt_save refuses it): kvtier.h's KVT_BLOCK_SKIP.
BLOCK_SKIP = 0xFFFFFFFF

_ndarray = _np.ndarray if _np is not None else ()
_c_char = ctypes.c_char


def _addr(a):
    """The address of a numpy array's memory (None when empty).  A view of
    a writable buffer through ctypes costs a third of a.ctypes.data."""
    if not a.size:
        return None
    try:
        return ctypes.addressof(_c_char.from_buffer(a))
    except (TypeError, ValueError, BufferError):  # read-only, or not a plain buffer
        return a.ctypes.data


def _key_array(keys, func):
    """keys -> (address of n contiguous kvt_key, n, keepalive).

    The hot path is a numpy array as hash_keys returns it: shape (n, 2)
    uint64 (lo, hi rows) or shape (n,) of KEY_DTYPE, C-contiguous: its
    memory is passed as is.  A bytes-like object of 16 * n bytes (two
    little-endian u64 per key) is passed as is too.  Key objects, (lo, hi)
    pairs and 128-bit ints are converted (a Python object per key)."""
    if type(keys) is _ndarray or isinstance(keys, _ndarray):
        dt = keys.dtype
        if keys.ndim == 2 and keys.shape[1] == 2 and dt == _U64:
            pass
        elif keys.ndim == 1 and dt == KEY_DTYPE:
            pass
        else:
            raise _invalid("keys: a numpy key array has shape (n, 2) and dtype uint64, or "
                           "shape (n,) and dtype kvtier.KEY_DTYPE; got shape %s, dtype %s"
                           % (keys.shape, dt), func)
        if not keys.flags.c_contiguous:
            keys = _np.ascontiguousarray(keys)
        return _addr(keys), keys.shape[0], keys
    if isinstance(keys, (bytes, bytearray, memoryview)):
        mv = memoryview(keys)
        if not mv.c_contiguous:
            raise _invalid("keys: a key buffer must be C-contiguous", func)
        nb = mv.nbytes
        if nb % 16:
            raise _invalid("keys: a key buffer holds 16 bytes per key; got %d bytes" % nb, func)
        if nb == 0:
            return None, 0, None
        if isinstance(keys, bytes):
            return keys, nb // 16, keys
        if mv.readonly:
            b = mv.tobytes()
            return b, nb // 16, b
        c = (ctypes.c_char * nb).from_buffer(mv.cast("B"))
        return ctypes.addressof(c), nb // 16, (c, mv)
    keys = list(keys)
    arr = (L.kvt_key * max(len(keys), 1))()
    for i, k in enumerate(keys):
        if isinstance(k, tuple):
            lo, hi = k
        else:
            lo, hi = Key.from_int(k)
        arr[i].lo = lo
        arr[i].hi = hi
    return ctypes.addressof(arr), len(keys), arr


def _one_key(k, what, func):
    """A single key (Key, (lo, hi), 128-bit int, a row of a key array, or
    16 bytes) -> kvt_key."""
    if _np is not None and isinstance(k, (_np.ndarray, _np.void)):
        a = _np.asarray(k)
        if a.dtype == KEY_DTYPE and a.shape == ():
            return L.kvt_key(int(a["lo"]), int(a["hi"]))
        if a.shape == (2,) and a.dtype.kind in "iu":
            return L.kvt_key(int(a[0]) & 0xFFFFFFFFFFFFFFFF, int(a[1]) & 0xFFFFFFFFFFFFFFFF)
        raise _invalid("%s: a key array row has 2 integers, got shape %s" % (what, a.shape),
                       func)
    if isinstance(k, (bytes, bytearray, memoryview)):
        b = bytes(k)
        if len(b) != 16:
            raise _invalid("%s: a key is 16 bytes, got %d" % (what, len(b)), func)
        return L.kvt_key(int.from_bytes(b[:8], "little"), int.from_bytes(b[8:], "little"))
    lo, hi = k if isinstance(k, tuple) else Key.from_int(k)
    return L.kvt_key(lo, hi)


def _tokens(seq, func):
    """Token ids -> (address of n uint32, n, keepalive), without a copy when
    the memory already holds 32-bit ids: a C-contiguous numpy array or CPU
    tensor of uint32 or int32 (int32 is read as the same bits), an
    array.array of typecode 'I' or 'i', a memoryview of format 'I'/'i'.
    Other integer arrays and tensors (int64, as torch and vLLM keep token
    ids) are range-checked and converted; lists and tuples go through
    array.array, the fastest conversion CPython has.  Rule for negative
    ids: 32-bit signed memory is taken as its bits (-1 is 0xFFFFFFFF, as C
    would read it); any other input must hold 0 .. 2^32 - 1."""
    if _is_torch(seq):
        t = seq.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.dim() != 1:
            raise _invalid("tokens: one-dimensional, got shape %s" % (tuple(t.shape),), func)
        if str(getattr(t, "dtype", "")) in ("torch.int32", "torch.uint32") and \
                t.is_contiguous():
            return t.data_ptr(), t.numel(), t
        # (without numpy, torch's .numpy() raises: through a list)
        seq = t.numpy() if _np is not None else t.tolist()
    if _np is not None and isinstance(seq, _np.ndarray):
        a = seq
        if a.ndim != 1:
            raise _invalid("tokens: one-dimensional, got shape %s" % (a.shape,), func)
        if a.dtype != _U32:
            if a.dtype == _I32:
                a = a.view(_U32)
            elif a.dtype.kind not in "iu":
                raise _invalid("tokens: token ids must be integers, got %s" % a.dtype, func)
            elif a.size and (int(a.min()) < 0 or int(a.max()) > 0xFFFFFFFF):
                raise _invalid("tokens: token ids must fit in uint32", func)
            else:
                a = a.astype(_U32)
        if not a.flags.c_contiguous:
            a = _np.ascontiguousarray(a)
        return _addr(a), a.size, a
    if isinstance(seq, (bytes, bytearray)):
        raise TypeError("tokens: bytes are not token ids (give a uint32 array, or "
                        "memoryview(b).cast('I') for raw little-endian ids)")
    if isinstance(seq, array.array) and seq.itemsize == 4 and seq.typecode in "IiLl":
        return seq.buffer_info()[0], len(seq), seq
    if isinstance(seq, memoryview) and seq.format in ("I", "i", "=I", "<I") and \
            seq.itemsize == 4 and seq.ndim == 1 and seq.c_contiguous:
        if seq.readonly:
            b = seq.tobytes()
            return b, len(seq), b
        c = (ctypes.c_char * seq.nbytes).from_buffer(seq.cast("B"))
        return ctypes.addressof(c), len(seq), (c, seq)
    try:
        a = array.array("I", seq)
    except OverflowError:
        raise _invalid("tokens: token ids must fit in uint32", func) from None
    except TypeError as e:
        raise TypeError("tokens: token ids must be integers (%s)" % e) from None
    return a.buffer_info()[0] if len(a) else None, len(a), a


# ---- buffers ------------------------------------------------------------------

def _is_torch(x):
    """A torch tensor (or anything with its data_ptr/element_size/stride
    protocol); torch itself is never imported."""
    return (not isinstance(x, type) and callable(getattr(x, "data_ptr", None))
            and callable(getattr(x, "element_size", None))
            and callable(getattr(x, "stride", None)))


def _u32(seq, what, func):
    """A sequence of block ids -> (pointer to uint32, length, keepalive, max)."""
    if _is_torch(seq):
        seq = seq.detach().cpu()
        seq = seq.numpy() if _np is not None else seq.tolist()
    if _np is not None:
        a = _np.asarray(seq)
        if a.ndim != 1:
            raise _invalid("%s: a block table is one-dimensional, got shape %s"
                           % (what, a.shape), func)
        if a.size and a.dtype != _np.uint32:
            if a.dtype.kind not in "iu":
                raise _invalid("%s: block ids must be integers, got %s" % (what, a.dtype), func)
            if int(a.min()) < 0 or int(a.max()) > 0xFFFFFFFF:
                raise _invalid("%s: block ids must fit in uint32" % what, func)
        a = _np.ascontiguousarray(a, dtype=_np.uint32)
        mx = int(a.max()) if a.size else -1
        return a.ctypes.data_as(ctypes.POINTER(L.c_u32)), a.size, a, mx
    vals = [operator.index(v) for v in seq]
    if any(v < 0 or v > 0xFFFFFFFF for v in vals):
        raise _invalid("%s: block ids must fit in uint32" % what, func)
    arr = (L.c_u32 * max(len(vals), 1))(*vals)
    return ctypes.cast(arr, ctypes.POINTER(L.c_u32)), len(vals), arr, max(vals, default=-1)


def _is_table_list(x):
    """True when x is a list of per-group tables rather than one table."""
    if _np is not None and isinstance(x, _np.ndarray):
        return x.ndim == 2
    if _is_torch(x):
        return x.dim() == 2
    if isinstance(x, (list, tuple)) and x:
        first = x[0]
        return not isinstance(first, int) and not (
            _np is not None and isinstance(first, _np.integer))
    return False


def _layer_info(x, what, func):
    """A per-layer KV cache -> (base address, block stride, n_blocks, block
    bytes or None, device type or None).  Arrays are [n_blocks, ...] with a
    contiguous block; an int is a raw address."""
    if isinstance(x, int) or (_np is not None and isinstance(x, _np.integer)):
        return int(x), None, None, None, None
    if _is_torch(x):
        if x.dim() < 1:
            raise _invalid("%s: a tensor of at least one dimension ([n_blocks, ...])" % what, func)
        if x.dim() > 1 and not x[0].is_contiguous():
            raise _invalid("%s: the bytes of one block must be contiguous" % what, func)
        es = x.element_size()
        block = es * (x[0].numel() if x.dim() > 1 else 1)
        return x.data_ptr(), x.stride(0) * es, x.shape[0], block, x.device.type
    if _np is not None and isinstance(x, _np.ndarray):
        if x.ndim < 1:
            raise _invalid("%s: an array of at least one dimension ([n_blocks, ...])" % what, func)
        if not x.flags.writeable:
            raise _invalid("%s: the array is read-only (loads write into it)" % what, func)
        inner = x[0] if x.ndim > 1 else None
        if inner is not None and not inner.flags.c_contiguous:
            raise _invalid("%s: the bytes of one block must be contiguous" % what, func)
        block = inner.nbytes if inner is not None else x.itemsize
        if x.strides[0] <= 0:
            raise _invalid("%s: blocks must be at increasing addresses" % what, func)
        return x.__array_interface__["data"][0], x.strides[0], x.shape[0], block, "cpu"
    raise TypeError("%s: expected a numpy array, a torch tensor or an address (int), "
                    "got %s" % (what, type(x).__name__))


# ---- geometry -----------------------------------------------------------------

class Group(namedtuple("Group", "n_layers bytes_per_token tokens_per_block replicated")):
    """One layer group of the KV cache as one rank holds it (kvt_group_desc).

    n_layers         layers in the group
    bytes_per_token  per layer, per rank (heads/world * head_dim * 2 for K+V
                     split into two 'layers', or as the engine stores them)
    tokens_per_block the engine's block size; divides chunk_tokens
    replicated       True for MLA-style caches every rank holds identically
    """
    __slots__ = ()

    def __new__(cls, n_layers, bytes_per_token, tokens_per_block, replicated=False):
        return super().__new__(cls, int(n_layers), int(bytes_per_token),
                               int(tokens_per_block), bool(replicated))

    @property
    def block_bytes(self):
        return self.bytes_per_token * self.tokens_per_block


class Lease:
    """The pins of one lookup (kvt_lookup).

    Attributes: id (0 when nothing hit), hits (chunks).  As a context
    manager it releases the lease on exit unless a load was started through
    it (Tier.load) or its id was handed to the ranks (hand_off): then the
    last rank's load releases it; a request aborted inside the block, or
    never loaded, unpins."""

    __slots__ = ("_tier", "id", "hits", "keys", "pending", "requested", "_loading",
                 "_released", "__weakref__")

    def __init__(self, tier, lease_id, hits, keys=None, pending=0, requested=0):
        self._tier = tier
        self.id = lease_id
        self.hits = hits
        self.keys = keys
        self.pending = pending
        self.requested = requested
        self._loading = False
        self._released = lease_id == 0

    @property
    def loading(self):
        """True once a load of this lease was started through this object."""
        return self._loading

    @property
    def released(self):
        return self._released

    def hand_off(self):
        """The lease id, to send to the ranks that will load it (in other
        processes); from now on their loads release the lease, so the
        context manager no longer does."""
        self._loading = True
        return self.id

    def release(self):
        """kvt_release: True when released now, False when it was released
        already (the library counts that as a double unpin)."""
        if self.id == 0:
            return False
        r = self._tier._release_id(self.id)
        self._released = True
        return r

    def __int__(self):
        return self.id

    __index__ = __int__

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if not self._released and not self._loading and self._tier._h is not None:
            self.release()
        return False

    def __repr__(self):
        return "Lease(id=0x%x, hits=%d%s)" % (
            self.id, self.hits, ", loading" if self._loading else
            (", released" if self._released and self.id else ""))


class Op:
    """An asynchronous save or load (kvt_op).  `count` is the number of
    chunks a save will write (the others were already saved, or found no
    space) or a load reads.  poll()/wait() raise KvtierError when a copy
    failed; once complete they keep returning True."""

    __slots__ = ("_tier", "id", "kind", "count", "_done", "_keep")

    def __init__(self, tier, op_id, kind, count, keep=None):
        self._tier = tier
        self.id = int(op_id)
        self.kind = kind
        self.count = int(count)
        self._done = self.id == 0
        self._keep = keep

    @property
    def done(self):
        return self._done

    def poll(self):
        """kvt_poll: True when complete, False while in progress."""
        if self._done:
            return True
        h = self._tier._handle("kvt_poll")
        r = L.lib().kvt_poll(h, self.id)
        if r == _EINPROGRESS:
            return False
        self._done = True
        self._keep = None
        _check(r, "kvt_poll")
        return True

    def wait(self, timeout=None):
        """kvt_wait: blocks until complete (True) or until timeout seconds
        passed (False; the op stays live).  None: no limit."""
        if self._done:
            return True
        h = self._tier._handle("kvt_wait")
        ns = -1 if timeout is None else max(0, int(timeout * 1e9))
        r = L.lib().kvt_wait(h, self.id, ns)
        if r == _ETIMEDOUT:
            return False
        self._done = True
        self._keep = None
        _check(r, "kvt_wait")
        return True

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if not self._done and self._tier._h is not None:
            if exc_type is None:
                self.wait()
            else:
                try:
                    self.wait()
                except KvtierError:
                    pass  # the first exception is the one to report
        return False

    def __repr__(self):
        return "Op(%s, id=0x%x, chunks=%d%s)" % (self.kind, self.id, self.count,
                                                  ", done" if self._done else "")


def unlink(segment, segment_dir=None):
    """kvt_unlink: removes the segment `segment` (from segment_dir, else
    POSIX shm and the hugetlbfs mounts kvt_open uses).  Processes that map
    it keep their copy.  Raises KvtierError (-ENOENT: no such segment)."""
    func = "kvt_unlink"
    _check(L.lib().kvt_unlink(_enc(segment, "segment"), _enc(segment_dir, "segment_dir")),
           func)


def model_files_id(config_path):
    """kvt_model_files_id: the identity fields of a model's files, as
    kvtierd --model-config appends them to its model text:
    "rev=COMMIT;config=HEX" (a Hugging Face snapshot) or
    "weights=HEX;config=HEX".  Raises KvtierError (-ENOENT: no such file)."""
    func = "kvt_model_files_id"
    buf = ctypes.create_string_buffer(256)
    _check(L.lib().kvt_model_files_id(_enc(config_path, "config_path"), buf, len(buf)), func)
    return buf.value.decode("ascii")


def _enc(s, what):
    if s is None:
        return None
    if isinstance(s, str):
        s = s.encode("utf-8")
    elif not isinstance(s, bytes):
        raise TypeError("%s: expected a string, got %s" % (what, type(s).__name__))
    if b"\0" in s:
        # C would read up to the NUL: "a\0b" would open "a"
        raise _invalid("%s: %r contains a NUL byte" % (what, s), "kvt_open")
    return s


class Tier:
    """A handle on the node's kvtier segment (kvt_open_v .. kvt_close).

    Every option left at None comes from its KVTIER_* variable (unless
    no_env=True), else the library's default.  log: a callable
    log(level, msg) -- level as the logging module's (40 error, 30
    warning, 20 info, 10 debug) -- that gets the library's own lines
    (placement, huge pages, the DMA backend) instead of stderr, from any
    thread, until close(); a logging.Logger's .log fits.  create=True makes this
    process the segment's embedded owner (replace=True: replace an existing
    segment).  Use it as a context manager, or call close().

    One handle is used by one thread at a time (as in C).  Do not use a
    handle in a child created by fork(): open one in the child (the tests
    use multiprocessing's 'spawn' start method)."""

    def __init__(self, segment=None, role=None, rank=None, world=None, instance=None,
                 groups=None, model=None, create=False, replace=False, n_slots=0,
                 n_instances=0, tier_bytes=0, chunk_tokens=0, dma=None,
                 max_inflight=0, segment_dir=None, no_env=False, group_access=False,
                 any_uid=False, prefault=False, log=None):
        self._h = None
        self._log_cb = None
        # kvt_lookup's out-parameter, reused (a handle is one thread's)
        self._lease_out = L.kvt_lease_id()
        self._lease_addr = ctypes.addressof(self._lease_out)
        func = "kvt_open_v"
        cfg = L.kvt_config()
        cfg.size = ctypes.sizeof(L.kvt_config)
        flags = 0
        if create:
            flags |= L.F_CREATE
        if replace:
            if not create:
                raise _invalid("replace=True needs create=True", func)
            flags |= L.F_REPLACE
        if no_env:
            flags |= L.F_NO_ENV
        if group_access:
            flags |= L.F_GROUP
        if any_uid:
            flags |= L.F_ANY_UID
        if prefault:
            flags |= L.F_PREFAULT
        cfg.flags = flags
        if role is None:
            cfg.role = 0
        elif isinstance(role, str):
            if role not in _ROLES:
                raise _invalid("role=%r: expected 'rank', 'scheduler' or 'client'" % role, func)
            cfg.role = _ROLES[role]
        else:
            cfg.role = operator.index(role)
        # None means "from the environment"; the C sentinels are -1 / 0, so
        # a negative value given here is refused rather than read as None.
        for name, v in (("rank", rank), ("instance", instance)):
            if v is None:
                setattr(cfg, name, -1)
            else:
                v = operator.index(v)
                if v < 0 or v > 0x7FFFFFFF:
                    raise _invalid("%s=%d: must be >= 0 (None: from KVTIER_%s)"
                                   % (name, v, name.upper()), func)
                setattr(cfg, name, v)
        for name, v in (("world", world), ("chunk_tokens", chunk_tokens),
                        ("max_inflight", max_inflight), ("n_slots", n_slots),
                        ("n_instances", n_instances)):
            if v is None:
                v = 0
            v = operator.index(v)
            if v < 0 or v > 0xFFFFFFFF:
                raise _invalid("%s=%d: out of range (0 or None: from the environment "
                               "or the default)" % (name, v), func)
            if name == "world" and world is not None and v == 0:
                raise _invalid("world=0: must be >= 1 (None: from KVTIER_WORLD)", func)
            setattr(cfg, name, v)
        tier_bytes = operator.index(tier_bytes or 0)
        if tier_bytes < 0:
            raise _invalid("tier_bytes=%d: must be >= 0" % tier_bytes, func)
        cfg.tier_bytes = tier_bytes
        self._strings = (_enc(segment, "segment"), _enc(segment_dir, "segment_dir"),
                         _enc(model, "model"), _enc(dma, "dma"))
        cfg.segment, cfg.segment_dir, cfg.model, cfg.dma = self._strings
        self.groups = tuple(g if isinstance(g, Group) else Group(*g) for g in (groups or ()))
        if self.groups:
            descs = (L.kvt_group_desc * len(self.groups))()
            for i, g in enumerate(self.groups):
                descs[i].n_layers = g.n_layers
                descs[i].bytes_per_token = g.bytes_per_token
                descs[i].tokens_per_block = g.tokens_per_block
                descs[i].replicated = 1 if g.replicated else 0
            cfg.n_groups = len(self.groups)
            cfg.groups = descs
        if log is not None:
            if not callable(log):
                raise _invalid("log=%r: expected a callable log(level, msg)" % (log,), func)

            def _cb(arg, level, msg, log=log):
                try:
                    log(L.LOG_LEVELS.get(level, 20), msg.decode("utf-8", "replace"))
                except Exception:  # a logger's failure must not reach C
                    pass
            # kept alive while the library may call it: until close()
            self._log_cb = L.LOG_FN(_cb)
            cfg.log = ctypes.cast(self._log_cb, ctypes.c_void_p)
        h = ctypes.c_void_p()
        r = L.lib().kvt_open_v(ctypes.byref(cfg), L.API_VERSION, ctypes.byref(h))
        _check(r, func)
        self._h = h
        self._dma = dma if dma is not None else (None if no_env else os.environ.get("KVTIER_DMA"))
        self._kv = None           # arrays registered (kept alive while open)
        self._n_blocks = None     # per group, after register_kv
        self._role_code = cfg.role
        self.segment = segment
        st = self.stats()
        self.chunk_tokens = st["chunk_tokens"]
        self.world = st["world"]
        self.chunk_bytes = st["chunk_bytes"]
        # Role and rank as the library resolved them (it validated the
        # variables already, so reading them back here cannot disagree).
        env = {} if no_env else os.environ
        if cfg.role == 0:
            self.role = env.get("KVTIER_ROLE", "rank")
        else:
            self.role = _ROLE_NAMES.get(cfg.role, role)
        if rank is None and "KVTIER_RANK" in env:
            rank = int(env["KVTIER_RANK"])
        self.rank = rank

    # -- lifetime --

    def _handle(self, func):
        if self._h is None:
            raise KvtierError(_ESTALE, "the tier is closed", strerror(_ESTALE), func)
        return self._h

    def close(self):
        """kvt_close: waits for this handle's operations, aborts unfinished
        saves, detaches.  Idempotent."""
        h, self._h = self._h, None
        if h is not None:
            L.lib().kvt_close(h)
        self._kv = None
        self._log_cb = None

    @property
    def closed(self):
        return self._h is None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def __reduce__(self):
        raise TypeError("a Tier handle cannot be pickled: open one in each process")

    def __repr__(self):
        return "Tier(segment=%r, role=%s, rank=%s, world=%s%s)" % (
            self.segment, self.role, self.rank, getattr(self, "world", None),
            ", closed" if self._h is None else "")

    # -- registration --

    def register_kv(self, groups=None, layers=None):
        """kvt_register_kv: this rank's KV cache, once.

        groups: one entry per layer group given at open, each either
          * a list of per-layer caches (numpy arrays or torch tensors of
            shape [n_blocks, block_size, heads, head_dim], or any shape
            whose first dimension is the block and whose block is
            contiguous): bases, block stride and n_blocks come from them;
          * (layers, block_stride, n_blocks) where layers are arrays or raw
            addresses (ints); block_stride/n_blocks None: from the arrays.
        layers: shorthand for groups=[layers] (one group).
        The arrays are kept alive until close()."""
        func = "kvt_register_kv"
        h = self._handle(func)
        if layers is not None:
            if groups is not None:
                raise _invalid("give groups or layers, not both", func)
            groups = [layers]
        if groups is None:
            raise _invalid("register_kv: no KV cache given", func)
        groups = list(groups)
        if len(groups) != len(self.groups):
            raise _invalid("register_kv: %d groups given, the tier was opened with %d"
                           % (len(groups), len(self.groups)), func)
        bufs = (L.kvt_group_buffers * max(len(groups), 1))()
        keep = []
        n_blocks_of = []
        for gi, (entry, desc) in enumerate(zip(groups, self.groups)):
            stride = nblk = None
            if isinstance(entry, tuple) and len(entry) == 3 and \
                    isinstance(entry[0], (list, tuple)) and \
                    (entry[1] is None or isinstance(entry[1], int)):
                entry, stride, nblk = entry
            entry = list(entry)
            if len(entry) != desc.n_layers:
                raise _invalid("groups[%d]: %d layers given, the group has %d"
                               % (gi, len(entry), desc.n_layers), func)
            bases = (L.c_u64 * max(len(entry), 1))()
            for li, x in enumerate(entry):
                what = "groups[%d] layer %d" % (gi, li)
                base, s, nb, block, dev = _layer_info(x, what, func)
                if dev is not None and dev != "cpu" and (self._dma or "") == "host":
                    raise _invalid("%s: a %s tensor with the host DMA backend "
                                   "(host memory only)" % (what, dev), func)
                if block is not None and block != desc.block_bytes:
                    raise _invalid("%s: a block holds %d bytes, the group says "
                                   "tokens_per_block*bytes_per_token = %d"
                                   % (what, block, desc.block_bytes), func)
                if s is not None:
                    if stride is None:
                        stride = s
                    elif s != stride:
                        raise _invalid("%s: block stride %d differs from the group's %d"
                                       % (what, s, stride), func)
                if nb is not None:
                    if nblk is None:
                        nblk = nb
                    elif nb != nblk:
                        raise _invalid("%s: %d blocks, the group's other layers %d"
                                       % (what, nb, nblk), func)
                bases[li] = base
                keep.append(x)
            if stride is None or nblk is None:
                raise _invalid("groups[%d]: block_stride and n_blocks are needed with "
                               "raw addresses" % gi, func)
            bufs[gi].layer_base = bases
            bufs[gi].block_stride = stride
            bufs[gi].n_blocks = nblk
            keep.append(bases)
            n_blocks_of.append(nblk)
        _check(L.lib().kvt_register_kv(h, len(groups), bufs), func)
        self._kv = keep
        self._n_blocks = n_blocks_of

    # -- keys --

    def hash_tokens(self, tokens, parent=None):
        """kvt_hash_tokens: the keys of the full chunks of a token sequence,
        as a list of Key (a Python object per key: hash_keys is the fast
        path).  parent: the key that precedes the first chunk (default: the
        layout fingerprint's root)."""
        keys = self.hash_keys(tokens, parent)
        if _np is not None:
            return [Key(int(lo), int(hi)) for lo, hi in keys.tolist()]
        return [Key(int.from_bytes(keys[i:i + 8], "little"),
                    int.from_bytes(keys[i + 8:i + 16], "little"))
                for i in range(0, len(keys), 16)]

    def hash_keys(self, tokens, parent=None, out=None):
        """kvt_hash_tokens into one contiguous buffer: a numpy uint64 array
        of shape (n, 2), one (lo, hi) row per full chunk (a bytearray of
        16 * n bytes where numpy is absent), which lookup and save take
        straight.  tokens: see _tokens (uint32/int32 memory is read in
        place).  parent: a Key, a row of a key array, or 16 bytes.  out: a
        C-contiguous uint64 (m, 2) array to write into (at most m keys);
        the returned array is then a view of it."""
        func = "kvt_hash_tokens"
        h = self._h
        if h is None:
            h = self._handle(func)
        addr, n, keep = _tokens(tokens, func)
        n_keys = n // self.chunk_tokens
        if out is None:
            if _np is not None:
                out = _np.empty((n_keys, 2), _U64)
                oaddr = _addr(out)
            else:
                out = bytearray(16 * n_keys)
                oaddr = ctypes.addressof((ctypes.c_char * max(len(out), 1)).from_buffer(out)) \
                    if n_keys else None
        else:
            if not (_np is not None and isinstance(out, _np.ndarray) and out.ndim == 2
                    and out.shape[1] == 2 and out.dtype == _U64 and out.flags.c_contiguous
                    and out.flags.writeable):
                raise _invalid("out: a writable C-contiguous uint64 array of shape (m, 2)",
                               func)
            n_keys = min(n_keys, out.shape[0])
            oaddr = _addr(out)
        par = None
        if parent is not None:
            par = ctypes.byref(_one_key(parent, "parent", func))
        r = L.lib().fast.kvt_hash_tokens(h, addr, n, par, oaddr, n_keys)
        if r < 0:
            _raise(r, func)
        del keep
        if r != len(out) and _np is not None:
            return out[:r]
        return out

    @property
    def fingerprint(self):
        """kvt_fingerprint: the layout fingerprint (a Key)."""
        k = L.kvt_key()
        L.lib().kvt_fingerprint(self._handle("kvt_fingerprint"), ctypes.byref(k))
        return Key(k.lo, k.hi)

    @property
    def segment_model(self):
        """kvt_segment_model: the model text the segment's creator gave
        (its identity), for a process that attached without describing
        the layout and checks whose segment it joined."""
        buf = ctypes.create_string_buffer(1024)
        func = "kvt_segment_model"
        _check(L.lib().kvt_segment_model(self._handle(func), buf, len(buf)), func)
        return buf.value.decode("ascii", "replace")

    # -- scheduler --

    def lookup(self, keys):
        """kvt_lookup: the longest READY prefix of keys, pinned under a new
        Lease (hits, id).  Raises KvtierError (-ENOSPC: lease table full)."""
        func = "kvt_lookup"
        h = self._h
        if h is None:
            h = self._handle(func)
        addr, n, keep = _key_array(keys, func)
        r = L.lib().fast.kvt_lookup(h, addr, n, self._lease_addr)
        if r < 0:
            _raise(r, func)
        return Lease(self, self._lease_out.value, r)

    def lookup_ex(self, keys, promote=True, first_depth=0):
        """kvt_lookup_ex: like lookup, and the view of the tiers below DRAM.
        The Lease also has pending (chunks right after the hits that the
        disk tier holds or is reading back, or that kvtierd's L3 was asked
        for and is getting) and requested (of those, asked back by this
        call; promote=False only reports).  When pending > 0 a scheduler
        may release the lease and ask again next step.  first_depth: the
        prefix depth of keys[0] (0: they start the prompt), at which the L3
        is asked for each chunk; None: not known, the L3 is not asked."""
        func = "kvt_lookup_ex"
        h = self._handle(func)
        addr, n, keep = _key_array(keys, func)
        res = L.kvt_lookup_res()
        res.size = ctypes.sizeof(res)
        flags = L.LOOKUP_PROMOTE if promote else 0
        if first_depth is not None:
            try:
                first_depth = operator.index(first_depth)
            except TypeError:
                first_depth = -1
            if not 0 <= first_depth < 2 ** 32:
                raise ValueError("first_depth: an int in [0, 2**32), not %r" % (first_depth,))
            res.first_depth = first_depth
            flags |= L.LOOKUP_DEPTH
        r = L.lib().kvt_lookup_ex(h, addr, n, flags, ctypes.byref(res))
        if r < 0:
            _raise(r, func)
        return Lease(self, res.lease, res.hits, pending=res.pending, requested=res.requested)

    def _release_id(self, lease_id):
        func = "kvt_release"
        r = L.lib().kvt_release(self._handle(func), int(lease_id))
        if r == _EALREADY:
            return False
        _check(r, func)
        return True

    def release(self, lease):
        """kvt_release (a Lease or a lease id): True when released now,
        False when it was released already."""
        if isinstance(lease, Lease):
            return lease.release()
        return self._release_id(lease)

    def step(self, leases=()):
        """kvt_step: one scheduler iteration; leases (Lease objects or ids)
        are this step's load set.  Returns how many stale leases it
        released."""
        func = "kvt_step"
        h = self._handle(func)
        ids = [int(x) for x in leases]
        arr = (L.kvt_lease_id * max(len(ids), 1))(*ids)
        return _check(L.lib().kvt_step(h, arr, len(ids)), func)

    def reap(self):
        """kvt_reap: reaps dead processes' state; returns how many."""
        func = "kvt_reap"
        return _check(L.lib().kvt_reap(self._handle(func)), func)

    def stats(self):
        """kvt_stats: the segment's counters and occupancy, as a dict."""
        func = "kvt_stats"
        h = self._handle(func)
        st = L.kvt_stats()
        st.size = ctypes.sizeof(L.kvt_stats)
        _check(L.lib().kvt_stats(h, ctypes.byref(st)), func)
        return {name: getattr(st, name) for name, _ in L.kvt_stats._fields_
                if name != "size"}

    # -- ranks --

    def _tables(self, table, n, func):
        """Block tables -> (const uint32_t *const * array, keepalive), after
        checking each holds n * blocks_per_chunk(g) ids (C reads that many)."""
        ng = len(self.groups)
        if ng == 0:
            raise _invalid("this tier was opened without groups: it has no KV layout", func)
        if _is_table_list(table):
            tables = list(table)
            if len(tables) != ng:
                raise _invalid("block tables: %d given, the layout has %d groups"
                               % (len(tables), ng), func)
        else:
            tables = [table] * ng
            if len({g.tokens_per_block for g in self.groups}) > 1:
                raise _invalid("block tables: the groups' block sizes differ; give one "
                               "table per group", func)
        arr = (ctypes.POINTER(L.c_u32) * ng)()
        keep = []
        converted = {}
        for gi, (t, g) in enumerate(zip(tables, self.groups)):
            need = n * (self.chunk_tokens // g.tokens_per_block)
            if id(t) in converted:
                ptr, length, k, mx = converted[id(t)]
            else:
                ptr, length, k, mx = _u32(t, "block table %d" % gi, func)
                converted[id(t)] = (ptr, length, k, mx)
            if length < need:
                raise _invalid("block table %d: %d block ids for %d chunks of %d blocks "
                               "(%d needed)" % (gi, length, n,
                                                self.chunk_tokens // g.tokens_per_block,
                                                need), func)
            arr[gi] = ptr
            keep.append(k)
        return arr, keep

    def save(self, keys, block_table, first_depth=0):
        """kvt_save: saves this rank's shard of the chunks keys[i] (at prefix
        depth first_depth + i) from the blocks of block_table (one table,
        or a list per group: chunk i is blocks [i*bpc, (i+1)*bpc) with bpc
        = chunk_tokens // tokens_per_block).  Returns an Op; Op.count is
        the number of chunks it will write."""
        func = "kvt_save"
        h = self._handle(func)
        karr, n, kkeep = _key_array(keys, func)
        tabs, tkeep = self._tables(block_table, n, func)
        op = L.kvt_op()
        r = _check(L.lib().fast.kvt_save(h, karr, n, operator.index(first_depth), tabs,
                                         ctypes.byref(op)), func)
        return Op(self, op.value, "save", r, (kkeep, tkeep))

    def order_after(self, stream):
        """kvt_order_after: the saves that follow copy only after the work
        queued so far on the engine's stream (cuda: a CUstream handle, as
        torch.cuda.current_stream().cuda_stream; host: nothing to order;
        hsa: refused, synchronize the stream instead)."""
        func = "kvt_order_after"
        _check(L.lib().kvt_order_after(self._handle(func), operator.index(stream)), func)

    def load(self, lease, block_table, n=None):
        """kvt_load: loads the first n chunks (default: all the lease's hits)
        of a lease into the blocks of block_table; an entry BLOCK_SKIP
        leaves that block of the cache untouched.  lease: a Lease, or a
        lease id (int; then n is required).  Returns an Op."""
        func = "kvt_load"
        h = self._handle(func)
        if isinstance(lease, Lease):
            lid = lease.id
            if n is None:
                n = lease.hits
        else:
            lid = operator.index(lease)
            if n is None:
                raise _invalid("load: n is required with a lease id (a Lease knows its hits)",
                               func)
        n = operator.index(n)
        if n < 0:
            raise _invalid("load: n=%d is negative" % n, func)
        tabs, tkeep = self._tables(block_table, n, func)
        op = L.kvt_op()
        _check(L.lib().kvt_load(h, lid, n, tabs, ctypes.byref(op)), func)
        if isinstance(lease, Lease):
            lease._loading = True
        return Op(self, op.value, "load", n, tkeep)
