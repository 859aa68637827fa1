"""Installs the kvtier ctypes binding; no compiler is involved.

    pip install bindings/python          # inside a venv, or
    pip install --break-system-packages bindings/python   # Debian's system python

Offline by design: there is no pyproject.toml, so pip builds with the
setuptools (and wheel) already installed (Debian's python3-setuptools,
python3-wheel) instead of fetching them into an isolated build environment.

When a built libkvtier.so is found ($KVTIER_LIBRARY, else the source tree's
build/tier/), a copy is placed next to the package, where the binding looks
for it first after $KVTIER_LIBRARY.  Without one the package still installs
and finds the library at run time ($KVTIER_LIBRARY, the system path).
"""

import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(os.path.dirname(HERE))


def built_library():
    env = os.environ.get("KVTIER_LIBRARY")
    cands = [env] if env else [os.path.join(REPO_ROOT, "build", "tier", "libkvtier.so")]
    for c in cands:
        if c and os.path.exists(c):
            return os.path.realpath(c)
    return None


class BuildPy(build_py):
    def run(self):
        super().run()
        lib = built_library()
        dst = os.path.join(self.build_lib, "kvtier", "libkvtier.so")
        if lib:
            self.announce("kvtier: bundling %s" % lib, level=2)
            shutil.copyfile(lib, dst)
            os.chmod(dst, 0o755)
            # the exit witness's helper, which the library looks for
            # beside itself (core/witness.c): a GPU rank needs it
            helper = os.path.join(os.path.dirname(lib), "kvtier-witness")
            if os.path.exists(helper):
                hdst = os.path.join(self.build_lib, "kvtier", "kvtier-witness")
                shutil.copyfile(helper, hdst)
                os.chmod(hdst, 0o755)
            else:
                self.warn("kvtier: %s not found; ranks on a GPU backend will refuse "
                          "to register without it" % helper)
        else:
            self.warn("kvtier: no built libkvtier.so found (build the 'kvtier' target or "
                      "set KVTIER_LIBRARY); the package will look for it at run time")


class BinaryDistribution(Distribution):
    """The wheel carries a shared library when one is bundled."""

    def has_ext_modules(self):
        return built_library() is not None


setup(
    name="kvtier",
    version="0.1.0",
    description="Python binding (ctypes) of kvtier, a node-local shared-memory KV-cache tier",
    long_description=open(os.path.join(HERE, "README.md")).read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    packages=["kvtier", "kvtier.vllm"],
    python_requires=">=3.9",
    # numpy / torch are used when given; neither is required to import.
    extras_require={"numpy": ["numpy"]},
    # vLLM loads general plugins in each of its processes: this one names
    # KvtierConnector in vLLM's connector factory (kvtier/vllm_plugin.py)
    entry_points={"vllm.general_plugins": ["kvtier = kvtier.vllm_plugin:register"]},
    cmdclass={"build_py": BuildPy},
    distclass=BinaryDistribution,
    zip_safe=False,
)
