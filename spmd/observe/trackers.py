"""Experiment trackers beside the metrics JSONL: TensorBoard, Weights & Biases, MLflow.

Each is fed the records the JSONL gets (spmd.observe.metrics.MetricsLog), on process 0 only:

- the `config` record: the resolved config, flattened to "section.field" (W&B's run config,
  MLflow's params, TensorBoard's text "config"), and its figures of the compiled step
  (parameters, FLOPs per step, the device's peak, memory per device, compile time) as the
  run's summary (W&B's summary, MLflow's metrics at step 0, TensorBoard's scalars "config/...");
- every record with a `step` (train, eval, profile, checkpoint, ...): each number as the
  scalar "<kind>/<field>" at that step (train/loss, train/mfu, train/memory_peak_bytes, ...);
  a table of numbers (an eval's `losses`) as "<kind>/<field>/<key>";
- the `summary` record: its numbers (final and eval loss, tokens/s, MFU) at its `steps`, and
  into W&B's run summary;
- the `samples` of --sample-every (spmd.run.samples; the trackers alone get them, as records of
  kind "samples": `step` and `samples`, rows of prompt and completion): a W&B table "samples"
  at the step, TensorBoard text "samples" (a Markdown table), an MLflow text artifact
  `samples/step-<step>.md`.

Which tracker runs is `--tracker`; a tracker whose package is missing or whose service cannot
be reached at start is one warning line and the run goes on without it (`open_trackers`); one
that fails later is dropped by MetricsLog with one line, never ending the run. W&B and MLflow
take their own settings from their environment (WANDB_MODE=offline, WANDB_PROJECT,
WANDB_API_KEY; MLFLOW_TRACKING_URI, MLFLOW_EXPERIMENT_NAME); without a tracking URI MLflow
writes a file store in the run folder (`<run folder>/mlruns`; MLflow 3 keeps that store only
behind MLFLOW_ALLOW_FILE_STORE, which spmd sets unless it is set already).
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from typing import Any

from spmd.errors import UsageError
from spmd.log import is_primary, warn

KNOWN = ("tensorboard", "wandb", "mlflow")
PROJECT = "spmd"  # the W&B project and MLflow experiment when their environment names none
MLFLOW_PARAM_CHARS = 6000  # MLflow's limit on a param value; longer values are cut
MLFLOW_BATCH = 100  # params per log_batch call, MLflow's limit


def check_names(names: list[str]) -> None:
    """UsageError for a tracker name that is not one of KNOWN."""
    for name in names:
        if name not in KNOWN:
            raise UsageError(
                f"--tracker {name!r} is not one of {', '.join(KNOWN)} (comma-separated), or none"
            )


def numbers(prefix: str, fields: dict[str, Any]) -> dict[str, float]:
    """{"<prefix>/<field>": number} of a record's numbers (bools, None, text and lists left
    out), one level of nested tables as "<prefix>/<field>/<key>"."""
    out: dict[str, float] = {}
    for key, value in fields.items():
        if isinstance(value, dict):
            out.update(numbers(f"{prefix}/{key}", value) if "/" not in prefix else {})
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[f"{prefix}/{key}"] = value
    return out


def flat_config(tables: dict[str, Any]) -> dict[str, Any]:
    """{"section.field": value} of a config record's tables."""
    return {
        f"{section}.{key}": value
        for section, table in tables.items()
        if isinstance(table, dict)
        for key, value in table.items()
    }


def config_figures(record: dict[str, Any]) -> dict[str, float]:
    """The numbers a config record holds beside the config: "config/n_params",
    "config/memory_per_device/temp", "config/flops_per_step", ..."""
    return numbers("config", {k: v for k, v in record.items() if k != "config"})


def samples_markdown(rows: list[dict[str, Any]]) -> str:
    """A `samples` record's rows (prompt, completion) as a Markdown table."""

    def cell(text: str) -> str:
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| prompt | completion |", "|---|---|"]
    return "\n".join(lines + [f"| {cell(r['prompt'])} | {cell(r['completion'])} |" for r in rows])


def stepped(kind: str, fields: dict[str, Any]) -> tuple[int, dict[str, float]] | None:
    """(step, scalars) of a record the trackers plot: a stepped record's numbers, a summary's
    at its last step; None for others (the config record is handled on its own)."""
    step = fields.get("steps") if kind == "summary" else fields.get("step")
    if not isinstance(step, int) or isinstance(step, bool):
        return None
    scalars = numbers(kind, {k: v for k, v in fields.items() if k != "step"})
    return (step, scalars) if scalars else None


class TensorBoard:
    """TensorBoard events in `logdir` (tensorboardX), flushed after each record."""

    name = "tensorboard"

    def __init__(self, logdir: str) -> None:
        from tensorboardX import SummaryWriter

        self._writer = SummaryWriter(logdir)

    def write(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "config":
            text = json.dumps(fields.get("config", {}), indent=1)
            self._writer.add_text("config", f"```\n{text}\n```", 0)
            for key, value in config_figures(fields).items():
                self._writer.add_scalar(key, value, 0)
        elif kind == "samples":
            self._writer.add_text("samples", samples_markdown(fields["samples"]), fields["step"])
        elif (found := stepped(kind, fields)) is not None:
            step, scalars = found
            for key, value in scalars.items():
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB:
    """A Weights & Biases run named after the run folder, its files under the folder (W&B's own
    `wandb/` there); a resumed run continues the W&B run of the same id."""

    name = "wandb"

    def __init__(self, folder: str | None, run_name: str) -> None:
        import wandb

        mode = os.environ.get("WANDB_MODE", "online")
        if mode not in ("offline", "disabled", "dryrun") and not _wandb_key():
            raise RuntimeError("no W&B login (run `wandb login`, set WANDB_API_KEY, or WANDB_MODE")
        self._run = wandb.init(
            project=os.environ.get("WANDB_PROJECT") or PROJECT,
            name=run_name,
            id=_wandb_id(run_name),
            dir=folder,
            resume="allow",
            reinit="create_new",
        )

    def write(self, kind: str, fields: dict[str, Any]) -> None:
        if kind == "config":
            self._run.config.update(flat_config(fields.get("config", {})), allow_val_change=True)
            self._run.summary.update(config_figures(fields))
            return
        if kind == "samples":  # a table of the step's prompts and completions
            import wandb

            columns: list[str | int] = ["step", "prompt", "completion"]
            data = [[r["step"], r["prompt"], r["completion"]] for r in fields["samples"]]
            self._run.log({"samples": wandb.Table(columns=columns, data=data)}, step=fields["step"])
            return
        found = stepped(kind, fields)
        if found is None:
            return
        step, scalars = found
        if kind == "summary":
            self._run.summary.update(scalars)
        elif step >= self._run.step:  # W&B drops steps below its newest (a rollback's replay)
            self._run.log(scalars, step=step)

    def close(self) -> None:
        self._run.finish()


def _wandb_key() -> bool:
    """Whether W&B has an API key (the environment, or `wandb login`'s netrc entry)."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc

    try:
        return netrc.netrc().authenticators("api.wandb.ai") is not None
    except (OSError, netrc.NetrcParseError):
        return False


def _wandb_id(run_name: str) -> str:
    """A W&B run id from the run name (W&B ids may not hold / \\ # ? % :)."""
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in run_name)[:64]


class MLflow:
    """An MLflow run (tag spmd.run_name), continued when a run of that name is found again; the
    tracking URI from MLFLOW_TRACKING_URI, else a file store in the run folder."""

    name = "mlflow"

    def __init__(self, folder: str | None, run_name: str) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ.get("MLFLOW_TRACKING_URI")
        if not uri and folder:  # the run folder's own store; MLflow 3 asks to opt in to it
            uri = f"file://{os.path.abspath(os.path.join(folder, 'mlruns'))}"
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.client = MlflowClient(tracking_uri=uri)
        experiment_name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
        experiment = self.client.get_experiment_by_name(experiment_name)
        experiment_id = (
            experiment.experiment_id
            if experiment is not None
            else self.client.create_experiment(experiment_name)
        )
        found = self.client.search_runs(
            [experiment_id], filter_string=f"tags.`spmd.run_name` = '{run_name}'", max_results=1
        )
        if found:
            self.run_id = found[0].info.run_id
            self.client.update_run(self.run_id, status="RUNNING")
        else:
            created = self.client.create_run(
                experiment_id, run_name=run_name, tags={"spmd.run_name": run_name}
            )
            self.run_id = created.info.run_id

    def write(self, kind: str, fields: dict[str, Any]) -> None:
        from mlflow.entities import Metric, Param

        if kind == "config":
            params = [
                Param(key, str(value)[:MLFLOW_PARAM_CHARS])
                for key, value in flat_config(fields.get("config", {})).items()
            ]
            for start in range(0, len(params), MLFLOW_BATCH):
                self.client.log_batch(self.run_id, params=params[start : start + MLFLOW_BATCH])
            scalars, step = config_figures(fields), 0
        elif kind == "samples":  # a text artifact per sampled step
            name = f"samples/step-{fields['step']:08d}.md"
            self.client.log_text(self.run_id, samples_markdown(fields["samples"]), name)
            return
        elif (found := stepped(kind, fields)) is not None:
            step, scalars = found
        else:
            return
        now = _millis()
        metrics = [Metric(key, float(value), now, step) for key, value in scalars.items()]
        for start in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[start : start + MLFLOW_BATCH])

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _millis() -> int:

    return int(time.time() * 1000)


def open_trackers(
    names: list[str],
    tensorboard: str,
    folder: str | None,
    run_name: str,
    require_tensorboard: bool = False,
) -> list[Any]:
    """The trackers of `names` that start (TensorBoard when `tensorboard` names its folder), on
    process 0 only (the others: none); each one that cannot start is one warning.
    `require_tensorboard` (--tensorboard given): a missing tensorboardX is a UsageError
    instead, as the flag asked for it by name."""
    hint = "install it with pip install -e '.[tensorboard]'"
    # every process refuses alike, before process 0 alone opens the trackers
    if tensorboard and require_tensorboard and not _installed("tensorboardX"):
        raise UsageError(
            f"--tensorboard {tensorboard} needs the tensorboardX package; {hint} or drop "
            f"--tensorboard"
        )
    if not is_primary():  # only process 0 reports
        return []
    opened: list[Any] = []
    wanted = [n for n in names if n != "tensorboard"]
    if tensorboard:
        try:
            opened.append(TensorBoard(tensorboard))
        except ImportError:
            warn(f"warning: tracker tensorboard: no tensorboardX package ({hint}); skipping it")
    for name in wanted:
        tracker = {"wandb": WandB, "mlflow": MLflow}[name]
        try:
            opened.append(tracker(folder, run_name))
        except ImportError as e:
            warn(
                f"warning: tracker {name}: no {e.name} package (pip install -e '.[{name}]'); "
                f"skipping it"
            )
        except Exception as e:  # a login, a server or a store that cannot be reached
            warn(f"warning: tracker {name} did not start ({one_line(e)}); skipping it")
    return opened


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:  # sys.modules holds None for it: imports of it fail
        return False


def one_line(error: BaseException) -> str:
    """ "Type: first line of the message" (at most 200 characters of it)."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    return f"{type(error).__name__}: {lines[0][:200]}"
