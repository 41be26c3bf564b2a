"""Every example runs as a user would run it and checks what it claims (exit 0; each prints
FAILED and exits 1 when its claim does not hold); the cluster examples, which cannot run here,
are read: their commands resolve and their processes and GPUs add up to the mesh."""

import math
import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from spmd import train
from spmd.parallel.mesh import parse_mesh
from tests.cli import ROOT

EXAMPLES = {
    "allreduce_by_hand.py": ("byte-for-byte identical",),
    "accumulation.py": ("same update from 4 micro-batches as from one big batch",),
    "memory_fit.py": ("match the formula", "ZeRO-3"),
    "sequence_classifier.py": ("same test accuracy on 1 and 4 devices under dp and fsdp",),
    "custom_loop.py": ("restored onto another mesh gives the same eval loss",),
    "finetune_1b.py": ("under ZeRO-3 on 8 (8.0x less)", "in 2 hours:", "LoRA r=4 held-out loss:"),
    "finetune.py": ("the loss counts only the response tokens", "fine-tuned from the Hugging"),
    "diloco.py": ("H=10 ends within 5% of synchronous training's loss",),
    "async_checkpoint.py": ("step time, save in flight:", "save() blocking the loop:"),
}
# Arguments that keep an example within the tests' time (its defaults make the README figures).
ARGS = {
    "finetune_1b.py": ("--model", "tiny", "--seq-len", "64", "--sft-seq-len", "32", "--steps", "8")
    + ("--lr", "3e-3", "--lora-rank", "4", "--lora-lr", "1e-2"),
    "diloco.py": ("--steps", "50", "--every", "10"),
    "async_checkpoint.py": ("--model", "tiny", "--mesh", "fsdp=2", "--saves", "2")
    + ("--seq-len", "32", "--quiet-steps", "3"),
    "custom_loop.py": ("--steps", "10", "--seq-len", "32"),
}


@pytest.mark.parametrize("script", sorted(EXAMPLES))
def test_example_runs_and_checks_its_claim(script):
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *ARGS.get(script, ())],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    for claim in EXAMPLES[script]:
        assert claim in result.stdout


def devices(mesh: str) -> int:
    return math.prod(parse_mesh(mesh).values())


def test_the_cluster_examples_commands_resolve_and_add_up():
    """The SLURM script and the Kubernetes JobSet cannot run here (no cluster): their spmd.train
    commands resolve through spmd's resolver, and processes x GPUs each is the mesh's size."""
    script = (ROOT / "examples" / "slurm_multinode.sh").read_text()
    argv = shlex.split(script.split("\nsrun ", 1)[1].replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "spmd.train"]
    parallel = train.resolve_sections(argv[3:])["parallel"]
    sbatch = dict(re.findall(r"#SBATCH --([\w-]+)=(\S+)", script))
    nodes, gpus = int(sbatch["nodes"]), int(sbatch["gpus-per-node"])
    assert sbatch["ntasks-per-node"] == "1"  # one process per node drives all its GPUs ...
    local_ids = re.search(r"export JAX_LOCAL_DEVICE_IDS=(\S+)", script).group(1)
    assert local_ids == ",".join(map(str, range(gpus)))  # ... which JAX is told to leave visible
    assert devices(parallel.mesh) == nodes * gpus and devices(parallel.dcn_mesh) == nodes
    assert "--resume" not in argv  # a requeued job continues on its own (--resume auto)

    documents = list(yaml.safe_load_all((ROOT / "examples" / "k8s_jobset.yaml").read_text()))
    kinds = {d["kind"]: d for d in documents}
    assert set(kinds) == {"ServiceAccount", "Role", "RoleBinding", "JobSet"}
    [replicated] = kinds["JobSet"]["spec"]["replicatedJobs"]
    job = replicated["template"]["spec"]
    pod = job["template"]["spec"]
    [container] = pod["containers"]
    assert replicated["replicas"] == 1 and job["completionMode"] == "Indexed"
    assert job["parallelism"] == job["completions"]
    assert container["command"] == ["python", "-m", "spmd.train"]
    parallel = train.resolve_sections(container["args"])["parallel"]
    gpus = container["resources"]["limits"]["nvidia.com/gpu"]
    assert devices(parallel.mesh) == job["parallelism"] * gpus
    assert devices(parallel.dcn_mesh) == job["parallelism"]
    # what JAX's Kubernetes detection reads through the API: its pod (by IP) and its Job
    assert pod["serviceAccountName"] == kinds["ServiceAccount"]["metadata"]["name"]
    rules = {(r["apiGroups"][0], r["resources"][0]): r["verbs"] for r in kinds["Role"]["rules"]}
    assert "list" in rules["", "pods"] and "get" in rules["batch", "jobs"]
