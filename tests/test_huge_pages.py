"""--xla-preset throughput on a CPU: spmd's commands restart once with glibc's huge-page tunable,
so that XLA:CPU's per-step buffers are not faulted in 4 KiB at a time (spmd.parallel.huge_pages,
docs/speed.md)."""

import os
import subprocess
import sys

import pytest

from spmd.parallel import huge_pages
from tests import cli


def test_wanted_only_on_a_cpu_under_throughput_where_the_kernel_waits_to_be_asked(monkeypatch):
    monkeypatch.setattr(huge_pages, "glibc_has_tunable", lambda: True)
    for mode, expected in (("madvise", True), ("always", False), ("never", False), ("", False)):
        monkeypatch.setattr(huge_pages, "thp_mode", lambda mode=mode: mode)
        assert huge_pages.wanted("cpu", "throughput") is expected, mode
    monkeypatch.setattr(huge_pages, "thp_mode", lambda: "madvise")
    assert not huge_pages.wanted("gpu", "throughput")
    assert not huge_pages.wanted("cpu", "none")
    monkeypatch.setattr(huge_pages, "glibc_has_tunable", lambda: False)
    assert not huge_pages.wanted("cpu", "throughput")


def test_only_the_environment_a_process_started_with_counts():
    code = (
        "import os; from spmd.parallel import huge_pages; "
        "os.environ['GLIBC_TUNABLES'] = 'glibc.malloc.hugetlb=1'; print(repr(huge_pages.active()))"
    )

    def started_with(tunables: str) -> subprocess.CompletedProcess:
        env = {**os.environ, "GLIBC_TUNABLES": tunables, "PYTHONPATH": str(cli.ROOT)}
        return subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
        )

    without = started_with("")
    given = started_with("glibc.malloc.hugetlb=1:glibc.malloc.arena_max=4")
    assert without.stdout.strip() == "''", without.stderr
    assert given.stdout.strip() == "'1'", given.stderr


@pytest.mark.skipif(
    not huge_pages.wanted("cpu", "throughput"),
    reason="this machine's kernel or glibc takes no huge-page tunable",
)
def test_a_cpu_run_restarts_once_before_importing_jax_and_none_leaves_it(tmp_path):
    # A mesh that cannot be built: the run stops (exit 2) right after its "xla flags" line,
    # which each process prints once, so a restart that repeated output would show here.
    bad_mesh = ("--model", "tiny", "--mesh", "dp=3", "--devices", "2")
    imports = {"PYTHONPROFILEIMPORTTIME": "1"}  # every module import, on stderr

    def flag_lines(run) -> list[str]:
        assert run.returncode == 2, run.stderr[-3000:]
        return [line for line in (run.stdout + run.stderr).splitlines() if "xla flags" in line]

    def jax_imports(run) -> int:
        return sum(line.rsplit("|", 1)[-1].strip() == "jax" for line in run.stderr.splitlines())

    # the user's own tunables are kept
    run = cli.run(
        "spmd.train", *bad_mesh, env={**imports, "GLIBC_TUNABLES": "glibc.malloc.arena_max=4"}
    )
    assert flag_lines(run) == [
        "xla flags (cpu, preset throughput): none set | malloc: glibc.malloc.hugetlb=1"
    ]
    assert sum(line.startswith("error:") for line in run.stderr.splitlines()) == 1
    assert jax_imports(run) == 1  # the restart came first: JAX was imported once
    off = cli.run("spmd.train", *bad_mesh, "--xla-preset", "none", env={"GLIBC_TUNABLES": ""})
    assert flag_lines(off) == ["xla flags (cpu, preset none): none set"]
    # a preset the command line does not show: the first line restarts, the resolved config
    # undoes it, and the run goes on without the tunable
    config = tmp_path / "none.toml"
    config.write_text('[parallel]\nxla_preset = "none"\n')
    undone = cli.run(
        "spmd.train", "--config", str(config), *bad_mesh, env={**imports, "GLIBC_TUNABLES": ""}
    )
    assert flag_lines(undone) == ["xla flags (cpu, preset none): none set"]
    assert jax_imports(undone) == 2


def test_a_tunables_variable_that_names_it_already_is_never_restarted_over(monkeypatch):
    # glibc shows a process only the first tunable of its start environment, so a later
    # "glibc.malloc.hugetlb=0" of yours is not seen as active: restarting would loop, or
    # override you.
    def execve(*args):
        raise AssertionError(f"restarted with {args}")

    monkeypatch.setattr(huge_pages.os, "execve", execve)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.arena_max=4:glibc.malloc.hugetlb=0")
    huge_pages.restart()
