"""`python -m spmd.eval`: lm-evaluation-harness tasks on a checkpoint, on any mesh.

    python -m spmd.eval --checkpoint runs/ckpt --tasks hellaswag,arc_easy --mesh dp=2,tp=4
    python -m spmd.eval --from-hf path/to/hf_llama --tasks mytask --include-path my_tasks/
    python -m spmd.eval --checkpoint runs/ckpt --tasks mytask --include-path my_tasks/ --limit 50

lm-eval (`pip install -e ".[eval]"`) builds each task's requests; spmd answers them with the
model's sharded forward and key/value-cache decoder (spmd/run/harness.py), tokenized as
lm-eval's Hugging Face backend tokenizes (spmd/run/harness_text.py), so the scores are those
of `lm_eval --model hf` on the same model exported with `spmd.convert --to-hf`. The params come
from an spmd checkpoint folder or a Hugging Face folder, as spmd.generate reads them; the text
from the tokenizer the checkpoint was trained with (or `--tokenizer`), else bytes. lm-eval's
table of scores goes to stdout, and with `--output-path` its results JSON (per-request samples
included) to a file.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from spmd.errors import UsageError, run_command
from spmd.io import eos, hub, run_paths
from spmd.run import config, harness
from spmd.sections import MeshConfig

DEFAULT_MAX_LENGTH = 2048  # lm-eval's when neither the model nor its tokenizer declares one


@dataclasses.dataclass(frozen=True)
class EvalConfig:
    """What to evaluate, on which tasks, in batches of how many rows. Lengths are in tokens."""

    checkpoint: str = ""  # spmd checkpoint folder (a run's --checkpoint-dir or convert's --to)
    step: int = 0  # checkpoint step to read (0: the newest)
    from_hf: str = ""  # a Hugging Face folder or Hub id (org/name) instead of --checkpoint
    tasks: str = ""  # lm-eval task, group or tag names, comma-separated
    include_path: str = ""  # a folder of task YAMLs beside lm-eval's own tasks
    limit: int = 0  # documents per task (0: all)
    num_fewshot: int = -1  # few-shot examples per prompt (-1: each task's own)
    batch_size: int = 16  # rows per forward (rounded up to a multiple of the data-parallel ways)
    # the longest row scored, as lm-eval's max_length (0: the model's declared positions, else
    # the --seq-len it trained at, as spmd.convert --to-hf declares them)
    max_length: int = 0
    tokenizer: str = ""  # tokenizer.json, its folder or a Hub id (empty: the checkpoint's)
    lora_base: str = ""  # the folder of a LoRA checkpoint's base, when moved (see generate)
    output_path: str = ""  # write lm-eval's results (and its per-request samples) as JSON here
    seed: int = 0  # of a task's sampled generations (greedy ones need none)


def check_choices(cfg: EvalConfig, where: MeshConfig) -> list[str]:
    """The task names; UsageError for flags out of range, before any device work."""
    if bool(cfg.checkpoint) == bool(cfg.from_hf):
        raise UsageError("give exactly one of --checkpoint DIR and --from-hf DIR")
    names = [name.strip() for name in cfg.tasks.split(",") if name.strip()]
    if not names:
        raise UsageError("--tasks is empty; give lm-eval task names, comma-separated")
    for flag, value, least in [
        ("--step", cfg.step, 0),
        ("--limit", cfg.limit, 0),
        ("--num-fewshot", cfg.num_fewshot, -1),
        ("--batch-size", cfg.batch_size, 1),
        ("--max-length", cfg.max_length, 0),
    ]:
        if value < least:
            raise UsageError(f"{flag} {value} must be at least {least}")
    if cfg.step and cfg.from_hf:
        raise UsageError(f"--step {cfg.step} picks a step of --checkpoint; --from-hf has none")
    if cfg.include_path and not Path(cfg.include_path).is_dir():
        raise UsageError(f"--include-path {cfg.include_path} is not a folder of task YAMLs")
    from spmd.parallel.mesh import check_section

    check_section(where)
    return names


def tokenizer_path(cfg: EvalConfig, run_config: dict[str, Any]) -> str:
    """--tokenizer, else the tokenizer the checkpoint was trained or converted with, else a
    Hugging Face folder's tokenizer.json; empty for bytes."""
    recorded = run_paths.tokenizer_file(cfg.checkpoint, run_config) if cfg.checkpoint else None
    named = run_paths.tokenizer_named(run_config)
    if not cfg.tokenizer and recorded is None and named:
        raise UsageError(
            f"--checkpoint {cfg.checkpoint} names the tokenizer {named}, which is not there any "
            f"more; give it with --tokenizer PATH"
        )
    if cfg.tokenizer or recorded is not None:
        return cfg.tokenizer or str(recorded)
    beside = Path(cfg.from_hf) / "tokenizer.json" if cfg.from_hf else None
    return str(beside) if beside is not None and beside.is_file() else ""


def max_length(cfg: EvalConfig, source: Any) -> int:
    """--max-length, else the positions the source declares, else its training --seq-len."""
    trained = config.flat_values(source.run_config).get("seq_len") if source.run_config else None
    return cfg.max_length or source.max_positions or trained or DEFAULT_MAX_LENGTH


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    sections = {"eval": EvalConfig, "mesh": MeshConfig}
    about = __doc__.split("\n\n")[0]
    resolved = config.resolve(argv, sections, "python -m spmd.eval", description=about)
    cfg, where = resolved["eval"], resolved["mesh"]
    names = check_choices(cfg, where)
    cfg = hub.resolve_section(cfg)
    from spmd.io import params_io

    if cfg.checkpoint:  # the folder and step exist, before the tasks are indexed
        params_io.pick_step(cfg.checkpoint, cfg.step)
    harness.require_lm_eval("python -m spmd.eval")
    from spmd.run import harness_text, lm_eval_bridge, weights

    manager = lm_eval_bridge.task_manager(names, cfg.include_path)
    source = weights.describe("", 0, cfg.from_hf) if cfg.from_hf else None
    layout = weights.setup_layout(where.mesh, where.devices, where.zero)
    source = source or weights.describe(cfg.checkpoint, cfg.step, "")
    path = tokenizer_path(cfg, source.run_config)
    from spmd.io.tokens import _load_tokenizer

    text = harness_text.text_of(_load_tokenizer(path) if path else None, path)
    if path == "" and source.model.vocab_size > 256:
        raise UsageError(
            f"the model's vocab {source.model.vocab_size} is not byte-level (256) and no "
            f"tokenizer is known; give --tokenizer PATH"
        )
    if cfg.checkpoint:
        loaded = weights.from_checkpoint(cfg.checkpoint, cfg.step, layout, cfg.lora_base)
    else:
        loaded = weights.from_hf(cfg.from_hf, layout)
    stops = eos.declared(cfg.from_hf) if cfg.from_hf else eos.ids(source.run_config.get(eos.KEY))
    length = max_length(cfg, source)
    scorer = harness.Harness(
        loaded.program, loaded.params, text, length, cfg.batch_size, tuple(stops), cfg.seed
    )
    results = lm_eval_bridge.evaluate(scorer, names, manager, cfg.limit, cfg.num_fewshot)
    print(lm_eval_bridge.table(results))
    if cfg.output_path:
        Path(cfg.output_path).write_text(json.dumps(results, indent=1, default=str) + "\n")
    print(f"evaluated {loaded.source} on mesh {where.mesh}, max length {length}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
