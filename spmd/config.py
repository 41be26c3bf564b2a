"""One typed config tree: dataclass defaults, TOML presets and files, command-line overrides.

Each section of a run's config is a frozen dataclass; its field defaults are the single source
of truth. A run resolves, lowest precedence first:

    dataclass defaults < the model preset (configs/NAME.toml [model]) < --config FILE < flags

Every field of every section is a flag: `seq_len` is `--seq-len`. Field names are unique across
sections, so flags need no section prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import importlib.resources
import inspect
import re
import sys
import tomllib
import typing
from collections.abc import Callable
from pathlib import Path
from typing import Any

from spmd.errors import UsageError


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """How to train: layout, batch arithmetic, schedule, data, logging. Units in comments."""

    model: str = "small"  # model preset: a file configs/<model>.toml with a [model] table
    layout: str = ""  # named layout from meshes/ (ddp, zero3, megatron, ...); sets mesh + zero
    mesh: str = "dp=-1"  # e.g. "dp=2,fsdp=2,tp=2"; one axis may be -1 (the rest)
    devices: int = 0  # simulate this many CPU devices per process (0: what the mesh needs)
    zero: int = 3  # what the fsdp axis shards: 1 opt state, 2 + grads, 3 + params
    collectives: str = "auto"  # auto: XLA inserts them (jit); explicit: hand-written (shard_map)
    sequence_parallel: bool = False  # Megatron-SP (tp > 1): norms/residuals split along length
    # gradient buckets in MiB: explicit = one psum / psum_scatter per bucket of grads (reverse
    # layer order); auto = XLA's collective combine thresholds (GPU); 0: one per param
    bucket_mb: float = 0.0
    # explicit ZeRO-3: all-gather layer i+1's params while layer i computes (forward and
    # backward); 0: each layer gathers its own params when it starts
    prefetch: bool = True
    xla_preset: str = "throughput"  # XLA flags spmd sets on GPU (yours win): throughput | none
    pp_schedule: str = "gpipe"  # pipeline schedule when pp > 1: gpipe | 1f1b | interleaved
    microbatches: int = 0  # micro-batches per pipeline pass (per accum micro-step); 0: 2 x pp
    pp_virtual: int = 1  # chunks of layers per pipeline stage (interleaved: 2 or more)
    steps: int = 200  # optimizer steps
    batch: int = 32  # global batch: sequences per optimizer step, over all devices
    accum: int = 1  # micro-batches per optimizer step (each batch / accum sequences)
    precision: str = "fp32"  # fp32 | bf16 | fp16: compute and working-param dtype (master fp32)
    # dtype of gradient accumulation and of the cross-device gradient reduction: fp32, or the
    # 16-bit compute dtype; "" = the precision's default (its compute dtype, as in ZeRO)
    grad_reduce: str = ""
    seq_len: int = 128  # tokens per sequence
    lr: float = 3e-3  # peak learning rate (before the scaling rule)
    lr_scaling: str = "none"  # none | linear: lr * batch / ref_batch
    ref_batch: int = 32  # the global batch at which `lr` was tuned (for --lr-scaling linear)
    warmup: int = 20  # linear warm-up steps, then cosine decay to min_lr_ratio * lr
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1  # decoupled (AdamW), matrices only
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # global L2 norm; 0 disables
    # text file, folder of text files, token .bin, JSONL / Parquet / Arrow shards (a file, folder
    # or glob), or a mixture "web=a/*.parquet:0.7,code=b:0.3"; empty: the stdlib sources
    data: str = ""
    tokenizer: str = ""  # Hugging Face tokenizer.json for text (empty: bytes, vocabulary 256)
    data_cache: str = ""  # folder of tokenized corpora (empty: $XDG_CACHE_HOME or ~/.cache/spmd)
    text_field: str = "text"  # the text column of JSONL / Parquet / Arrow records
    prompt_field: str = ""  # SFT: the prompt column (not counted in the loss); + response_field
    response_field: str = ""  # SFT: the response column (the loss counts only its tokens)
    messages_field: str = ""  # chat SFT: a list of {role, content}, rendered by the chat template
    skip_bad_records: bool = False  # count and report unusable records instead of exit 2
    tokenize_workers: int = 0  # processes tokenizing record shards (0: the machine's cores)
    # on: attention stays within each packed document, positions restart; off: as plain text;
    # auto: on for record corpora (JSONL / Parquet / Arrow), off for text files and token .bin
    document_mask: str = "auto"
    eval_fraction: float = 0.02  # share of the corpus's windows held out for eval
    eval_data: str = ""  # eval sets beside the held-out split: a path, or "name=path,name=path"
    eval_every: int = 100  # steps between eval losses (0: only at the end)
    eval_batches: int = 4  # batches of `batch` sequences per eval
    seed: int = 0  # model init and data order
    log_every: int = 10  # steps between progress lines and JSONL train records
    metrics: str = ""  # path of the metrics JSONL (empty: none)
    tensorboard: str = ""  # directory for TensorBoard scalars of the same records (empty: none)
    profile: str = ""  # START:STOP: trace those steps, print compute vs collectives per device
    profile_dir: str = ""  # where the trace goes (empty: the --tensorboard dir, else ./profile)
    comm_warn: float = 0.3  # warn when exposed communication exceeds this share of the step
    peak_tflops: float = 0.0  # dense peak TFLOP/s of one device for MFU (0: the device table)
    straggler_threshold: float = 0.2  # name a process this fraction slower than the median
    checkpoint_dir: str = ""  # folder of the run's checkpoints (empty: no checkpoints)
    checkpoint_every: int = 100  # steps between checkpoints (0: only at the end or when stopped)
    keep_checkpoints: int = 3  # the newest this many checkpoints are kept, older ones deleted
    # What a diverging run does (a non-finite loss or gradient norm, or a loss spike): stop =
    # save nothing more and exit with status 3, naming the newest finite checkpoint; rollback =
    # restore that checkpoint, skip the data of the steps it undoes, go on; ignore = go on.
    # Under every policy a state whose loss, gradient norm or params are not finite is never saved.
    on_divergence: str = "stop"
    spike_threshold: float = 0.0  # a loss above this x the median of recent ones diverges (0: off)
    spike_window: int = 50  # how many recent finite losses (steps) the spike median is taken over
    max_rollbacks: int = 3  # rollbacks over the whole run (resumes included); then as `stop`
    rollback_lr_factor: float = 1.0  # each rollback multiplies the LR schedule by this, in (0, 1]
    resume: bool = False  # continue from the newest complete checkpoint in checkpoint_dir
    init_from_hf: str = ""  # start from a HF Llama or Mixtral folder (its config.json: the model)
    stop_after: int = 0  # end after this step with a checkpoint, as if preempted (0: don't)
    coordinator: str = ""  # HOST:PORT of process 0 in a multi-process job (spmd.launch sets it)
    num_processes: int = 0  # processes in the job (0: from spmd.launch, SLURM or Open MPI)
    process_id: int = -1  # this process's rank (-1: detect)
    dcn_mesh: str = ""  # ways of each mesh axis that cross hosts, e.g. "dp=2" (empty: data first)
    # every-step: all-reduce the gradients over the data axis every step; diloco: each way of
    # the data axis is a replica taking --sync-every local steps, then one all-reduce of the
    # pseudo-gradient (start-of-round params - local params) feeds the outer optimizer
    dcn_sync: str = "every-step"
    sync_every: int = 10  # diloco: inner steps per round (H); the all-reduce runs once per round
    outer_lr: float = 0.7  # diloco: outer optimizer (SGD, Nesterov momentum) learning rate
    outer_momentum: float = 0.9  # diloco: outer Nesterov momentum (0: plain SGD)
    diloco_axis: str = ""  # diloco on one host: the mesh axis of the replicas ("data")
    dry_run: bool = False  # compile the step, print memory and collectives, do not train


def flag_name(field: str) -> str:
    return "--" + field.replace("_", "-")


def _parse_bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r} is not a boolean (true/false)")


def _field_types(cls: type) -> dict[str, type]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


class _Parser(argparse.ArgumentParser):
    """argparse that reports mistakes in one line and suggests the nearest flag."""

    def error(self, message: str) -> typing.NoReturn:
        if message.startswith("unrecognized arguments:"):
            bad = message.split(":", 1)[1].split()[0]
            flags = [a for action in self._actions for a in action.option_strings]
            near = difflib.get_close_matches(bad.split("=")[0], flags, n=1)
            hint = f"; did you mean {near[0]}?" if near else "; see --help for the flags"
            message = f"unknown flag {bad}{hint}"
        print(f"error: {message}", file=sys.stderr)
        sys.exit(2)


@functools.cache
def field_comments(cls: type) -> dict[str, str]:
    """{field: its comment in the class source}: the comment on the field's line, else the
    comment lines just above it. The comments document the defaults, so --help shows them."""
    try:
        lines = inspect.getsource(cls).splitlines()
    except (OSError, TypeError):  # no source (a frozen or generated class): flags without help
        return {}
    comments, above = {}, []
    for line in (raw.strip() for raw in lines):
        if line.startswith("#"):
            above.append(line[1:].strip())
            continue
        field = re.match(r"(\w+)\s*:\s*\S", line)
        if field:
            trailing = line.split("  # ", 1)[1].strip() if "  # " in line else ""
            if trailing or above:
                comments[field.group(1)] = trailing or " ".join(above)
        above = []
    return comments


def build_parser(prog: str, sections: dict[str, type], description: str = "") -> _Parser:
    """A parser with --config plus one flag per field of every section (default: not given),
    each with its field's comment as help."""
    parser = _Parser(prog=prog, description=description, allow_abbrev=False)
    parser.add_argument("--config", help="TOML run config with [model] and [train] tables")
    for section, cls in sections.items():
        group = parser.add_argument_group(section)
        comments = {}  # a subclass's own comments over its bases' (e.g. MoEConfig's)
        for base in reversed([c for c in cls.__mro__ if dataclasses.is_dataclass(c)]):
            comments.update(field_comments(base))
        for name, kind in _field_types(cls).items():
            text = comments.get(name, "").replace("%", "%%")  # argparse formats help with %
            if kind is bool:  # `--dry-run` alone means true; `--dry-run false` also works
                group.add_argument(
                    flag_name(name),
                    dest=name,
                    type=_parse_bool,
                    nargs="?",
                    const=True,
                    default=argparse.SUPPRESS,
                    metavar="BOOL",
                    help=text,
                )
            else:
                group.add_argument(
                    flag_name(name),
                    dest=name,
                    type=kind,
                    default=argparse.SUPPRESS,
                    metavar=kind.__name__.upper(),
                    help=text,
                )
    return parser


def preset(name: str, section: str = "model") -> dict[str, Any]:
    """The `[section]` table of the shipped preset configs/<name>.toml."""
    available = sorted(
        p.name[: -len(".toml")] for p in _configs_dir().iterdir() if p.name.endswith(".toml")
    )
    if name not in available:
        raise UsageError(f"--model {name!r} is not a preset; choose one of {', '.join(available)}")
    return load_toml(_configs_dir().joinpath(f"{name}.toml")).get(section, {})


def _configs_dir() -> Any:
    return importlib.resources.files("configs")


def load_toml(path: Any) -> dict[str, Any]:
    """Read a TOML file; UsageError if it is missing or malformed."""
    try:
        with Path(str(path)).open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise UsageError(f"--config {path}: no such file") from None
    except tomllib.TOMLDecodeError as e:
        raise UsageError(f"--config {path}: not valid TOML ({e})") from None


def build(cls: type, values: dict[str, Any], source: str) -> Any:
    """Instantiate dataclass `cls` from `values`, naming unknown keys, bad types, gaps."""
    types = _field_types(cls)
    for key, value in values.items():
        if key not in types:
            near = difflib.get_close_matches(key, list(types), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise UsageError(f"{source}: unknown key {key!r}{hint}")
        kind = types[key]
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if not ok and not (kind is float and isinstance(value, int)):
            raise UsageError(f"{source}: {key} = {value!r} should be a {kind.__name__}")
    missing = [
        f.name
        for f in dataclasses.fields(cls)
        if f.name not in values and f.default is dataclasses.MISSING
    ]
    if missing:
        raise UsageError(f"{source}: missing {', '.join(missing)}")
    return cls(**{k: (float(v) if types[k] is float else v) for k, v in values.items()})


def resolve(
    argv: list[str] | None,
    sections: dict[str, type],
    prog: str,
    preset_field: str = "model",
    expand_train: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Resolve a run's config sections from defaults, preset, --config file and flags.

    The preset named by the `preset_field` of the "train" section fills the "model" section.
    `expand_train` may add train values implied by others (it sees only the values given).
    """
    parser = build_parser(prog, sections)
    flags = vars(parser.parse_args(argv))
    file_values = load_toml(flags.pop("config")) if flags.get("config") else {}
    flags.pop("config", None)
    for table in file_values:
        if table not in sections:
            raise UsageError(f"--config: unknown table [{table}]; expected {list(sections)}")
    train_cls = sections["train"]
    train_fields = _field_types(train_cls)
    train_values = {
        **file_values.get("train", {}),
        **{k: v for k, v in flags.items() if k in train_fields},
    }
    if expand_train is not None:
        train_values = expand_train(train_values)
    default_preset = next(
        f.default for f in dataclasses.fields(train_cls) if f.name == preset_field
    )
    preset_name = train_values.get(preset_field, default_preset)
    resolved = {"train": build(train_cls, train_values, "train config")}
    for section, cls in sections.items():
        if section == "train":
            continue
        fields = _field_types(cls)
        values = dict(preset(preset_name, section)) if section == "model" else {}
        values.update(file_values.get(section, {}))
        values.update({k: v for k, v in flags.items() if k in fields})
        resolved[section] = build(cls, values, f"{section} config (preset {preset_name!r})")
    return resolved


def as_dict(sections: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The resolved config as plain dicts, e.g. for the metrics JSONL and checkpoints."""
    return {name: dataclasses.asdict(value) for name, value in sections.items()}


def format_config(sections: dict[str, Any]) -> str:
    """The resolved config as TOML-like text, printed at the start of a run."""
    lines = []
    for name, values in as_dict(sections).items():
        lines.append(f"[{name}]")
        lines.extend(f"  {k} = {v!r}" for k, v in values.items())
    return "\n".join(lines)
