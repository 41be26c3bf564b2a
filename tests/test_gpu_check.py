"""benchmarks/gpu_check.py's CPU-only parts (--smoke), so the GPU check cannot rot: a tiny
bench's figures reach the JSON and the table, and a failing item leaves its error's tail."""

import json
import sys

from tests.cli import ROOT


def test_the_smoke_check_writes_figures_and_the_tail_of_a_failure(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_check

    out = tmp_path / "check.json"
    assert gpu_check.main(["--smoke", "--out", str(out)]) == 1  # must_fail fails
    items = json.loads(out.read_text())["items"]
    tiny, bad = items["bench_tiny"], items["must_fail"]
    assert tiny["status"] == "ok" and tiny["median_s"]["spmd"] > 0, tiny
    assert bad["status"] == "failed" and bad["tail"][-1] == "smoke: this item fails on purpose"
    printed = capsys.readouterr().out
    assert "bench_tiny" in printed and "ms, bare" in printed and "fails on purpose" in printed
