"""kvtier.vllm._layout: where a layer's block lies in its KV tensor, in
whichever of vLLM's KV cache layouts the engine resolved.

vLLM (0.31 and later) keeps every layer's cache as a logical
[B, H, N, C] view (blocks, KV heads, tokens, the bytes of one token's
state) whose strides follow the layout the engine core resolved from the
attention backends' supported sets (KVCacheLayout: LBHNC, LBNHC, LHBNC,
BLHNC, BLNHC, BHLNC; kv_cache_interface.compute_layout_strides).  kvtier
describes a group's blocks as "layers": layer_base + b * block_stride,
each run of the same bytes.  So a layer's block becomes as many kvtier
layers as the block has separate runs:

  * block-contiguous layouts (LBHNC, LBNHC, BLHNC, BLNHC): a layer's block
    is one run of page bytes.  It is described as two kvtier layers of
    half a page (its first and second half), as the connector always did:
    the geometry of segments made by kvtierd --vllm-block-size and of
    existing segments stays the same.
  * head-outer layouts (LHBNC -- what ROCm's native backends want, "the
    native HIP kernels hardcode group-contiguous block addressing" --
    and BHLNC): a layer's block is one run per KV head, H runs of N*C
    bytes a head's stride apart.  Each is a kvtier layer.
  * older tensors, [2, num_blocks, ...] (K and V apart): two runs, K's
    and V's.

The scheduler side predicts the runs from the spec and the layout name
with vLLM's own stride function (runs_per_block), so that its segment
geometry is the workers'; each worker then finds the runs in the tensors
it was given (block_runs) and refuses a tensor whose runs differ, naming
the layer and the layout.  The layout also enters the model identity
(";layout="): two engines whose blocks order their bytes differently
never share chunks.
"""

HEAD_OUTER = ("LHBNC", "BHLNC")


def _runs(shape, strides, elem):
    """The contiguous runs of a strided region: (run_bytes, [offset of each
    run]), offsets in bytes from the region's start, in memory order.
    shape/strides in elements of elem bytes; None when the region overlaps
    itself."""
    dims = sorted(((n, s * elem) for n, s in zip(shape, strides) if n > 1),
                  key=lambda d: d[1])
    run = elem
    outer = []
    for n, st in dims:
        if not outer and st == run:
            run *= n            # still one run
        else:
            outer.append((n, st))
    offs = [0]
    for n, st in outer:
        if st < run:
            return None
        offs = [o + i * st for i in range(n) for o in offs]
    offs.sort()
    if any(b - a < run for a, b in zip(offs, offs[1:])):
        return None
    return run, offs


def runs_per_block(spec, layout_name, num_layers):
    """How many separate runs a layer's block has in this layout, for a
    group of num_layers layers of spec (BHLNC's heads are apart only with
    more than one layer between them): from vLLM's own stride function
    where the release has it, else from the layout's name (head-outer
    layouts: one per KV head)."""
    heads = getattr(spec, "num_heads", None) or getattr(spec, "num_kv_heads", None) or 1
    try:
        from vllm.v1.kv_cache_interface import (compute_layer_kv_cache_shape_bytes,
                                                compute_layout_strides)
        from vllm.v1.kv_cache_layout import KVCacheLayout
        layout = KVCacheLayout[str(layout_name)]
        strides = compute_layout_strides(spec, 2, num_layers, layout)
        shape = compute_layer_kv_cache_shape_bytes(spec, 2)
    except (ImportError, KeyError, AttributeError, TypeError, AssertionError):
        return int(heads) if str(layout_name) in HEAD_OUTER and heads > 1 and \
            (num_layers > 1 or str(layout_name) == "LHBNC") else 1
    r = _runs(shape[1:], strides[2:], 1)  # a block: [H, N, C] of one layer
    return len(r[1]) if r else 1


def pieces_per_block(spec, layout_name, num_layers):
    """kvtier layers per vLLM layer: the runs of its block, a single run
    described as its two halves (see the module's comment)."""
    n = runs_per_block(spec, layout_name, num_layers)
    return 2 if n == 1 else n


def block_runs(t, num_blocks, page, pieces, name, layout_name):
    """The kvtier layers of layer tensor t: [(base, block stride)], each run
    page // pieces bytes.  Raises ValueError naming the layer when its
    blocks are not where the layout says."""
    es = t.element_size()
    dims = [d for d in range(t.dim()) if t.shape[d] == num_blocks]
    if not dims:
        raise ValueError("kvtier: layer %s: no dimension of its KV tensor %s has the %d "
                         "blocks" % (name, tuple(t.shape), num_blocks))
    d = dims[0]
    shape = [n for i, n in enumerate(t.shape) if i != d]
    strides = [s for i, s in enumerate(t.stride()) if i != d]
    found = _runs(shape, strides, es)
    want = page // pieces
    if found is not None and len(found[1]) == 1 and pieces == 2 and found[0] == page:
        # one run, described as its halves
        found = (want, [0, want])
    if found is None or found[0] != want or len(found[1]) != pieces:
        raise ValueError(
            "kvtier: layer %s: a block of its KV tensor %s (strides %s) is %s, where the "
            "%s layout of a %d-byte page gives %d run(s) of %d bytes" % (
                name, tuple(t.shape), tuple(t.stride()),
                "not a set of separate runs" if found is None else
                "%d run(s) of %d bytes" % (len(found[1]), found[0]),
                layout_name, page, pieces, want))
    base = t.data_ptr()
    stride = t.stride(d) * es
    return [(base + off, stride) for off in found[1]]
