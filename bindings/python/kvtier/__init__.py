"""kvtier: Python binding (ctypes) of libkvtier, the node-local shared-memory
KV-cache tier.  No compiler is needed: the package loads libkvtier.so from
$KVTIER_LIBRARY, else next to this package (a copy placed by install), else
the source tree's build/tier/, else the system library path.

    import kvtier
    groups = [kvtier.Group(n_layers=32, bytes_per_token=256, tokens_per_block=16)]
    with kvtier.Tier(segment="demo", role="scheduler", world=4, groups=groups) as sched:
        keys = sched.hash_tokens(prompt_tokens)
        with sched.lookup(keys) as lease:   # released on exit unless loaded
            ...                              # hand lease.id to the ranks

    # on rank r (its own process):
    with kvtier.Tier(segment="demo", role="rank", rank=r, world=4, groups=groups) as t:
        t.register_kv(groups=[[layer0, layer1, ...]])   # numpy / torch [n_blocks, ...]
        t.load(lease_id, block_table, n=hits).wait()
        t.save(keys, block_table).wait()

Failures raise KvtierError (code, message: kvt_last_error(), strerror).
"""

from ._errors import KvtierError
from ._lib import (API_VERSION, F_ANY_UID, F_CREATE, F_GROUP, F_NO_ENV, F_PREFAULT,
                   F_REPLACE, TIER_CLIENT, TIER_RANK, TIER_SCHEDULER, LibraryNotFound,
                   library_path)
from ._tier import (BLOCK_SKIP, KEY_DTYPE, Group, Key, Lease, Op, Tier, last_error,
                    model_files_id, strerror, unlink)

__version__ = "0.1.0"

__all__ = [
    "API_VERSION", "BLOCK_SKIP", "Group", "KEY_DTYPE", "Key", "KvtierError", "Lease", "LibraryNotFound", "Op", "Tier",
    "last_error", "library_path", "model_files_id", "strerror", "unlink",
    "TIER_RANK", "TIER_SCHEDULER", "TIER_CLIENT",
    "F_CREATE", "F_REPLACE", "F_NO_ENV", "F_GROUP", "F_ANY_UID", "F_PREFAULT",
]
