"""Types that check something: mypy over spmd/ and models/ (the [tool.mypy] section of
pyproject.toml says what and how strictly), so the README's test command type-checks; a
config field given the wrong type or a function called with a missing argument fails here.
mypy cannot see through `Any`, so the main seams must not be `Any`: a parameter named
program / compiled / run / cfg / model_cfg typed `Any` fails test_main_seams_are_typed (they
are AnyProgram, AnyCompiled, spmd.training.loop.Run, the config sections' dataclasses and
models.contract.ModelConfig), and a program passed where a config goes fails mypy. The
per-module exceptions are capped, and `import spmd.cli` (shell completion) stays jax-free."""

import ast
import os
import pathlib
import subprocess
import sys
import tempfile
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEAMS = {"cfg", "model_cfg", "program", "compiled", "run"}


def mypy(*targets: str) -> subprocess.CompletedProcess:
    """mypy with pyproject.toml's settings over `targets` (none: its `files`)."""
    pytest.importorskip("mypy", reason="mypy comes with the test extra: pip install -e .[test]")
    # A cache outside the work tree, kept between runs: about 30 s cold on 2 cores, a few
    # seconds warm. mypy checks the cache against the sources, so a stale one is never trusted.
    cache = pathlib.Path(tempfile.gettempdir()) / "spmd-mypy-cache"
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), *targets],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "MYPY_FORCE_COLOR": "0", "PYTHONPATH": str(ROOT)},
        timeout=600,
    )


def test_mypy_finds_no_errors():
    result = mypy()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_a_program_passed_for_a_compiled_step_fails(tmp_path):
    # what the seams' types buy: with `compiled: Any` (before issue 56) this passed
    probe = tmp_path / "probe.py"
    probe.write_text(
        "from spmd.engine.step import Program\n"
        "from spmd.estimate import hlo\n\n\n"
        "def fingerprint(program: Program) -> str:\n"
        "    return hlo.fingerprint(program)\n"
    )
    result = mypy(str(probe))
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-2000:]
    assert 'Argument 1 to "fingerprint" has incompatible type "Program"' in result.stdout


def untyped_seams() -> list[str]:
    """file:line function(parameter) of every parameter named as a seam and typed `Any`."""
    found = []
    for package in ("spmd", "models"):
        for path in sorted((ROOT / package).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                    continue
                args = node.args
                for arg in args.posonlyargs + args.args + args.kwonlyargs:
                    annotation = ast.unparse(arg.annotation) if arg.annotation else ""
                    if arg.arg in SEAMS and annotation in ("Any", "typing.Any"):
                        where = path.relative_to(ROOT)
                        found.append(f"{where}:{node.lineno} {node.name}({arg.arg})")
    return found


def test_main_seams_are_typed():
    # 74 on 2026-11-28, 0 after issue 56; a few are allowed for a seam whose type is truly open
    offenders = untyped_seams()
    assert len(offenders) <= 5, "typed Any (name the real type):\n" + "\n".join(offenders)


def test_mypy_exceptions_are_few():
    # (module, error code) pairs switched off in pyproject.toml: 53 on 2026-11-28, 11 after
    # issue 56; each block there says why its codes are off
    overrides = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    pairs = [(m, code) for o in overrides for m in o["module"] for code in o["disable_error_code"]]
    assert len(pairs) <= 26, f"{len(pairs)} (module, code) pairs switched off: {pairs}"


def test_the_seam_counter_sees_an_any_program(tmp_path, monkeypatch):
    # the counter above reads what it claims to: a program typed Any is found
    package = tmp_path / "spmd"
    package.mkdir()
    (package / "x.py").write_text(
        "from typing import Any\n\ndef f(program: Any, *, cfg: Any = None) -> None: ...\n"
    )
    (tmp_path / "models").mkdir()
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert untyped_seams() == ["spmd/x.py:3 f(program)", "spmd/x.py:3 f(cfg)"]


def test_cli_imports_no_jax():
    # `spmd <TAB>` runs spmd.cli for every completion: jax's 1-2 s of imports would be felt
    code = "import sys, spmd.cli; assert 'jax' not in sys.modules, 'spmd.cli imported jax'"
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr[-2000:]
