"""The binding's ctypes structures against the C header, and the library's
exported symbols against the binding's list."""

import ctypes
import os
import shutil
import subprocess

import pytest

import kvtier
from kvtier import _lib as L
from kvt_testlib import REPO_ROOT

HEADER_DIR = os.path.join(REPO_ROOT, "tier", "include")
STRUCTS = {
    "kvt_key": L.kvt_key,
    "kvt_group_desc": L.kvt_group_desc,
    "kvt_config": L.kvt_config,
    "kvt_group_buffers": L.kvt_group_buffers,
    "kvt_stats": L.kvt_stats,
    "kvt_lookup_res": L.kvt_lookup_res,
}


def test_library_exports_the_api():
    lib = L.lib()
    assert os.path.exists(kvtier.library_path())
    for name in L.SYMBOLS:
        assert hasattr(lib, name), name
    # the binding speaks the header's version (5: kvt_segment_model)
    with open(os.path.join(HEADER_DIR, "kvtier.h")) as f:
        header = [int(x.split()[2]) for x in f if x.startswith("#define KVT_API_VERSION ")]
    assert header == [kvtier.API_VERSION] == [5]


def test_open_refuses_another_api_version():
    cfg = L.kvt_config()
    cfg.size = ctypes.sizeof(cfg)
    h = ctypes.c_void_p()
    r = L.lib().kvt_open_v(ctypes.byref(cfg), L.API_VERSION + 1, ctypes.byref(h))
    assert r < 0 and not h.value
    assert "version" in kvtier.last_error().lower()


def test_structs_match_the_header(tmp_path):
    """Compiles a probe printing sizeof/offsetof of every field (needs a C
    compiler and the source tree's header; skipped where either is missing)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc or not os.path.exists(os.path.join(HEADER_DIR, "kvtier.h")):
        pytest.skip("no C compiler or no source tree header")
    lines = ['#include <stdio.h>', '#include <stddef.h>', '#include "kvtier.h"',
             'int main(void) {']
    expect = []
    for sname, st in STRUCTS.items():
        ctype = sname if sname == "kvt_key" else "struct " + sname
        lines.append('printf("%%s %%zu\\n", "%s", sizeof(%s));' % (sname, ctype))
        expect.append("%s %d" % (sname, ctypes.sizeof(st)))
        for fname, _ in st._fields_:
            fld = getattr(st, fname)
            lines.append('printf("%%s %%zu %%zu\\n", "%s.%s", offsetof(%s, %s), '
                         'sizeof(((%s *)0)->%s));' % (sname, fname, ctype, fname, ctype, fname))
            expect.append("%s.%s %d %d" % (sname, fname, fld.offset, fld.size))
    lines.append("return 0; }")
    src = tmp_path / "probe.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "probe"
    subprocess.run([cc, "-std=c11", "-I", HEADER_DIR, str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    assert out.split("\n")[:-1] == expect
