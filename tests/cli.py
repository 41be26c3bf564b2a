"""Run `python -m spmd.train` (or another module) as a user would: a real subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Tokenized corpora are cached: in the session's folder (tests/conftest.py), not the user's home.
CACHE_HOME = os.environ["XDG_CACHE_HOME"]


def run(
    module: str,
    *args: str,
    timeout: float = 300,
    env: dict[str, str] | None = None,
    cwd: Path = ROOT,
) -> subprocess.CompletedProcess:
    """`python -m module args` from folder `cwd` (the repository root unless given); `env` adds
    environment variables."""
    env = {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        "PYTHONPATH": str(ROOT),
        "XDG_CACHE_HOME": CACHE_HOME,
        **(env or {}),
    }
    # XLA_FLAGS (the fast-compile flags of conftest) carry over: compiling is most of a run
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def train_in_process(*args: str) -> subprocess.CompletedProcess:
    """`spmd.train args` run by this test process (its 8 devices), its output captured, as a
    CompletedProcess like `run` gives. The same code as the command minus the interpreter's
    start and JAX's import (about 2.5 s of CPU each): for runs whose point is not the process
    itself (signals, exits, several processes)."""
    import contextlib
    import io

    from spmd import train

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = train.main(list(args))
    return subprocess.CompletedProcess(["spmd.train", *args], code, out.getvalue(), err.getvalue())
