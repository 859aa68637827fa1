"""The README's operator commands, taken from README.md
(tests/readme/readme_blocks.py) and run: kvtier-size's example must print
what the README shows; the operator guide's kvtierd command must start and
serve, kvtier-stat read it and --remove remove it.  What is substituted is
named at each place: this checkout's build, a model config in the tests'
data for /models/..., a free port, a small tier."""

import os
import re
import shutil
import signal
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "readme"))
import readme_blocks as rb  # noqa: E402

REPO = os.path.dirname(os.path.dirname(HERE))
BUILD = os.environ.get("KVTIER_BUILD", os.path.join(REPO, "build"))


def _build_path(arg):
    return os.path.join(BUILD, arg[len("build/"):]) if arg.startswith("build/") else arg


def test_kvtier_size_example_prints_what_the_readme_shows():
    b = rb.block("$ build/numa/kvtier-size")
    env, argv = rb.command(b)
    shown = b.split("\n", 1)[1]
    p = subprocess.run([_build_path(a) for a in argv], cwd=REPO, capture_output=True,
                       text=True, timeout=60, env=dict(os.environ, **env))
    assert p.returncode == 0, p.stderr
    assert p.stdout == shown, "README.md shows:\n%s\nkvtier-size prints:\n%s" % (shown, p.stdout)


def test_operator_guide_kvtierd_command(tmp_path):
    import socket
    b = rb.block("kvtierd --segment kvtier --model-config /models/llama-3.1-8b/config.json")
    env, argv = rb.command(b)
    name = "readme-%d" % os.getpid()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv[0] = os.path.join(BUILD, "tier", "daemon", "kvtierd")
    argv = rb.replace_arg(argv, "--segment", name)
    # the README's model path is an example: the same model's config here
    argv = rb.replace_arg(argv, "--model-config",
                          os.path.join(REPO, "tests", "numa", "data", "llama-3.1-8b.json"))
    argv = rb.replace_arg(argv, "--tier-gib", "0.125")            # 64 GiB x 8 ranks: not here
    argv = rb.replace_arg(argv, "--log", str(tmp_path / "kvtierd.log"))
    argv += ["--http", "127.0.0.1:%d" % port, "--no-lock"]        # a free port; no memlock limit
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env=dict(os.environ, **env))
    stat = os.path.join(BUILD, "tier", "daemon", "kvtier-stat")
    try:
        deadline = time.monotonic() + 120
        while True:
            assert p.poll() is None, (tmp_path / "kvtierd.log").read_text()
            r = subprocess.run(["curl", "-fs", "http://127.0.0.1:%d/healthcheck/segment" % port],
                               capture_output=True, timeout=10)
            if r.returncode == 0:
                break
            assert time.monotonic() < deadline, "kvtierd did not come up"
            time.sleep(0.2)
        # kvtier-stat [NAME], as the guide says
        st = subprocess.run([stat, name], capture_output=True, text=True, timeout=30)
        assert st.returncode == 0, st.stderr
        assert "llama-3.1-8b;dtype=bfloat16;kv=bfloat16;layout=LBNHC;weights=" in st.stdout, \
            st.stdout
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    # removed as "Removing a segment" says
    rm = subprocess.run([stat, name, "--remove"], capture_output=True, text=True, timeout=30)
    assert rm.returncode == 0 and "removed segment" in rm.stdout, rm.stdout + rm.stderr


def _run_kvtierd(argv, tmp_path):
    """kvtierd from a README argv (its segment, port and log this test's);
    returns what kvtier-stat shows of it, then stops it."""
    import socket
    name = "readme-%d-%d" % (os.getpid(), len(os.listdir(tmp_path)))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [os.path.join(BUILD, "tier", "daemon", "kvtierd")] + argv[1:]
    argv = rb.replace_arg(argv, "--segment", name)
    log = tmp_path / ("%s.log" % name)
    argv += ["--http", "127.0.0.1:%d" % port, "--no-lock", "--unlink", "--log", str(log)]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while subprocess.run(["curl", "-fs", "http://127.0.0.1:%d/healthcheck/segment" % port],
                             capture_output=True, timeout=10).returncode:
            assert p.poll() is None, log.read_text() if log.exists() else p.stdout.read()
            assert time.monotonic() < deadline, "kvtierd did not come up"
            time.sleep(0.2)
        st = subprocess.run([os.path.join(BUILD, "tier", "daemon", "kvtier-stat"), name],
                            capture_output=True, text=True, timeout=30)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=60) == 0
        return st.stdout
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_kvtierd_owning_the_segment_example(tmp_path):
    """The vLLM section's kvtierd-owned example (a TP 4 GPU engine's line):
    kvtierd runs it here too -- it needs no GPU -- with the tests' copy of
    the model's config.json for /models/..., and a small tier."""
    b = rb.block("kvtierd --segment kvtier --group 64:512 --world 4")
    env, argv = rb.command(b)
    argv = rb.replace_arg(argv, "--model-config",
                          os.path.join(REPO, "tests", "numa", "data", "llama-3.1-8b.json"))
    argv = rb.replace_arg(argv, "--tier-gib", "0.0625")
    shown = _run_kvtierd(argv, tmp_path)
    assert "model      llama-3.1-8b;dtype=bfloat16;kv=bfloat16;layout=LBNHC;weights=" in shown
    assert "world 4 x 1 instance, sharded, 16 tokens/chunk" in shown, shown



def test_build_and_install_block(tmp_path):
    """The vLLM section's build and install block, run as written on a copy
    of the source tree (VENV: a new virtual environment of Debian's
    python3): the library builds, pip installs the binding with the library
    bundled, and the installed package -- no source tree, no
    $KVTIER_LIBRARY -- loads that copy, computes a model identity and
    registers its vLLM plugin.  The paths the README names for the
    operator's tools are where `cmake --build build` puts them."""
    text = rb.block("cmake -S . -B build && cmake --build build --target kvtier")
    src = tmp_path / "src"
    src.mkdir()
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True,
                           check=True).stdout.split(b"\0")
    for f in filter(None, files):
        f = f.decode()
        if os.path.isfile(os.path.join(REPO, f)):
            os.makedirs(src / os.path.dirname(f), exist_ok=True)
            shutil.copy2(os.path.join(REPO, f), src / f)
    venv = tmp_path / "venv"
    subprocess.run(["/usr/bin/python3", "-m", "venv", "--system-site-packages", str(venv)],
                   check=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if k not in ("KVTIER_LIBRARY", "PYTHONPATH")}
    p = subprocess.run(["bash", "-euo", "pipefail", "-c", text.replace("VENV", str(venv))],
                       cwd=src, env=env, capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    check = ("import importlib.metadata as m, kvtier, os, sys\n"
             "print(kvtier.library_path())\n"
             "print(kvtier.model_files_id(sys.argv[1]))\n"
             "print([e.value for e in m.entry_points(group='vllm.general_plugins')"
             " if e.name == 'kvtier'])\n")
    cfg = tmp_path / "config.json"
    cfg.write_text('{"architectures": ["LlamaForCausalLM"]}\n')
    r = subprocess.run([str(venv / "bin" / "python"), "-c", check, str(cfg)], cwd=tmp_path,
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    lib, mid, plugin = r.stdout.splitlines()
    assert lib.startswith(str(venv)) and os.path.basename(lib).startswith("libkvtier.so"), lib
    assert "config=" in mid, mid
    assert plugin == "['kvtier.vllm_plugin:register']", plugin
    # the connector's package went in too (vLLM is not here to import it)
    import glob
    assert glob.glob(str(venv / "lib" / "python3*" / "site-packages" / "kvtier" / "vllm" /
                         "_connector.py")), "kvtier.vllm was not installed"
    # the paragraph under the block: where the operator's tools are built
    readme = open(rb.README).read()
    para = readme[readme.index(text):][:1200]
    named = re.findall(r"`build/([\w/.-]+)`", para)
    assert len(named) >= 4, named
    for rel in named:
        assert os.path.exists(os.path.join(BUILD, rel)), "README names build/%s" % rel
