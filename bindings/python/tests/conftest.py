"""Shared fixtures of the kvtier binding tests.

The package is imported from the source tree (bindings/python) unless
KVTIER_TEST_INSTALLED=1 asks for the installed one; the library comes from
$KVTIER_LIBRARY (the test script sets it) or the build tree.  A missing
library is an error, never a skip.
"""

import itertools
import os
import re

import pytest

from kvt_testlib import kvtier, remove_segment

_seq = itertools.count()


def pytest_configure(config):
    try:
        kvtier.library_path()
    except kvtier.LibraryNotFound as e:
        raise pytest.UsageError("kvtier binding tests: %s" % e)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    """The tests choose every option; stray KVTIER_* variables must not leak in."""
    for k in list(os.environ):
        if k.startswith("KVTIER_") and k not in ("KVTIER_LIBRARY", "KVTIER_TEST_INSTALLED"):
            monkeypatch.delenv(k)


@pytest.fixture
def segname(request):
    """A segment name unique to this test, removed afterwards."""
    test = re.sub(r"[^A-Za-z0-9]+", "-", request.node.name)[:32].strip("-")
    name = "pyt-%d-%d-%s" % (os.getpid(), next(_seq), test)
    yield name
    remove_segment(name)
