"""The README's command blocks, as the README has them: the tests run them
from here, not from copies, so that the README cannot drift from what
works.  Only plain Python (the daemon tests' Debian python3 and the vLLM
tests' venv both import it)."""

import os
import re
import shlex

README = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "README.md")


def blocks():
    """Every fenced block's text."""
    with open(README) as f:
        text = f.read()
    return re.findall(r"^```[a-z]*\n(.*?)^```$", text, re.M | re.S)


def block(start):
    """The one block whose first line starts with `start` (an error when
    none or several: the README changed, and the test must say so)."""
    found = [b for b in blocks() if b.lstrip().startswith(start)]
    if len(found) != 1:
        raise AssertionError("README.md has %d blocks starting %r (expected 1)"
                             % (len(found), start))
    return found[0]


def command(text):
    """The first command of a block: continuation lines joined, a "$ "
    prompt and a trailing "# comment" dropped, split as a shell splits it.
    Returns (env assignments at its start, argv)."""
    src = ""
    for ln in text.splitlines():
        if not src and ln.startswith("$ "):
            ln = ln[2:]
        ln = ln.rstrip()
        if ln.endswith("\\"):
            src += ln[:-1] + " "          # a continuation line
            continue
        src += ln
        try:
            argv = shlex.split(src, comments=True)
            break
        except ValueError:                # a quote open across lines (a JSON argument)
            src += "\n"
    else:
        raise AssertionError("README.md: an unfinished command: %r" % text[:200])
    env = {}
    while argv and re.match(r"^[A-Z_][A-Z0-9_]*=", argv[0]):
        k, v = argv.pop(0).split("=", 1)
        env[k] = v
    return env, argv


def replace_arg(argv, flag, value):
    """argv with `flag`'s value replaced (the flag must be there)."""
    i = argv.index(flag)
    return argv[:i + 1] + [value] + argv[i + 2:]
