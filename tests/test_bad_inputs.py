"""The bad-input table: every command refuses each of these with exit status 2 and exactly one
line on stderr, `error: ...`, and no traceback; before any device work.

The commands run in-process (each module's `main`, as `python -m spmd.X` calls it), so the
table takes seconds. Device work is fenced off: `setup_mesh`, where every command's first
device is touched, raises here unless a case says the check needs the mesh (generate's length
checks read the model after it). The compiled step's memory check runs after compiling by
design, so it has its own test below.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
UNTIED = ROOT / "tests" / "fixtures" / "hf_llama_untied"
PEFT = ROOT / "tests" / "fixtures" / "peft_llama"  # peft's adapter onto UNTIED
PEFT_BAD = (  # made by the `files` fixture: (name, what the refusal names)
    ("peft_alpha_zero", "lora_alpha = 0 is not positive"),
    ("peft_nan", "holds 4 values that are not finite"),
    ("peft_int8", "is stored as I8"),
)
TRAIN = ("--model", "tiny", "--dry-run")  # every train case starts so: a slip only compiles
GENERATE = ("--from-hf", str(UNTIED), "--prompt", "Hello")  # byte-level: vocab 128 holds ASCII
TO_SPMD = ("--from-hf", str(UNTIED), "--to", "{tmp}/out")


@dataclasses.dataclass(frozen=True)
class Case:
    command: str  # the spmd module: train, plan, convert, generate, launch, report, bench, ...
    args: str  # shell words; {name} is a file of the `files` fixture, {tmp} a fresh folder
    base: tuple[str, ...] = ()  # given before args
    mesh: bool = False  # the check needs the mesh (it reads the model through it)
    says: str = ""  # what the line must name, where another refusal could come first

    def argv(self, files: dict[str, str], tmp: Path) -> list[str]:
        words = [*self.base, *shlex.split(self.args)]
        return [w.format(tmp=tmp, **files) for w in words]

    @property
    def id(self) -> str:
        return f"{self.command} {self.args}"


def train(args: str, says: str = "") -> Case:
    return Case("train", args, TRAIN, says=says)


def started(args: str) -> Case:
    return Case("train", args, ("--model", "tiny"))  # no --dry-run: checked as the run starts


def plan(args: str) -> Case:
    return Case("plan", args)


def convert(args: str, base: tuple[str, ...] = TO_SPMD) -> Case:
    return Case("convert", args, base)


def generate(args: str, base: tuple[str, ...] = GENERATE, mesh: bool = False) -> Case:
    return Case("generate", args, base, mesh)


def report(args: str) -> Case:
    return Case("report", args, ("--out", "{tmp}/report.png"))  # never into the work tree


MESH_USERS = ("spmd.train", "spmd.bench", "spmd.run.weights")  # `from ... import setup_mesh`
ULYSSES_BAD = (  # (head counts, what the refusal names) at cp=4
    ("--n-heads 6 --n-kv-heads 2", "the 6 query heads do not divide by cp"),
    ("--n-heads 12 --n-kv-heads 3", "the 3 kv heads neither divide by cp"),
)
CASES = [
    # the model's shape: the family's check (models/llama.py, models/moe.py)
    *map(train, ["--n-layers 0", "--n-layers -4", "--n-heads 0", "--embed-dim 0"]),
    *map(train, ["--mlp-dim 0", "--vocab-size 0", "--head-dim 0", "--head-dim 7"]),
    *map(train, ["--n-kv-heads 0", "--n-kv-heads 3", "--rope-theta 0", "--rope-theta nan"]),
    *map(train, ["--norm-eps -1", "--norm-eps inf", "--remat bogus", "--family bogus"]),
    *map(train, ["--model moe-tiny --n-experts -1", "--model moe-tiny --experts-per-token 0"]),
    *map(train, ["--model moe-tiny --expert-mlp-dim -1", "--model moe-tiny --capacity-factor nan"]),
    *map(train, ["--model moe-tiny --aux-loss-coef -1", "--model moe-tiny --z-loss-coef nan"]),
    # the router's options (models/moe_routing.py): moe-tiny has 4 experts, 2 per token
    train("--model moe-tiny --router-score relu", says="--router-score"),
    train("--model moe-tiny --aux-loss-scope token", says="--aux-loss-scope"),
    train("--model moe-tiny --n-group 3", says="--n-group 3 must divide --n-experts 4"),
    train("--model moe-tiny --n-group 2 --topk-group 3", says="--topk-group 3 must be between"),
    train("--model moe-tiny --n-group 2 --topk-group 0", says="--topk-group 0 must be between"),
    train("--model moe-tiny --n-group 4", says="--experts-per-token 2 exceeds the 1 experts"),
    train("--model moe-tiny --routed-scaling-factor 0", says="finite number > 0"),
    train("--model moe-tiny --routed-scaling-factor inf", says="finite number > 0"),
    train("--model moe-tiny --shared-expert-mlp-dim 64", says="with --shared-expert true"),
    # GPT-OSS's own fields (models/gpt_oss.py)
    train("--family gpt_oss --swiglu-limit 0", says="--swiglu-limit 0.0 must be positive"),
    train("--family gpt_oss --rope-scaling llama3", says="is not one of none, yarn"),
    train("--family gpt_oss --rope-beta-fast -1", says="--rope-beta-fast -1.0 must be > 0"),
    train("--model moe-tiny --router-bias true --router-bias-rate -1", says="finite number >= 0"),
    train("--model moe-tiny --router-bias-rate 0.001", says="needs --router-bias true"),
    # the run's counts
    *map(train, ["--steps 0", "--batch 0", "--accum 0", "--seq-len -1", "--seed -1"]),
    *map(train, ["--stop-after -1", "--num-processes -1", "--process-id -2"]),
    *map(train, ["--eval-fraction nan", "--eval-every -1", "--eval-batches 0"]),
    # the optimizer
    *map(train, ["--lr inf", "--lr 0", "--lr-scaling bogus", "--warmup -1"]),
    *map(train, ["--min-lr-ratio nan", "--beta1 1", "--outer-lr nan", "--outer-momentum 1.5"]),
    train("--optimizer bogus", says="--optimizer 'bogus' is not one of adamw"),
    train("--muon-ns-steps 3", says="--muon-ns-steps is --optimizer muon's"),  # with AdamW
    train("--optimizer muon --lion-beta1 0.5", says="--lion-beta1 is --optimizer lion's"),
    *map(train, ["--optimizer muon --muon-ns-steps 0", "--optimizer muon --muon-rms -1"]),
    *map(train, ["--optimizer lion --lion-beta2 1", "--optimizer muon --muon-momentum nan"]),
    train("--adafactor-min-dim 8", says="--adafactor-min-dim is --optimizer adafactor's"),
    train("--optimizer adafactor --adafactor-min-dim 0", says="must be 1 or more"),
    train(
        "--optimizer schedule-free-adamw --lr-schedule wsd",
        says="--lr-schedule wsd decays the LR, which --optimizer schedule-free-adamw replaces",
    ),
    train(
        "--optimizer schedule-free-adamw --lr-schedule cosine",
        says="--lr-schedule cosine decays the LR",
    ),
    train(
        "--optimizer schedule-free-adamw --lr-schedule constant --dcn-sync diloco",
        says="evaluates averaged params, which DiLoCo's outer step does not keep",
    ),
    # the layout
    *map(train, ["--mesh dp=2,,tp=2", "--mesh dp=2,", "--mesh ''", "--mesh dp=1_6"]),
    *map(train, ["--mesh dp=0", "--devices -1", "--zero 4", "--collectives bogus"]),
    # what context parallelism still does not compose with (documents and windows it does);
    # refused by the builder, once the mesh exists
    Case(
        "train",
        "--model moe-tiny --mesh cp=2 --capacity-factor 1.25",
        TRAIN,
        mesh=True,
        says="--capacity-factor 1.25 with cp=2",
    ),
    Case(
        "train",
        "--model moe-tiny --mesh tp=2 --sequence-parallel",
        TRAIN,
        mesh=True,
        says="an MoE model",
    ),
    # Ulysses splits the heads over cp: heads it cannot split (spmd.estimate.long_sequence)
    *(
        Case("train", f"--mesh cp=4 --cp-mode ulysses {h}", TRAIN, mesh=True, says=says)
        for h, says in ULYSSES_BAD
    ),
    train("--cp-mode bogus"),
    *map(train, ["--bucket-mb nan", "--pp-schedule bogus", "--microbatches -1"]),
    *map(train, ["--pp-virtual 0", "--dcn-mesh bogus", "--dcn-sync bogus", "--sync-every 0"]),
    *map(train, ["--diloco-axis data", "--precision int8", "--grad-reduce int8"]),
    *map(train, ["--precision fp8 --fp8-recipe bogus", "--precision fp8 --fp8-all-gather"]),
    *map(train, ["--precision fp8 --grad-reduce fp16", "--fp8-all-gather", "--fp8-min-dim -1"]),
    # checkpoints, divergence, observability
    *map(train, ["--checkpoint-every -1", "--keep-checkpoints 1", "--resume"]),
    *map(train, ["--on-divergence bogus", "--spike-threshold 0.5", "--rollback-lr-factor nan"]),
    *map(train, ["--log-every 0", "--profile bogus", "--comm-warn 2", "--peak-tflops inf"]),
    *map(train, ["--straggler-threshold nan", "--metrics {tmp}", "--tensorboard {binary}"]),
    *map(train, ["--data-cache {binary}", "--profile-dir {binary}"]),
    # what spmd did not write, and folders in use (a real run's start: refused before the mesh)
    *map(started, ["--run-dir {foreign_run}", "--run-dir {foreign_config}", "--metrics {text}"]),
    *map(started, ["--checkpoint-dir {user_steps}", "--checkpoint-dir {all_damaged}"]),
    *map(started, ["--checkpoint-dir {locked}", "--checkpoint-dir {unverified_only}"]),
    started("--metrics {other_run_metrics} --checkpoint-dir {tmp}/ck"),
    # data and config files
    *map(train, ["--data {binary}", "--data {latin1}", "--eval-data {binary}"]),
    *map(train, ["--data {tmp}/missing.txt", "--tokenize-workers -1", "--document-mask maybe"]),
    *map(train, ["--prompt-field q", "--config {binary}", "--config {top_level_key}"]),
    *map(train, ["--config {tmp}/missing.toml", "--config {tmp}"]),
    *map(train, ["--init-from-hf {hf_list}", "--init-from-hf {hf_no_layers}"]),
    # --init-from-peft: no adapter_config.json, a peft feature spmd does not read, a flag
    # that disagrees with the adapter's r = 4, a target module the family lacks
    *map(
        train, ["--init-from-peft {tmp}", f"--init-from-peft {{peft_dora}} --init-from-hf {UNTIED}"]
    ),
    train(f"--init-from-peft {PEFT} --init-from-hf {UNTIED} --lora-rank 8"),
    train(f"--init-from-peft {{peft_lm_head}} --init-from-hf {UNTIED}"),
    # an adapter of peft's scale 0 (spmd's alpha 0 would mean 2 x r), NaN in a tensor, int8
    # tensors (issue 55: read as 2 x r, diverged, cast)
    *(train(f"--init-from-peft {{{name}}} --init-from-hf {UNTIED}", why) for name, why in PEFT_BAD),
    # LoRA's settings, checked with LoRA off too (issue 55: they were saved unchecked)
    *(train(f"--lora-{flag}", f"--lora-{flag}") for flag in ("alpha -5", "dropout 2", "alpha nan")),
    plan("--model tiny --lora-dropout 2"),
    # QLoRA's base storage: only under LoRA, a known format, blocks that fit, no pipeline
    train("--lora-base-dtype nf4", "--lora-base-dtype nf4"),
    train("--lora-base-dtype int8", "--lora-base-dtype int8"),
    train("--lora-rank 4 --lora-base-dtype int4", "--lora-base-dtype 'int4'"),
    # the fixture's embed_dim 32 holds no block of 64
    train(f"--init-from-hf {UNTIED} --lora-rank 4 --lora-base-dtype nf4", "in blocks of 64"),
    train(f"--init-from-hf {UNTIED} --lora-rank 4 --lora-base-dtype int8", "in blocks of 64"),
    Case("train", "--lora-rank 4 --lora-base-dtype nf4 --mesh pp=2", TRAIN, mesh=True),
    # the parser itself
    *map(train, ["--steps ten", "--bogus 1", "--stepz 3", "--model huge", "--layout zero9"]),
    # every value checked wherever it comes from (issue 46): TOML keys and values a flag
    # overrides, integers past 64 bits, the job's flags together, the host's limits, paths
    # that cannot be written
    *map(train, ["--config {stepz_toml}", "--config {steps_ten_toml} --steps 3"]),
    train("--peer-timeout -1"),
    train("--config {layers_ten_toml} --n-layers 2"),  # the [model] table's values too
    *map(train, ["--steps 99999999999999999999", "--mesh dp=9223372036854775808"]),
    *map(train, ["--coordinator bogus --num-processes 2 --process-id 1", "--num-processes 2"]),
    *map(train, ["--coordinator h:99999 --num-processes 2 --process-id 1", "--process-id 3"]),
    *map(train, ["--coordinator 127.0.0.1:1234", "--coordinator-timeout 0", "--ref-batch -5"]),
    *map(train, ["--dcn-mesh tp=2 --mesh dp=2", "--mesh dp=4 --dcn-mesh dp=3"]),
    *map(train, ["--run-name ../../escape", "--run-name a/b", "--tracker tensorboard,,wandb"]),
    *map(train, ["--devices 100000", "--mesh dp=100000", "--metrics /dev/full"]),
    *map(train, ["--checkpoint-dir /proc/x", "--metrics /proc/x.jsonl", "--run-dir /proc/x"]),
    *map(train, ["--data-cache /proc/x", "--tensorboard /proc/x"]),
    train("--data {text} --seq-len 8 --eval-fraction 0.5 --eval-batches 1000"),
    train("--data {tmp}/*.jsonl", says="/*.jsonl: matches no file; --data reads"),
    # the planner
    *map(plan, ["--params inf", "--params nan", "--params 1", "--params 1e30"]),
    *map(plan, ["--hbm nan", "--hbm inf", "--overhead nan", "--latency inf"]),
    *map(plan, ["--tflops nan", "--bandwidth nan", "--overlap 2", "--tokens-per-step 0"]),
    *map(plan, ["--devices -1", "--devices-per-node 0", "--mesh dp=2,,tp=2", "--zero 4"]),
    *map(plan, ["--model tiny --n-heads 0", "--model tiny --embed-dim 0", "--lr nan"]),
    *map(plan, ["--collectives bogus", "--optimizer bogus", "--gpu bogus", "--batch -1"]),
    # Hugging Face folders <-> spmd checkpoints
    *map(convert, ["--step 3", "--hf-dtype int8", "--hf-dtype bfloat16", "--max-shard-mb 0"]),
    *map(convert, ["--mesh dp=2,,tp=2", "--devices -1", "--to-hf {tmp}/hf"]),
    convert("--from-hf {hf_list} --to {tmp}/out", ()),
    convert("--from-hf {hf_no_layers} --to {tmp}/out", ()),
    convert("--from-hf {hf_negative_eps} --to {tmp}/out", ()),
    convert("--from-hf {tmp}/missing --to {tmp}/out", ()),
    convert(f"--from-hf {UNTIED}", ()),
    convert(f"--from-hf {UNTIED} --to {{binary}}", ()),
    convert("--checkpoint {checkpoint} --to-hf {tmp}/hf --step -1", ()),
    convert("--checkpoint {tmp}/missing --to-hf {tmp}/hf", ()),
    convert("--checkpoint {checkpoint} --to-hf {checkpoint}", ()),
    convert("--checkpoint {checkpoint} --to-hf {checkpoint}/hf", ()),
    convert("--from-hf {hf_copy} --to {hf_copy}", ()),
    Case("convert", "--from-hf {hf_nan} --to {tmp}/out --mesh dp=1", (), mesh=True),
    # an output that cannot be made or written: under a file, in /proc
    convert(f"--from-hf {UNTIED} --to {{text}}/x", ()),
    convert(f"--from-hf {UNTIED} --to /proc/spmd-x", ()),
    convert("--checkpoint {checkpoint} --to-hf {text}/x", ()),
    convert("--checkpoint {checkpoint} --to-peft /proc/spmd-x", ()),
    # an output in a live run's folder, or inside a checkpoint folder
    convert(f"--from-hf {UNTIED} --to {{locked}}", ()),
    convert(f"--from-hf {UNTIED} --to {{locked}}/converted", ()),
    convert("--checkpoint {checkpoint} --to-hf {unverified_only}/hf", ()),
    # flags the direction does not use
    *map(convert, ["--lora-base {tmp}", "--tokenizer {tmp}", "--to-peft {tmp}/p"]),
    convert("--checkpoint {checkpoint} --to-peft {tmp}/p --hf-dtype bfloat16", ()),
    Case("convert", "--checkpoint {checkpoint} --to-hf {tmp}/hf --lora-base {tmp}", (), True),
    # generation
    *map(generate, ["--max-new-tokens 0", "--temperature nan", "--temperature inf"]),
    *map(generate, ["--temperature -1", "--top-k -1", "--step 3", "--seed -1"]),
    *map(generate, ["--devices -1", "--mesh dp=2,,tp=2", "--num-samples 0"]),
    *map(generate, ["--top-p 0", "--top-p 1.5", "--top-p nan", "--chat false --top-p -1"]),
    generate(f"--from-hf {UNTIED} --prompts-file {{binary}}", ()),
    generate(f"--from-hf {UNTIED} --prompts-file {{tmp}}/missing.txt", ()),
    generate(f"--from-hf {UNTIED} --prompt ''", ()),
    generate("--prompt Hello", ()),
    generate(f"--from-hf {UNTIED} --checkpoint {{checkpoint}} --prompt Hello", ()),
    generate("--from-hf {hf_list} --prompt Hello", ()),
    generate("--checkpoint {checkpoint} --prompt Hello --step -1", ()),
    generate("--checkpoint {tmp}/missing --prompt Hello", ()),
    generate("--max-new-tokens 100000000", mesh=True),  # past config.json's 2048 positions
    generate("--max-new-tokens 2044", mesh=True),  # "Hello" + 2044 = 2049
    generate("--top-k 100000", mesh=True),  # more than the vocab's 128
    generate("--chat", mesh=True),  # byte-level text: no chat template
    generate("--prompt \udcff\udcfe\udcfa", mesh=True),  # bytes past the vocab's 128
    generate("--devices 100000"),
    generate("--lora-base {tmp}"),  # --from-hf reads no adapters
    generate("--from-hf {hf_nan} --prompt Hello --mesh dp=1", (), True),
    generate("--checkpoint {checkpoint} --prompt Hello --max-new-tokens 100000000", (), True),
    # the launcher
    *[Case("launch", f"-n 2 -- {command}") for command in ("{tmp}/missing", "no-such-program-x")],
    *[Case("launch", args) for args in ("-n 2 -- {text}", "-n 0 -- true", "-n 2")],
    *[Case("launch", f"-n 2 {flag} -- true") for flag in ("--grace -1", "--grace nan")],
    Case("launch", "-n 2 --devices-per-process -1 -- true"),
    *[Case("launch", f"{n} -- true") for n in ("-n 99999999999999999999", "-n 100000")],
    Case("launch", "-n 2 --devices-per-process 100000 -- true"),
    # the report of metrics files
    *map(report, ["{binary}", "{list_jsonl}", "{mesh_not_object}", "{step_not_number}"]),
    *map(report, ["{not_json}", "{summary_only}", "{tmp}/missing.jsonl", "{tmp}"]),
    *map(report, ["{metrics} --out {tmp}/x.xyz", "{metrics} --out {tmp}/missing/x.png"]),
    # the benchmarks (their checks run before any compile)
    *[Case("bench", f"--model tiny {a}") for a in ("--rounds 0", "--n-layers 0", "--lr nan")],
    *[
        Case("bench_collectives", a)
        for a in ("--devices 0", "--remat bogus", "--compare-bucket-mb nan")
    ],
]


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """The bad files the cases name, and one good converted checkpoint."""
    root = tmp_path_factory.mktemp("bad-inputs")
    made = {
        "binary": b"\x7fELF\x02\x01\x01\x00" + bytes(range(256)) * 4,  # an executable's start
        "latin1": "caf\xe9 au lait\n".encode("latin-1"),
        "text": b"hello world\n" * 100,
        "top_level_key": b"run = 3\n",
        "list_jsonl": b"[1, 2]\n",
        "not_json": b"not a metrics file\n",
        "summary_only": b'{"kind": "summary"}\n',
        "mesh_not_object": b'{"kind": "config", "config": {}, "mesh": 3}\n{"kind": "train"}\n',
        "step_not_number": b'{"kind": "config", "config": {}, "mesh": {}}\n'
        b'{"kind": "train", "step": "x", "loss": 1.0}\n',
        "stepz_toml": b"[run]\nstepz = 2\n",
        "steps_ten_toml": b'[run]\nsteps = "ten"\n',
        "layers_ten_toml": b'[model]\nn_layers = "ten"\n',
        "metrics": b'{"kind": "config", "config": {}, "mesh": {"data": 2}}\n'
        b'{"kind": "train", "step": 1, "loss": 1.0, "tokens_per_s": 1.0, "step_time_s": 0.1}\n',
    }
    paths = {}
    for name, content in made.items():
        paths[name] = root / name
        paths[name].write_bytes(content)
    for name, change in {
        "hf_list": None,
        "hf_no_layers": {"num_hidden_layers": 0},
        "hf_negative_eps": {"rms_norm_eps": -1.0},
    }.items():
        folder = root / name
        shutil.copytree(UNTIED, folder)
        hf = json.loads((folder / "config.json").read_text())
        text = "[1, 2]" if change is None else json.dumps(hf | change)
        (folder / "config.json").write_text(text)
        paths[name] = folder
    for name, change in {
        "peft_dora": {"use_dora": True},
        "peft_lm_head": {"target_modules": ["q_proj", "lm_head"]},
        "peft_alpha_zero": {"lora_alpha": 0},
        "peft_nan": {},
        "peft_int8": {},
    }.items():
        folder = root / name
        shutil.copytree(PEFT, folder)
        adapter = json.loads((folder / "adapter_config.json").read_text())
        (folder / "adapter_config.json").write_text(json.dumps(adapter | change))
        paths[name] = folder
    bad_peft_tensors(paths["peft_nan"], paths["peft_int8"])
    made_folders(root, paths)
    paths["hf_copy"] = root / "hf_copy"
    shutil.copytree(UNTIED, paths["hf_copy"])
    paths["hf_nan"] = root / "hf_nan"  # NaN in the first tensor's first values
    shutil.copytree(UNTIED, paths["hf_nan"])
    from spmd.io import safetensors_io

    shard = sorted(paths["hf_nan"].glob("*.safetensors"))[0]
    info = next(iter(safetensors_io.read_header(shard)[0].values()))
    with shard.open("r+b") as f:
        f.seek(info.offset)
        f.write(np.full(4, np.nan, info.dtype).tobytes())
    from spmd import convert as convert_command  # a good checkpoint (this is device work)

    paths["checkpoint"] = root / "converted"
    argv = ["--from-hf", str(UNTIED), "--to", str(paths["checkpoint"]), "--mesh", "dp=1"]
    assert convert_command.main(argv) == 0
    return {name: str(path) for name, path in paths.items()}


def bad_peft_tensors(nan: Path, int8: Path) -> None:
    """The peft fixture's adapter with NaN in the last tensor's first values, and with every
    tensor stored as int8 (its values rounded)."""
    from spmd.io import safetensors_io

    name = "adapter_model.safetensors"
    tensors, metadata = safetensors_io.read_header(PEFT / name)
    values = {n: np.array(t.read()) for n, t in tensors.items()}
    rounded = {n: np.round(v * 100).clip(-127, 127).astype(np.int8) for n, v in values.items()}
    values[list(values)[-1]].reshape(-1)[:4] = np.nan
    for folder, tree in ((nan, values), (int8, rounded)):
        entries = [(n, v.shape, v.dtype) for n, v in tree.items()]
        safetensors_io.write(folder / name, entries, tree.__getitem__, metadata)


def made_folders(root: Path, paths: dict[str, Path]) -> None:
    """Folders a run must refuse: the user's files in a run or checkpoint folder, steps all set
    aside as damaged or without manifests, a lock of a live run on another host; and another
    run's metrics file."""
    from spmd.training.folder_lock import LOCK_FILE, Holder

    tree = {
        "foreign_run": {"notes.txt": "mine"},
        "foreign_config": {"config.toml": "[mine]\n", "metrics.jsonl": "my notes\n"},
        "user_steps": {str(i): f"file {i}" for i in range(1, 6)},
        "all_damaged": {"3.damaged/x": ""},
        "locked": {LOCK_FILE: Holder("another-host", 4242, 0.0, 4e9).text()},  # beats until 2096
        "unverified_only": {"1/_CHECKPOINT_METADATA": "{}"},
    }
    for name, files in tree.items():
        for relative, text in files.items():
            (root / name / relative).parent.mkdir(parents=True, exist_ok=True)
            (root / name / relative).write_text(text)
        paths[name] = root / name
    other = {"kind": "config", "config": {"checkpoint": {"checkpoint_dir": "/elsewhere/ck"}}}
    paths["other_run_metrics"] = root / "other.jsonl"
    paths["other_run_metrics"].write_text(json.dumps(other) + "\n")


def run_command(command: str, argv: list[str]) -> int:
    """A command's exit status, as `python -m spmd.COMMAND argv` would give it."""
    try:
        return importlib.import_module(f"spmd.{command}").main(argv)
    except SystemExit as exited:  # the argument parser's errors
        return exited.code


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_a_bad_input_exits_2_with_one_line_before_device_work(
    case, files, tmp_path, monkeypatch, capsys
):
    from spmd.parallel import mesh

    def no_device_work(*args, **kwargs):
        raise AssertionError(f"setup_mesh{args} ran: the bad input was not refused up front")

    if not case.mesh:
        # the modules that bind setup_mesh by name are imported first, so that none binds
        # the fence for good (a later case that needs the mesh would then meet it), and
        # fenced too
        for module in (mesh, *map(importlib.import_module, MESH_USERS)):
            monkeypatch.setattr(module, "setup_mesh", no_device_work)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # tokenized corpora
    capsys.readouterr()  # what the fixtures printed
    status = run_command(case.command, case.argv(files, tmp_path))
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert case.says in lines[0], err


def test_the_table_is_large_and_covers_every_command():
    commands = {case.command for case in CASES}
    assert len(CASES) >= 80
    assert {"train", "plan", "convert", "generate", "launch", "report", "bench"} <= commands
    assert len({case.id for case in CASES}) == len(CASES)  # no case twice


def test_a_step_too_large_for_a_device_exits_2_after_compiling_and_a_dry_run_warns(
    tmp_path, monkeypatch, capsys
):
    """--seq-len 16384 on tiny made 192 layers deep (batch 32, no remat) needs about 610 GiB
    of temp per device (the layers' kept activations: attention itself is linear in length
    since the blockwise kernel, and 4 layers would fit a 24 GiB host): the compiled step is
    refused before anything is allocated for it, naming the flags that shrink it; a dry run
    prints its report and the same sentence as a warning, exit 0."""
    from spmd import train as train_command
    from spmd.observe.capacity import host_memory

    if (host_memory() or 0) > 2**39:
        pytest.skip("this host holds the step")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 20_000)
    argv = ["--model", "tiny", "--seq-len", "16384", "--n-layers", "192", "--mesh", "dp=1"]
    argv += ["--data", str(corpus)]
    capsys.readouterr()
    assert train_command.main([*argv, "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: the compiled train step needs"), err
    assert "GiB per device" in err[0] and "--remat full" in err[0] and "--seq-len" in err[0]
    assert train_command.main([*argv, "--dry-run"]) == 0
    out = capsys.readouterr()
    assert "temp" in out.out and out.err.startswith("warning: the compiled train step needs")
