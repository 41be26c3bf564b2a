"""`python -m spmd.checkpoint verify DIR`: check every step of a checkpoint folder.

    $ python -m spmd.checkpoint verify runs/ckpt
    runs/ckpt/2: ok: 16 files, 5.1 MiB
    runs/ckpt/3: damaged: state/ocdbt.process_0/d/7c7f... fails its crc32 check (bytes changed)
    runs/ckpt/4: unverified: no manifest.json (an older spmd's step, or stopped before writing it)

Each complete step is checked against the manifest saved with it (spmd.io.manifest: every
file's size, then its CRC-32), one line per step. The exit status is 0 when every step that has
a manifest matches it (a step without one is listed as unverified, not counted as damage) and 2
otherwise. A LoRA run's adapter-only step (spmd.lora_base) also has the base it
refers to hashed and compared, in one more line: a base that changed counts as damage. Nothing
is moved or changed: `spmd.train --resume` sets a damaged step aside itself and resumes from the
newest good one. Folders already set aside (`<step>.damaged`,
`<step>.diverged`) and saves that never finished (`<step>.orbax-checkpoint-tmp`) are not steps,
so they are not checked. DIR may be a run folder (its `checkpoints/` is checked) and a local
path or a gs:// s3:// file:// URL (spmd.paths).
"""

from __future__ import annotations

import dataclasses
import sys

from spmd import paths
from spmd.errors import UsageError, run_command
from spmd.io import hub
from spmd.run import config

ACTIONS = ("verify",)


@dataclasses.dataclass(frozen=True)
class VerifyConfig:
    """Which steps to check."""

    step: int = 0  # check only this step (0: every complete step)
    # the folder of a LoRA checkpoint's base when it is no longer where the checkpoint recorded
    # it (moved, or another copy): its content hash must match (empty: the recorded folder)
    lora_base: str = ""


def main(argv: list[str] | None = None) -> int:
    return run_command(run, argv)


def run(argv: list[str] | None) -> int:
    what = config.Positional(
        "action", "+", "verify DIR [DIR ...]: check every step of the checkpoint folders"
    )
    resolved = config.resolve(
        argv,
        {"verify": VerifyConfig},
        "python -m spmd.checkpoint",
        description=__doc__.split("\n\n")[0],
        positional=what,
    )
    action, *folders = resolved["action"]
    if action not in ACTIONS:
        raise UsageError(
            f"{action!r} is not an action of spmd.checkpoint; choose one of {', '.join(ACTIONS)} "
            f"(python -m spmd.checkpoint verify DIR)"
        )
    if not folders:
        raise UsageError("verify needs a checkpoint folder: python -m spmd.checkpoint verify DIR")
    given = hub.resolve_section(resolved["verify"])  # a Hub id in --lora-base: its download
    damaged = [step for folder in folders for step in verify(folder, given.step, given.lora_base)]
    if damaged:
        raise UsageError(
            f"{len(damaged)} damaged step(s): {', '.join(damaged)}; spmd.train --resume sets "
            f"damaged steps aside and resumes from the newest good one"
        )
    return 0


def verify(folder: str, only: int = 0, base: str = "") -> list[str]:
    """Print each step's verdict; returns the damaged steps' folders. An adapter-only LoRA
    step's base is looked for in `base` (--lora-base) when given."""
    from spmd.io import checkpoint, manifest
    from spmd.training.run_folder import CHECKPOINTS, join

    steps = checkpoint.complete_steps(folder)
    in_run = join(folder, CHECKPOINTS)  # a run folder's checkpoints
    if not steps and (steps_in_run := checkpoint.complete_steps(in_run)):
        folder, steps = in_run, steps_in_run
    if not paths.epath(folder).is_dir():
        raise UsageError(
            f"{folder} is not a folder; give the --checkpoint-dir of a training run or the --to "
            f"folder of spmd.convert"
        )
    if not steps:
        raise UsageError(f"{folder} holds no complete checkpoint step")
    if only and only not in steps:
        raise UsageError(f"--step {only} is not in {folder}; it holds steps {steps}")
    damaged = []
    for step in [only] if only else steps:
        step_dir = join(folder, str(step))
        verdict = manifest.verify(paths.epath(folder) / str(step))
        print(f"{step_dir}: {verdict}", flush=True)
        if verdict.status == "damaged" or not base_matches(folder, step, step_dir, base):
            damaged.append(step_dir)
    return damaged


def base_matches(folder: str, step: int, step_dir: str, given: str = "") -> bool:
    """Whether the LoRA base an adapter-only step refers to (spmd.lora_base) is
    still the one it was trained on, with a line saying so; True for a step of the whole
    state, and for a base not found (the step itself is not damaged by that: the line says
    how to name the base), False for a base whose weights differ."""
    from spmd import lora_base
    from spmd.io import params_io

    try:
        run_config = params_io.saved_config(folder, step)
    except UsageError:  # a config orbax cannot read here: the manifest's verdict stands
        return True
    saved = run_config.get(lora_base.KEY)
    if not isinstance(saved, dict):
        return True
    try:
        base = lora_base.recorded_base(saved, given, folder, run_config, "--lora-base")
    except lora_base.BaseMissing as e:
        if given:  # the folder named on the command line is not there: a mistyped flag
            raise
        print(f"{step_dir}: base not checked: {e}", flush=True)
        return True
    try:
        lora_base.check_base(saved, base, step_dir, "--lora-base")
    except UsageError as e:
        print(f"{step_dir}: base differs: {e}", flush=True)
        return False
    print(f"{step_dir}: base {base}: sha256 {saved['sha256'][:16]} ok", flush=True)
    return True


if __name__ == "__main__":
    sys.exit(main())
