"""The tiny Hugging Face checkpoints under tests/fixtures/ (written by `transformers` itself
through tests/fixtures/make_hf.py, run by hand; torch and transformers are not needed here)
and what the tests do with them: load one onto a mesh, take its logits, convert it through
the commands and back, edit its config.json, train a few steps from it. Shared by
tests/test_conformance.py and the per-family tests/test_hf*.py."""

import dataclasses
import functools
import json
import shutil
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from models import family
from spmd import convert
from spmd.engine.state_layout import sharded_bytes
from spmd.engine.step import build_program
from spmd.io import safetensors_io
from spmd.parallel import traced_layout
from spmd.run import weights
from spmd.run.builder import optimizer
from spmd.run.config import flat
from tests import trainer

FIXTURES = Path(__file__).resolve().parent / "fixtures"
ONE, THREE_D = "dp=1", "dp=2,fsdp=2,tp=2"
MESHES = (ONE, THREE_D)  # the logits' meshes, unless a fixture says others
BATCH, SEQ_LEN, STEPS = 8, 16, 3  # the training runs'


@functools.cache
def reference(name: str) -> dict[str, np.ndarray]:
    """Fixture `name`'s reference.npz: input_ids, transformers' logits, greedy_ids, extras."""
    return dict(np.load(FIXTURES / name / "reference.npz"))


@functools.cache
def loaded(name: str, mesh: str) -> weights.Loaded:
    return weights.from_hf(str(FIXTURES / name), trainer.layout(mesh))


def logits_of(source: weights.Loaded, input_ids: np.ndarray) -> np.ndarray:
    layout = source.program.layout

    @jax.jit
    def forward(params, tokens):
        with traced_layout.activation_layout(layout.mesh, layout.zero_stage):
            return nnx.merge(source.program.graphdef, params)(tokens)

    return np.asarray(forward(source.params, jax.device_put(input_ids, layout.batch_sharding())))


def relative_difference(logits: np.ndarray, expected: np.ndarray) -> float:
    """Max |spmd - transformers|, relative to the largest logit."""
    return float(np.abs(logits - expected).max() / np.abs(expected).max())


def with_config(source: weights.Loaded, mesh: str, **change) -> weights.Loaded:
    """The same weights under the config fields `change` altered."""
    cfg = dataclasses.replace(source.model, **change)
    program = weights.model_program(cfg, trainer.layout(mesh))
    return weights.Loaded(cfg, program, source.params, {}, str(change))


def logit_difference(name: str, mesh: str, **change) -> float:
    """relative_difference of fixture `name`'s logits on `mesh`, its config fields `change`
    altered (same weights)."""
    source = loaded(name, mesh)
    if change:
        source = with_config(source, mesh, **change)
    return relative_difference(
        logits_of(source, reference(name)["input_ids"]), reference(name)["logits"]
    )


def hf_tensors(folder: Path) -> dict[str, np.ndarray]:
    found = {}
    for path in folder.glob("*.safetensors"):
        found.update({n: t.read() for n, t in safetensors_io.read_header(path)[0].items()})
    return found


def convert_round_trip(
    folder: Path, tmp_path: Path, mesh: str, back_mesh: str | None = None
) -> tuple[dict[str, np.ndarray], dict, dict]:
    """HF `folder` -> spmd checkpoint tmp_path/spmd (on `mesh`) -> HF folder tmp_path/hf (on
    `back_mesh`, default the same) through the spmd.convert command; asserts every tensor comes
    back with its name, dtype and values bit for bit. Returns (the original tensors, its
    config.json, the written config.json) for the caller's own checks."""
    spmd_dir, hf_dir = str(tmp_path / "spmd"), str(tmp_path / "hf")
    assert convert.main(["--from-hf", str(folder), "--to", spmd_dir, "--mesh", mesh]) == 0
    back_args = ["--checkpoint", spmd_dir, "--to-hf", hf_dir, "--mesh", back_mesh or mesh]
    assert convert.main(back_args) == 0
    original, back = hf_tensors(folder), hf_tensors(Path(hf_dir))
    assert sorted(original) == sorted(back)
    for tensor, value in original.items():
        assert back[tensor].dtype == value.dtype
        np.testing.assert_array_equal(back[tensor], value, err_msg=tensor)
    source = json.loads((folder / "config.json").read_text())
    return original, source, json.loads(Path(hf_dir, "config.json").read_text())


def save_random_params(cfg, mesh: str, folder: Path, max_shard_bytes: int) -> tuple[dict, list]:
    """(params, files written): random values of model `cfg`'s params in `mesh`'s layout
    (cheaper than compiling init), saved as a Hugging Face folder in shards of at most
    `max_shard_bytes`."""
    source = weights.model_program(cfg, trainer.layout(mesh))
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda x: jax.device_put(rng.standard_normal(x.shape, np.float32), x.sharding),
        source.abstract_params,
    )
    return params, family.save_hf(params, cfg, str(folder), max_shard_bytes=max_shard_bytes)


def assert_params_equal(params, expected) -> None:
    """Every leaf of `params` equals `expected`'s, bit for bit, wherever either is placed."""
    for (path, value), other in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(np.asarray(value), np.asarray(other), err_msg=str(path))


def edited(tmp_path: Path, name: str, **changes) -> str:
    """A copy of fixture `name` in tmp_path whose config.json has `changes`."""
    folder = tmp_path / name
    shutil.copytree(FIXTURES / name, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(changes)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def convert_error(folder: str, tmp_path: Path, capsys) -> str:
    """spmd.convert --from-hf `folder`'s standard error, asserting it exits 2 and writes
    nothing."""
    args = ["--from-hf", folder, "--to", str(tmp_path / "out"), "--mesh", "fsdp=-1"]
    assert convert.main(args) == 2
    assert not (tmp_path / "out").exists()
    return capsys.readouterr().err


def digits_corpus(tmp_path: Path) -> Path:
    """A corpus of bytes below 64 (every fixture's vocab is 64 or more): words of 5 digits and
    signs."""
    rng = np.random.default_rng(0)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        " ".join("".join(rng.choice(list("0123456789+-*/=<>"), 5)) for _ in range(400))
    )
    return corpus


@dataclasses.dataclass(frozen=True)
class TrainRun:
    losses: np.ndarray  # the loss of each step, before its update
    params: dict  # the final params, on the host
    step: Any  # the compiled train step (jax.stages.Compiled), for its dot FLOPs
    state_bytes: int  # params + optimizer state per device, as the program shards them


@functools.cache
def train_run(name: str, mesh: str, executor: str = "auto") -> TrainRun:
    """STEPS AdamW steps (ZeRO 3, fp32, no warm-up, lr 3e-3) from fixture `name`'s weights on
    `mesh`, all on one batch of BATCH x SEQ_LEN random tokens (so the loss falls), through
    the AOT-compiled step whose dots are counted."""
    folder = str(FIXTURES / name)
    cfg = family.open_hf(folder).config
    fam = family.of(cfg)
    run = flat(None, steps=STEPS, batch=BATCH, seq_len=SEQ_LEN, warmup=0, lr=3e-3)
    program = build_program(
        lambda seed: fam.create(cfg, seed),
        fam.loss,
        lambda names: optimizer(run)(names),
        trainer.layout(mesh),
        executor=executor,
    )
    step = program.compile_train_step(BATCH, SEQ_LEN)
    params, opt_state, loss_scale = weights.init_from_hf(folder, program)
    rows = np.random.default_rng(0).integers(0, cfg.vocab_size, (BATCH, SEQ_LEN + 1), np.int32)
    sharding = program.layout.batch_sharding()
    batch = {
        "inputs": jax.device_put(rows[:, :-1], sharding),
        "targets": jax.device_put(rows[:, 1:], sharding),
    }
    losses = []
    for _ in range(STEPS):
        params, opt_state, loss_scale, metrics = step(params, opt_state, loss_scale, batch)
        losses.append(metrics["loss"])
    return TrainRun(
        np.asarray(jax.device_get(losses)),
        jax.device_get(params),
        step,
        state_bytes(program),
    )


def state_bytes(program) -> int:
    """Params + optimizer state per device, as `program` shards them."""
    return sharded_bytes(program.abstract_params) + sharded_bytes(program.abstract_opt_state)
