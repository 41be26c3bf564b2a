"""One folder per training run: where it is, what it holds, and how the processes of a job agree
on it.

    <run folder>/config.toml      the resolved config (`--config` it to run again, see below)
                 metrics.jsonl    the metrics records (docs/contracts.md)
                 logs/rank-00000.log   each process's log lines (spmd.log)
                 tensorboard/     TensorBoard events (with the tensorboard tracker)
                 checkpoints/     the orbax checkpoint steps
                 profile/         --profile traces
                 report.png       `python -m spmd.report <run folder>`
                 samples.jsonl    --sample-every's samples (spmd.run.samples)
                 samples.md       `spmd.report`'s table of them
                 .spmd-lock       the lock of the run writing it (spmd.training.claims)

The folder is `--run-dir`, else `$SPMD_RUNS_DIR/<run name>` (`runs/<run name>` without that
variable), and the run name is `--run-name`, else `<model>-<mesh>-<stamp>`. The stamp is the
SLURM job id (`job123456`) in a SLURM job, which a requeued job keeps, so the same batch script
continues its own folder; elsewhere it is the start's UTC time (`20261124-233409`), and a
second run in the same second gets `-2`. A job requeued outside SLURM (Kubernetes, a script
that reruns the command) must name its folder with `--run-dir` or `--run-name` to continue it,
as torchtitan's fixed dump folder and Levanter's `--run-id` do.

`SPMD_RUNS_DIR=none` turns the default folder off (the test suite does: a default run's final
checkpoint costs seconds, 39 s for the 64-device CPU test); `--run-dir` still makes one.

Each path flag given (`--checkpoint-dir`, `--metrics`, `--tensorboard`, `--profile-dir`) wins
over the folder's. `--dry-run` and `--run-dir none` make no folder: only the path flags write.

config.toml holds the config as the command resolved it, before the folder filled in its paths,
without what only this start asked for (`rerun_config`: the folder it names, --stop-after,
--resume): `python -m spmd.train --config <folder>/config.toml` runs the same training into a
new folder, and with `--run-dir <folder>` it continues this one (`continue_command`).

In a job of several processes every process must use the same folder, but their clocks and
start times differ: process 0 names it and publishes the name in the distributed runtime's
key-value store, which the others read (spmd.training.job uses the same store for stops).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import time
from pathlib import Path
from typing import Any

from spmd.sections import Config

RUNS_ENV = "SPMD_RUNS_DIR"  # the folder of default run folders; "none": no default folder
DEFAULT_ROOT = "runs"
NO_FOLDER = "none"
CONFIG_FILE = "config.toml"
METRICS_FILE = "metrics.jsonl"
CHECKPOINTS = "checkpoints"
TENSORBOARD = "tensorboard"
PROFILE = "profile"
LOGS = "logs"
REPORT_FILE = "report.png"
SAMPLES_FILE = "samples.jsonl"  # --sample-every's samples (spmd.run.samples)
SAMPLES_REPORT = "samples.md"  # spmd.report's table of them
FOLDER_KEY = "spmd/run_folder"
FOLDER_WAIT_MS = 600_000  # how long a process waits for process 0 to name the folder
CONFIG_HEADER = "# the resolved config of this run: "  # how a config.toml spmd wrote begins


def makes_folder(cfg: Config) -> bool:
    """Whether this run writes a run folder (not under --dry-run or --run-dir none)."""
    return not cfg.run.dry_run and cfg.run.run_dir != NO_FOLDER


def join(folder: str, name: str) -> str:
    """`folder`/`name` for a local path or a URL (gs://bucket/run + checkpoints)."""
    return f"{folder.rstrip('/')}/{name}"


def is_local(path: str) -> bool:
    return "://" not in path


def trackers(cfg: Config) -> list[str]:
    """The names in --tracker, in order ("none" or empty: [])."""
    names = [n.strip() for n in cfg.observe.tracker.split(",") if n.strip()]
    return [] if names == [NO_FOLDER] else names


def with_paths(cfg: Config, folder: str | None) -> Config:
    """`cfg` with each empty path field set to its place in `folder` (None: no folder), and
    `--checkpoint-dir none` (a run folder without checkpoints) as no checkpoint folder."""
    given = cfg.checkpoint.checkpoint_dir
    if given == NO_FOLDER:
        checkpoint_dir = ""
    else:
        checkpoint_dir = given or (join(folder, CHECKPOINTS) if folder is not None else "")
    cfg = dataclasses.replace(
        cfg, checkpoint=dataclasses.replace(cfg.checkpoint, checkpoint_dir=checkpoint_dir)
    )
    if folder is None:
        return cfg
    observe = cfg.observe
    tensorboard = TENSORBOARD in trackers(cfg) and not observe.tensorboard
    return dataclasses.replace(
        cfg,
        observe=dataclasses.replace(
            observe,
            metrics=observe.metrics or join(folder, METRICS_FILE),
            tensorboard=join(folder, TENSORBOARD) if tensorboard else observe.tensorboard,
            # a --tensorboard given keeps its traces, where TensorBoard's profile plugin looks
            profile_dir=observe.profile_dir or observe.tensorboard or join(folder, PROFILE),
        ),
    )


def mesh_label(mesh: str) -> str:
    """The mesh as a name part: "dp=2,fsdp=2,tp=2" -> "dp2-fsdp2-tp2" (an axis of -1 without
    its size: "dp=-1" -> "dp")."""
    from spmd.parallel.mesh import format_mesh, parse_mesh

    return format_mesh(parse_mesh(mesh)).replace("=-1", "").replace("=", "").replace(",", "-")


def model_label(cfg: Config) -> str:
    if cfg.run.init_from_hf:
        return Path(cfg.run.init_from_hf.rstrip("/")).name or "hf"
    return cfg.run.model


def stamp() -> str:
    """The run name's last part: the SLURM job id where there is one (kept when SLURM requeues
    the job), else the UTC time to the second."""
    job = os.environ.get("SLURM_JOB_ID")
    return f"job{job}" if job else time.strftime("%Y%m%d-%H%M%S", time.gmtime())


def root() -> str:
    return os.environ.get(RUNS_ENV) or DEFAULT_ROOT


def planned_folder(cfg: Config, when: str = "") -> str | None:
    """The run folder this command would use (None: none), with the stamp `when` (else now);
    for checks made before the processes start, and by `choose_folder`."""
    if not makes_folder(cfg):
        return None
    if cfg.run.run_dir:
        return cfg.run.run_dir
    if root() == NO_FOLDER:  # SPMD_RUNS_DIR=none: only an explicit --run-dir makes a folder
        return None
    name = cfg.run.run_name or f"{model_label(cfg)}-{mesh_label(cfg.parallel.mesh)}-{when}"
    return join(root(), name)


def choose_folder(cfg: Config) -> str | None:
    """The run folder (process 0's choice): as planned, and for a name stamped with the time,
    one that no earlier run took (a suffix -2, -3, ... on a clash)."""
    when = stamp()
    folder = planned_folder(cfg, when)
    if folder is None or cfg.run.run_dir or cfg.run.run_name or when.startswith("job"):
        return folder
    n, chosen = 1, folder
    while is_local(chosen) and Path(chosen).exists():
        n += 1
        chosen = f"{folder}-{n}"
    return chosen


def agreed_folder(cfg: Config, client: Any, process_id: int) -> str | None:
    """The run folder, the same on every process: process 0 chooses it and publishes it
    through the distributed runtime's key-value store (`client`; None in a single process)."""
    named = cfg.run.run_dir or cfg.run.run_name  # the same on every process already
    if client is None or named or planned_folder(cfg) is None:
        return choose_folder(cfg)
    if process_id == 0:
        folder = choose_folder(cfg)
        client.key_value_set(FOLDER_KEY, folder)
        return folder
    return client.blocking_key_value_get(FOLDER_KEY, FOLDER_WAIT_MS)


# The fields of one start of a run, not of the training: config.toml leaves them at their
# defaults, so that it trains again into a new folder and continues to the end.
ONE_START_FIELDS = {"run": ("run_dir", "run_name", "stop_after"), "checkpoint": ("resume",)}


def rerun_config(cfg: Config) -> Config:
    """`cfg` without what only this start asked for (ONE_START_FIELDS at their defaults): what
    the run folder's config.toml holds."""
    for section, names in ONE_START_FIELDS.items():
        value = getattr(cfg, section)
        defaults = type(value)()
        kept = {name: getattr(defaults, name) for name in names}
        cfg = dataclasses.replace(cfg, **{section: dataclasses.replace(value, **kept)})
    return cfg


def continue_command(cfg: Config) -> str:
    """The command line that continues this run after a stop: its folder's config.toml into
    its folder (`cfg.run.run_dir`, as `open_folder` set it); without a folder, in words."""
    folder = cfg.run.run_dir
    if not folder or folder == NO_FOLDER:
        again = " without --stop-after" if cfg.run.stop_after else ""
        return f"the same command{again} continues from it (--resume auto, the default)"
    return f"python -m spmd.train --config {join(folder, CONFIG_FILE)} --run-dir {folder}"


def report_command(cfg: Config) -> str:
    """The command that draws this run's curves (spmd.report), with how to install the
    `report` extra's matplotlib where it is missing; "" when the run writes no metrics file."""
    folder, metrics = cfg.run.run_dir, cfg.observe.metrics
    what = folder if folder and folder != NO_FOLDER else metrics
    if not what:
        return ""
    missing = "" if _importable("matplotlib") else "  (matplotlib: pip install -e '.[report]')"
    return f"python -m spmd.report {what}{missing}"


def _importable(module: str) -> bool:
    """Whether `module` can be imported, found without importing it."""

    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules holds None for it: an import of it fails
        return False


def write_config(folder: str, text: str) -> str:
    """Write the run's config TOML into `folder` (created); returns its path."""
    from spmd import paths

    path = join(folder, CONFIG_FILE)
    header = (
        f"{CONFIG_HEADER}`python -m spmd.train --config THIS_FILE` trains it again\n"
        "# into a new run folder (it holds no --run-dir, --run-name, --stop-after or --resume);\n"
        "# add --run-dir of this folder to continue it\n"
    )
    paths.write_text(path, header + text + "\n")
    return path


def log_file(folder: str, rank: int) -> str:
    """The rank's log file in a local run folder."""
    return join(join(folder, LOGS), f"rank-{rank:05d}.log")


def open_folder(
    cfg: Config, config_text: str, claim: Any = lambda cfg, folder: None
) -> tuple[Config, str | None]:
    """Agree on the run folder, let `claim(cfg with the folder's paths, folder)` check and lock
    it and the checkpoint folder before anything is written (spmd.training.claims), open this
    process's log file in it (a local folder) and, on process 0, write `config_text` as its
    config.toml; (`cfg` with its empty paths in the folder, the folder or None)."""
    from spmd import paths
    from spmd.log import is_primary, open_rank_file, say
    from spmd.parallel import distributed

    rank = distributed.process_id()
    folder = agreed_folder(cfg, distributed.client(), rank)
    folder = paths.local(folder) if folder is not None else None
    if not cfg.run.dry_run:
        claim(with_paths(cfg, folder), folder)
    if folder is None:  # the path flags alone; --checkpoint-dir none still means none
        return with_paths(cfg, None), None
    if not paths.is_url(folder):
        open_rank_file(log_file(folder, rank), rank)
    if is_primary():
        write_config(folder, config_text)
    say(f"run folder {folder}")
    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, run_dir=folder))
    return with_paths(cfg, folder), folder


def trackers_of(cfg: Config, folder: str | None, require_tensorboard: bool) -> list[Any]:
    """The experiment trackers of --tracker that start (spmd.observe.trackers), named after the
    run folder."""
    from spmd.observe.trackers import open_trackers

    name = cfg.run.run_name or (Path(folder).name if folder else model_label(cfg))
    return open_trackers(trackers(cfg), cfg.observe.tensorboard, folder, name, require_tensorboard)
