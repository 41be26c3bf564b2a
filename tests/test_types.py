"""mypy over spmd/ and models/ (the [tool.mypy] section of pyproject.toml says what and how
strictly), so the README's test command type-checks: a program passed as `Any`, a config
field given the wrong type, a function called with a missing argument fail here."""

import os
import pathlib
import subprocess
import sys
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_mypy_finds_no_errors():
    pytest.importorskip("mypy", reason="mypy comes with the test extra: pip install -e .[test]")
    # A cache outside the work tree, kept between runs: about 30 s cold on 2 cores, a few
    # seconds warm. mypy checks the cache against the sources, so a stale one is never trusted.
    cache = pathlib.Path(tempfile.gettempdir()) / "spmd-mypy-cache"
    result = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "MYPY_FORCE_COLOR": "0"},
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
