"""kvtier._connect: what every engine connector shares -- reading a
setting from the engine's extra config or a KVTIER_* variable, and
attaching to the node's segment (creating it when nobody has)."""
import errno
import os
import time

from ._errors import KvtierError
from ._tier import Tier


def opt(extra, key, env, default, conv=str, where="extra config"):
    """extra[key], else $env, else default, converted by conv; a bad or
    empty value is an error naming where it came from."""
    if extra and key in extra and extra[key] is not None:
        v = extra[key]
        what = "%s[%r]" % (where, key)
    elif os.environ.get(env) is not None:
        v = os.environ[env]
        what = env
        if v == "":
            raise ValueError("kvtier: %s is set but empty: unset it or give a value" % env)
    else:
        return default
    try:
        return conv(v)
    except (TypeError, ValueError):
        raise ValueError("kvtier: %s=%r: expected %s" % (what, v, conv.__name__)) from None


def as_bool(v):
    """on/off, 1/0, true/false, yes/no in any case (or a bool)."""
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ValueError(v)


def open_segment(kw, create, n_instances, tier_gib, deadline_s=30.0):
    """Tier(**kw), attaching first (wherever kvt_open finds the segment:
    the segment dir, /dev/shm, a hugetlbfs mount); with create, making it
    only where there is none, and attaching again when another process
    made it meanwhile (EEXIST).  A segment whose creator is still writing
    its header (EPROTO) is waited for, up to deadline_s."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            return Tier(**kw)
        except KvtierError as e:
            if e.errno == errno.EPROTO and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            if e.errno != errno.ENOENT or not create:
                raise
        try:
            return Tier(create=True, n_instances=n_instances,
                        tier_bytes=int(tier_gib * (1 << 30)), **kw)
        except KvtierError as e:
            if e.errno != errno.EEXIST:
                raise
