"""The torch code path without torch: a stand-in with the tensor protocol
the binding uses (data_ptr, element_size, stride, dim, shape, device,
is_contiguous, numel, indexing, detach/cpu/numpy), wrapping numpy."""

import numpy as np
import pytest

import kvtier
from kvt_testlib import WORLD, block_table, blocks_equal, kv_cache, prompt, rank, scheduler


class _Device:
    def __init__(self, kind):
        self.type = kind


class FakeTensor:
    def __init__(self, a, device="cpu"):
        self.a = a
        self.device = _Device(device)
        self.shape = a.shape

    def data_ptr(self):
        return self.a.__array_interface__["data"][0]

    def element_size(self):
        return self.a.itemsize

    def stride(self, i=None):
        st = tuple(s // self.a.itemsize for s in self.a.strides)
        return st if i is None else st[i]

    def dim(self):
        return self.a.ndim

    def numel(self):
        return self.a.size

    def is_contiguous(self):
        return self.a.flags.c_contiguous

    def __getitem__(self, i):
        return FakeTensor(self.a[i], self.device.type)

    def detach(self):
        return self

    def cpu(self):
        return self

    def numpy(self):
        return self.a


def test_tensor_protocol_cycle(segname):
    src = [kv_cache(seed=50 + r) for r in range(WORLD)]
    dst = [kv_cache() for _ in range(WORLD)]
    with scheduler(segname) as s:
        keys = s.hash_tokens(FakeTensor(prompt(3, seed=50)))
        assert keys == s.hash_tokens(prompt(3, seed=50))
        tab = block_table(3, seed=50)
        ranks = [rank(segname, r, [FakeTensor(a) for a in src[r]]) for r in range(WORLD)]
        try:
            for t in ranks:
                assert t.save(keys, FakeTensor(tab.astype(np.int64))).wait()
        finally:
            for t in ranks:
                t.close()
        ranks = [rank(segname, r, [FakeTensor(a) for a in dst[r]]) for r in range(WORLD)]
        try:
            out = block_table(3, seed=51, half=1)
            with s.lookup(keys) as lease:
                assert lease.hits == 3
                for t in ranks:
                    t.load(lease, FakeTensor(out[None, :])).wait()   # a [1, n] table: per group
        finally:
            for t in ranks:
                t.close()
        for r in range(WORLD):
            assert blocks_equal(src[r], tab, dst[r], out)


def test_tensor_protocol_checks(segname):
    with scheduler(segname):
        kv = kv_cache()
        gpu = [FakeTensor(a, device="cuda") for a in kv]
        with pytest.raises(kvtier.KvtierError, match="cuda"):
            rank(segname, 0, gpu)                       # host DMA: host memory only
        swapped = [FakeTensor(np.zeros((64, 2, 16, 32), np.float16).transpose(0, 2, 1, 3))
                   for _ in kv]
        with pytest.raises(kvtier.KvtierError, match="contiguous"):
            rank(segname, 0, swapped)
