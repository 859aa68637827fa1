"""kvtier.vllm._caches: which of vLLM's KV caches a chunk holds, and how
each becomes kvtier groups.

vLLM's KV cache config is a list of KV cache groups, each with one block
table (one block size) and one or more layers.  Since vLLM 0.31 a group's
layers need not share a page: with the hybrid allocator on (the connector
is SupportsHMA) DeepSeek V4 has groups of several block sizes (256, 64, 8,
4 tokens) whose layers hold other caches -- its compressed MLA caches (one
state per 4 or 128 tokens), the indexer's keys, the compressor's running
state, the sparse-SWA cache -- and DeepSeek V3.2 / GLM-5.x put the MLA
cache and the indexer's keys (another page) in one group.  The workers get
each layer's own spec (a UniformTypeKVCacheSpecs per group); the scheduler
one spec per group, the first layer's (vLLM's
generate_scheduler_kv_cache_config).

A vLLM group that kvtier keeps ("vgroup") is planned as:

  * its kind, from its layers' spec class: full attention and MLA (also
    with several tokens per state, also the indexer's MLA-shaped cache)
    are kept whole; sliding window (and its MLA form) and chunked local
    attention by the window rules (_scheduler.py).  Anything else, or a
    group vLLM does not let a connector restore (not prefix-cacheable:
    bounded replay), refuses the model by name.  A group vLLM marks not
    transferable (enable_kv_transfer off: a replica it rebuilds from its
    source group after a load) is left out.
  * the blocks of a chunk it keeps: all of them (chunk_tokens / block
    size), or for a sliding window only the window's tail.  A hit that
    ends at a chunk's end needs, of a window w (plus vLLM's retained
    tokens), the last ceil((w - 1) / block) blocks before it: vLLM's
    SlidingWindowManager pads every earlier block with its null block,
    for local hits and for a connector's (allocate_external_computed_
    blocks).  So kvtier stores those "tail" blocks of each chunk and no
    others: DeepSeek V4's compressor state (32 KiB a block of 4 or 8
    tokens, a window of 8 or 128) would otherwise be 75 % of a chunk,
    and a chunk is saveable in the step it becomes full even after
    earlier blocks of the window were freed.  The tail is rounded up to
    divide the chunk's blocks; a window longer than a chunk keeps every
    block (and the hole rule of _scheduler.py).
  * kvtier groups ("kgroups"): the vgroup's layers split by the shape of
    their block -- the runs the resolved layout makes of a page
    (_layout.py) and their bytes -- each kgroup one kvtier group whose
    blocks are the vgroup's, with tokens_per_block = chunk_tokens /
    blocks kept.  A page whose data does not divide into whole bytes per
    such "token" (DeepSeek V4's fp8_ds_mla at 128 tokens a state: 1,168
    bytes a 256-token block) is copied rounded up into the page's own
    alignment padding (1,280 of its 1,728 bytes): those bytes are no
    layer's data, and the worker checks they overlap no other layer's
    (_worker.register_kv_caches).  Where the padding is too short the
    model is refused by name.

Every cache of a vgroup is saved and loaded, not a layer count's worth; a
model needing more than kvtier's 8 groups is refused with its groups
listed.
"""
import hashlib
import math

import kvtier

from ._layout import runs_per_block

MAX_GROUPS = 8


def group_kind(spec):
    """(kind, parameter) of a layer's KV cache spec: ("full"|"mla", None),
    ("sliding"|"sliding-mla", window), ("chunked", chunk size), or (None,
    None) for a spec kvtier cannot store exactly.  By exact class: a
    subclass (sink, reversed-window, hidden-state caches) has its own
    block rules."""
    name = type(spec).__name__
    if name == "FullAttentionSpec":
        return "full", None
    if name == "MLAAttentionSpec":
        return "mla", None
    if name in ("SlidingWindowSpec", "SlidingWindowMLASpec"):
        return ("sliding-mla" if "MLA" in name else "sliding"), int(spec.sliding_window)
    if name == "ChunkedLocalAttentionSpec":
        return "chunked", int(spec.attention_chunk_size)
    return None, None


def layer_specs(group):
    """[(layer name, its spec)] of a KV cache group: a
    UniformTypeKVCacheSpecs names each layer's; otherwise the group's spec
    is every layer's (on the scheduler, the first layer's)."""
    spec = group.kv_cache_spec
    per = getattr(spec, "kv_cache_specs", None)
    if isinstance(per, dict) and per:
        return [(n, per[n]) for n in group.layer_names]
    return [(n, spec) for n in group.layer_names]


def _data_bytes(spec):
    """The bytes of a page its layer uses (a padded page's data)."""
    real = getattr(spec, "real_page_size_bytes", None)
    return int(real) if real else int(spec.page_size_bytes)


def describe(spec):
    """What gives a cache's bytes their meaning, as text (the identity's
    caches field)."""
    f = [type(spec).__name__, "bs=%d" % spec.block_size]
    for a in ("num_heads", "head_size", "head_size_v", "tokens_per_state",
              "state_content_size_bytes", "page_size_bytes", "cache_dtype_str",
              "kv_quant_mode", "sliding_window", "attention_chunk_size",
              "extra_retained_tokens", "cache_role", "model_version"):
        try:
            v = getattr(spec, a)
        except (AttributeError, NotImplementedError, AssertionError):
            continue
        if v is not None:
            f.append("%s=%s" % (a, getattr(v, "value", v)))
    f.append("dtype=%s" % str(getattr(spec, "dtype", "")).replace("torch.", ""))
    return ",".join(f)


def is_special(spec):
    """A cache whose bytes the model identity's plain fields (dtype, kv,
    layout) do not describe: several tokens per state, a packed or padded
    page, an indexer or one of DeepSeek's sparse-MLA caches."""
    role = getattr(getattr(spec, "cache_role", None), "value", None)
    return bool(getattr(spec, "tokens_per_state", 1) != 1 or
                getattr(spec, "state_content_bytes", None) is not None or
                getattr(spec, "page_size_padded", None) is not None or
                getattr(spec, "model_version", None) or
                getattr(spec, "is_index_group_leader", False) or
                role == "indexer")


class VGroup:
    """One vLLM KV cache group kvtier keeps."""

    def __init__(self, index, kind, window, block_size, bpc, tail, replicated):
        self.index = index            # in kv_cache_config.kv_cache_groups
        self.kind = kind
        self.window = window          # None, ("sliding", w) or ("chunked", a)
        self.block_size = block_size
        self.bpc = bpc                # vLLM blocks per chunk
        self.tail = tail              # of them, the last `tail` are kept
        self.replicated = replicated

    def chunk_table(self, blocks, c):
        """The blocks of chunk c that kvtier keeps, from the request's list."""
        return blocks[(c + 1) * self.bpc - self.tail:(c + 1) * self.bpc]

    def __repr__(self):
        return "VGroup(%d, %s, bs=%d, %d/%d blocks)" % (self.index, self.kind,
                                                        self.block_size, self.tail, self.bpc)


class KGroup:
    """One kvtier group: layers of one vgroup whose blocks have one shape."""

    def __init__(self, vg, pieces, data, bpt, tpb, replicated):
        self.vg = vg                  # index into Plan.vgroups
        self.pieces = pieces          # kvtier layers per vLLM layer (runs of its block)
        self.data = data              # bytes of a run that are the layer's data
        self.bpt = bpt                # kvtier bytes per token
        self.tpb = tpb                # kvtier tokens per block
        self.replicated = replicated
        self.layers = []              # vLLM layer names

    @property
    def run(self):
        """Bytes kvtier copies of each run (>= data: rounded into padding)."""
        return self.bpt * self.tpb

    def group(self):
        return kvtier.Group(self.pieces * len(self.layers), self.bpt, self.tpb, self.replicated)


def _tail_blocks(window, extra, block_size, bpc):
    """Blocks of a chunk a hit ending at its end needs, of a sliding window
    (see the module's comment); bpc when the window reaches past it."""
    need = max(1, -(-(window - 1 + extra) // block_size))
    if need >= bpc:
        return bpc
    while bpc % need:
        need += 1
    return need


class Plan:
    """The vgroups and kgroups of a KV cache config (see the module's
    comment).  Raises ValueError naming what kvtier cannot keep."""

    def __init__(self, kv_cache_config, layout, chunk_tokens):
        self.vgroups, self.kgroups = [], []
        self.special = False
        desc = []
        for gi, g in enumerate(kv_cache_config.kv_cache_groups):
            if not getattr(g, "enable_kv_transfer", True):
                continue
            specs = layer_specs(g)
            kinds = {group_kind(s) for _, s in specs}
            kind, param = next(iter(kinds))
            if kind is None or len(kinds) != 1:
                bad = [type(s).__name__ for _, s in specs if group_kind(s)[0] is None]
                raise ValueError(
                    "kvtier: the KV cache group of layers %s... is %s, which kvtier cannot "
                    "store exactly (it stores full, MLA, sliding-window and chunked local "
                    "attention KV); run this model without the kvtier connector"
                    % (", ".join(g.layer_names[:2]),
                       bad[0] if bad else " and ".join(sorted("%s %s" % k for k in kinds))))
            if not getattr(g.kv_cache_spec, "prefix_cacheable", True):
                raise ValueError(
                    "kvtier: the KV cache group of layers %s... (%s) is not prefix-cacheable "
                    "in vLLM (bounded replay): vLLM recomputes part of it after any hit, so "
                    "no chunk of it could be loaded exact; run without the kvtier connector"
                    % (", ".join(g.layer_names[:2]), type(g.kv_cache_spec).__name__))
            bs = int(g.kv_cache_spec.block_size)
            if chunk_tokens % bs:
                raise ValueError(
                    "kvtier: chunk_tokens=%d is not a multiple of the %d-token blocks of KV "
                    "cache group %d (layers %s...); use a multiple of every group's block "
                    "size" % (chunk_tokens, bs, gi, ", ".join(g.layer_names[:2])))
            bpc = chunk_tokens // bs
            window = None if kind in ("full", "mla") else \
                ("chunked" if kind == "chunked" else "sliding", param)
            tail = bpc
            if kind in ("sliding", "sliding-mla"):
                extra = max(int(getattr(s, "extra_retained_tokens", 0) or 0) for _, s in specs)
                tail = _tail_blocks(param, extra, bs, bpc)
            repl = kind in ("mla", "sliding-mla")
            vi = len(self.vgroups)
            self.vgroups.append(VGroup(gi, kind, window, bs, bpc, tail, repl))
            tpb = chunk_tokens // tail
            shapes = {}
            for name, spec in specs:
                self.special |= is_special(spec)
                desc.append("%s:%s" % (name, describe(spec)))
                kg = self._kgroup(vi, spec, layout, len(g.layer_names), tpb, repl, name)
                shapes.setdefault((kg.pieces, kg.data, kg.bpt), kg).layers.append(name)
            # largest block first, whatever order vLLM lists the layers in:
            # the MLA cache before the indexer's, as kvtierd --model-config
            # (its sizing) lays out DeepSeek V3.2 / GLM-5.x
            self.kgroups.extend(sorted(shapes.values(), key=lambda k: (-k.run * k.pieces,
                                                                       -k.pieces)))
        if not self.vgroups:
            raise ValueError("kvtier: the model has no KV cache group kvtier could keep")
        if len({v.replicated for v in self.vgroups}) > 1:
            raise ValueError("kvtier: MLA and non-MLA KV cache groups in one model are not "
                             "supported")
        if len({d.split(":", 1)[1] for d in desc}) > 1:
            self.special = True     # caches of several shapes
        if len(self.kgroups) > MAX_GROUPS:
            raise ValueError(
                "kvtier: this model's KV caches make %d kvtier groups (%s); kvtier holds at "
                "most %d" % (len(self.kgroups), "; ".join(
                    "%d x %d bytes a block of group %d" % (len(k.layers), k.run,
                                                         self.vgroups[k.vg].index)
                    for k in self.kgroups), MAX_GROUPS))
        self.replicated = self.vgroups[0].replicated
        # what the bytes mean beyond the plain identity fields, when they do
        self.caches = hashlib.sha256("\n".join(desc).encode()).hexdigest()[:16] \
            if self.special else None

    @staticmethod
    def _kgroup(vi, spec, layout, n_layers, tpb, repl, name):
        runs = runs_per_block(spec, layout, n_layers)
        data = _data_bytes(spec)
        page = int(spec.page_size_bytes)
        if runs > 1:
            if data % runs or (data // runs) % tpb:
                raise ValueError("kvtier: layer %s: a block of %d bytes does not split into "
                                 "%d runs of whole tokens (layout %s)" % (name, data, runs,
                                                                          layout))
            return KGroup(vi, runs, data // runs, data // runs // tpb, tpb, repl)
        if data % (2 * tpb) == 0:
            # one run, described as its halves (the geometry segments made
            # by kvtierd --vllm-block-size and earlier releases have)
            return KGroup(vi, 2, data // 2, data // (2 * tpb), tpb, repl)
        bpt = -(-data // tpb)
        if bpt * tpb > page:
            raise ValueError(
                "kvtier: layer %s: its %d-byte blocks (a %d-byte page) are not a whole "
                "number of bytes for each of the %d tokens kvtier counts per block, and "
                "the page has no padding to round them into; use another chunk size or "
                "block size" % (name, data, page, tpb))
        return KGroup(vi, 1, data, bpt, tpb, repl)

    @property
    def groups(self):
        return [k.group() for k in self.kgroups]

    @property
    def windows(self):
        return [v.window for v in self.vgroups]


def default_chunk_tokens(kv_cache_config, block_size):
    """One chunk covers a whole block of every group: the lcm of the block
    sizes (vLLM's own block size for single-size models)."""
    out = block_size
    for g in kv_cache_config.kv_cache_groups:
        if getattr(g, "enable_kv_transfer", True):
            out = out * g.kv_cache_spec.block_size // math.gcd(out, g.kv_cache_spec.block_size)
    return out
