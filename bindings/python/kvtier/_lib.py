"""ctypes mirror of tier/include/kvtier.h and the loader of libkvtier.so.

The structures below are the header's, field for field; a size field is
always set to ctypes.sizeof of its structure.  Nothing here is compiled:
the package needs only the shared library at run time.
"""

import ctypes
import ctypes.util
import os
import threading

#: The version of kvtier.h this binding was written against; passed to
#: kvt_open_v, which refuses a version the library does not speak.
API_VERSION = 5

# Roles (kvtier.h KVT_TIER_*).
TIER_RANK = 1
TIER_SCHEDULER = 2
TIER_CLIENT = 3

# Flags of struct kvt_config (kvtier.h KVT_F_*).
F_CREATE = 0x01
F_REPLACE = 0x02
F_NO_ENV = 0x04
F_GROUP = 0x08
F_ANY_UID = 0x10
F_PREFAULT = 0x20
F_MASK = 0x3F

c_u32 = ctypes.c_uint32
c_u64 = ctypes.c_uint64
kvt_lease_id = ctypes.c_uint64
kvt_op = ctypes.c_uint64


class kvt_key(ctypes.Structure):
    _fields_ = [("lo", c_u64), ("hi", c_u64)]


class kvt_group_desc(ctypes.Structure):
    _fields_ = [
        ("n_layers", c_u32),
        ("bytes_per_token", c_u32),
        ("tokens_per_block", c_u32),
        ("replicated", c_u32),
    ]


class kvt_config(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("flags", c_u32),
        ("role", c_u32),
        ("instance", ctypes.c_int32),
        ("rank", ctypes.c_int32),
        ("world", c_u32),
        ("chunk_tokens", c_u32),
        ("segment", ctypes.c_char_p),
        ("segment_dir", ctypes.c_char_p),
        ("model", ctypes.c_char_p),
        ("dma", ctypes.c_char_p),
        ("max_inflight", c_u32),
        ("n_groups", c_u32),
        ("groups", ctypes.POINTER(kvt_group_desc)),
        ("n_slots", c_u32),
        ("n_instances", c_u32),
        ("tier_bytes", c_u64),
        ("disk_chunks", c_u64),
        ("log", ctypes.c_void_p),      # LOG_FN, as an address (see _tier.Tier)
        ("log_arg", ctypes.c_void_p),
        ("reserved", c_u64 * 1),
    ]


#: config.log: void (*)(void *arg, int level, const char *msg)
LOG_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p)
#: its levels (KVT_LOG_LEVEL_*) and the logging module's
LOG_LEVELS = {0: 40, 1: 30, 2: 20, 3: 10}


class kvt_group_buffers(ctypes.Structure):
    _fields_ = [
        ("layer_base", ctypes.POINTER(c_u64)),
        ("block_stride", c_u64),
        ("n_blocks", c_u64),
    ]


STATS_FIELDS = (
    "lookups", "lookup_chunks", "hit_chunks", "hit_tokens",
    "saved_chunks", "save_skips", "save_nospc", "loaded_chunks",
    "bytes_saved", "bytes_loaded", "evictions", "stale_unpins",
    "double_unpins", "reaped_ranks", "dma_errors",
    "slots", "slots_free", "slots_filling", "slots_ready", "slots_pinned",
    "leases_live", "chunk_bytes",
)


STATS_DISK_FIELDS = (
    "disk_chunks", "disk_used", "disk_writes", "disk_reads",
    "disk_bytes_written", "disk_bytes_read", "disk_checksum_errors",
    "disk_admit_rejects", "disk_evictions", "promote_requests", "promote_drops",
)


class kvt_stats(ctypes.Structure):
    _fields_ = ([("size", ctypes.c_size_t)]
                + [(name, c_u64) for name in STATS_FIELDS]
                + [("chunk_tokens", c_u32), ("world", c_u32)]
                + [(name, c_u64) for name in STATS_DISK_FIELDS]
                + [("disk_online", c_u32), ("reserved0", c_u32)])


LOOKUP_PROMOTE = 0x1
LOOKUP_DEPTH = 0x2


class kvt_lookup_res(ctypes.Structure):
    _fields_ = [
        ("size", ctypes.c_size_t),
        ("lease", c_u64),
        ("hits", c_u32),
        ("pending", c_u32),
        ("requested", c_u32),
        ("first_depth", c_u32),
        ("reserved", c_u64 * 2),
    ]


_P = ctypes.POINTER
_tier_p = ctypes.c_void_p  # kvt_tier * (opaque)
_tables_p = _P(_P(c_u32))  # const uint32_t *const *

# name: (restype, argtypes), exactly the header's prototypes.
_PROTOTYPES = {
    "kvt_open_v": (ctypes.c_int, [_P(kvt_config), ctypes.c_uint, _P(_tier_p)]),
    "kvt_close": (None, [_tier_p]),
    "kvt_register_kv": (ctypes.c_int, [_tier_p, c_u32, _P(kvt_group_buffers)]),
    "kvt_hash_tokens": (ctypes.c_int, [_tier_p, _P(c_u32), ctypes.c_size_t,
                                       _P(kvt_key), _P(kvt_key), ctypes.c_size_t]),
    "kvt_lookup": (ctypes.c_int, [_tier_p, _P(kvt_key), c_u32, _P(kvt_lease_id)]),
    "kvt_lookup_ex": (ctypes.c_int, [_tier_p, ctypes.c_void_p, c_u32, c_u32,
                                     _P(kvt_lookup_res)]),
    "kvt_save": (ctypes.c_int, [_tier_p, _P(kvt_key), c_u32, c_u32, _tables_p,
                                _P(kvt_op)]),
    "kvt_load": (ctypes.c_int, [_tier_p, kvt_lease_id, c_u32, _tables_p, _P(kvt_op)]),
    "kvt_order_after": (ctypes.c_int, [_tier_p, ctypes.c_uint64]),
    "kvt_poll": (ctypes.c_int, [_tier_p, kvt_op]),
    "kvt_wait": (ctypes.c_int, [_tier_p, kvt_op, ctypes.c_int64]),
    "kvt_release": (ctypes.c_int, [_tier_p, kvt_lease_id]),
    "kvt_step": (ctypes.c_int, [_tier_p, _P(kvt_lease_id), c_u32]),
    "kvt_reap": (ctypes.c_int, [_tier_p]),
    "kvt_stats": (ctypes.c_int, [_tier_p, _P(kvt_stats)]),
    "kvt_fingerprint": (None, [_tier_p, _P(kvt_key)]),
    "kvt_model_files_id": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_size_t]),
    "kvt_segment_model": (ctypes.c_int, [_tier_p, ctypes.c_char_p, ctypes.c_size_t]),
    "kvt_unlink": (ctypes.c_int, [ctypes.c_char_p, ctypes.c_char_p]),
    "kvt_strerror": (ctypes.c_char_p, [ctypes.c_int]),
    "kvt_last_error": (ctypes.c_char_p, []),
}

#: The exported symbols the binding needs (the library's version script
#: exports exactly these).
SYMBOLS = tuple(_PROTOTYPES)

# The hot path's second face of three of them: every pointer a plain
# address (c_void_p takes an int), so a call converts no ctypes objects.
_FAST_PROTOTYPES = {
    "kvt_hash_tokens": (ctypes.c_int, [_tier_p, ctypes.c_void_p, ctypes.c_size_t,
                                       ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]),
    "kvt_lookup": (ctypes.c_int, [_tier_p, ctypes.c_void_p, c_u32, ctypes.c_void_p]),
    "kvt_save": (ctypes.c_int, [_tier_p, ctypes.c_void_p, c_u32, c_u32, _tables_p,
                                _P(kvt_op)]),
}

_LIBNAMES = ("libkvtier.so", "libkvtier.so.1")


def _candidates():
    """Where libkvtier.so is looked for, in order: (path, origin)."""
    env = os.environ.get("KVTIER_LIBRARY")
    if env:
        # An explicit choice is final: no silent fallback to another copy.
        return [(env, "$KVTIER_LIBRARY")]
    here = os.path.dirname(os.path.abspath(__file__))
    out = [(os.path.join(here, n), "the package directory") for n in _LIBNAMES]
    # The source tree: bindings/python/kvtier/ -> <repo>/build/tier/.
    root = os.path.dirname(os.path.dirname(os.path.dirname(here)))
    out += [(os.path.join(root, "build", "tier", n), "the build tree") for n in _LIBNAMES]
    found = ctypes.util.find_library("kvtier")
    if found:
        out.append((found, "the system library path"))
    return out


class LibraryNotFound(ImportError):
    pass


def _load():
    tried = []
    for path, origin in _candidates():
        if origin != "$KVTIER_LIBRARY" and origin != "the system library path" \
                and not os.path.exists(path):
            tried.append(path)
            continue
        try:
            lib = ctypes.CDLL(path)
        except OSError as e:
            if origin == "$KVTIER_LIBRARY":
                raise LibraryNotFound("KVTIER_LIBRARY=%s: %s" % (path, e)) from None
            tried.append("%s (%s)" % (path, e))
            continue
        missing = [s for s in SYMBOLS if not hasattr(lib, s)]
        if missing:
            raise LibraryNotFound("%s (from %s) lacks %s: not a kvtier library of API "
                                  "version %d" % (path, origin, ", ".join(missing),
                                                  API_VERSION))
        for name, (res, args) in _PROTOTYPES.items():
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
        lib._kvtier_path = path
        lib.fast = type("fast", (), {})()
        for name, (res, args) in _FAST_PROTOTYPES.items():
            setattr(lib.fast, name, ctypes.CFUNCTYPE(res, *args)((name, lib)))
        return lib
    raise LibraryNotFound("libkvtier.so not found; build it (cmake --build build --target "
                          "kvtier) or set KVTIER_LIBRARY. Tried: " + "; ".join(tried))


_lib = None
_lock = threading.Lock()


def lib():
    """The loaded library (loaded on first use)."""
    global _lib
    if _lib is None:
        with _lock:
            if _lib is None:
                _lib = _load()
    return _lib


def library_path():
    """The path of the libkvtier.so in use."""
    return lib()._kvtier_path
