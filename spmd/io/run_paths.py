"""The input paths a checkpoint records (its tokenizer, a LoRA run's base folder), made readable
from any current folder.

A run is started from some folder with paths as the user typed them (`--init-from-hf base
--tokenizer base/tokenizer.json`), and its checkpoints are read later by `spmd.convert`,
`spmd.generate` and `spmd.checkpoint verify`, often from another folder. So a checkpoint
records these paths absolute: the base and the tokenizer are inputs that many runs share and
that stay where they are (a model folder, the Hugging Face cache) while run folders get
renamed and moved, and the LoRA base is identified by its hash wherever it goes (spmd.
lora_base), so a moved one is named with `--lora-base`. `absolute` keeps symbolic links as
they are: a Hugging Face cache snapshot's files are links into its blobs, and the files a
tokenizer.json has beside it (its chat template, the generation config) are found beside
the link, not beside the blob.

A checkpoint of an older spmd recorded them as given, relative to the folder its training ran
in. That folder is found again from the checkpoint folder itself, whose saved
`checkpoint_dir` is the same kind of relative path (`runs/lora/checkpoints` read at
`/home/u/runs/lora/checkpoints` ran in `/home/u`), so such checkpoints still resolve after
the whole tree moved; failing that, the path is read from the current folder, as before.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from spmd import paths, sections

TOKENIZER_KEY = "tokenizer"  # the saved config's key of the checkpoint's tokenizer.json


def absolute(path: str) -> str:
    """`path` made absolute (symbolic links kept, not followed); a URL, a Hub id that is not a
    local path, or "" as given."""
    if not path or paths.is_url(path) or not Path(path).exists():
        return path
    return str(Path(paths.local(path)).absolute())


def training_folder(directory: str, run_config: dict[str, Any]) -> Path | None:
    """The folder the run of checkpoint folder `directory` was started in, where its relative
    paths point: `directory` less the relative --checkpoint-dir saved with it; None when that
    was absolute or does not end `directory`."""
    saved = sections.flat_values(run_config).get("checkpoint_dir", "")
    if not saved or paths.is_url(saved) or Path(saved).is_absolute() or paths.is_url(directory):
        return None
    here, tail = Path(directory).absolute().parts, Path(saved).parts
    if ".." in tail or len(tail) >= len(here) or here[-len(tail) :] != tail:
        return None
    return Path(*here[: -len(tail)])


def resolve(recorded: str, directory: str, run_config: dict[str, Any]) -> str:
    """Where path `recorded` in the config of checkpoint folder `directory` is now: itself when
    absolute (or a URL, or ""); a relative one of an older spmd in the folder training ran in
    when it exists there, else read from the current folder."""
    if not recorded or paths.is_url(recorded) or Path(recorded).is_absolute():
        return recorded
    started = training_folder(directory, run_config)
    if started is not None and (started / recorded).exists():
        return str(started / recorded)
    return recorded


def tokenizer_file(directory: str, run_config: dict[str, Any]) -> Path | None:
    """The tokenizer.json of checkpoint folder `directory`: the recorded one (relative to the
    checkpoint for a converted checkpoint's copy, absolute for a training run's), else an older
    run's `--tokenizer` (resolve); a folder stands for its tokenizer.json. None without one or
    when it is not there."""
    recorded = run_config.get(TOKENIZER_KEY)
    path: Path | None
    if isinstance(recorded, str) and recorded:
        path = Path(directory) / recorded  # an absolute one stays itself
    else:
        given = sections.flat_values(run_config).get("tokenizer") or ""
        path = Path(resolve(given, directory, run_config)) if given else None
    if path is not None and path.is_dir():
        path = path / "tokenizer.json"
    return path if path is not None and path.is_file() else None


def tokenizer_named(run_config: dict[str, Any]) -> str:
    """The tokenizer a checkpoint names, for people: the recorded path, else the run's
    `--tokenizer` as given ("" for none)."""
    recorded = run_config.get(TOKENIZER_KEY)
    if isinstance(recorded, str) and recorded:
        return recorded
    return str(sections.flat_values(run_config).get("tokenizer") or "")
