"""Hugging Face dataset layouts as record shards: `save_to_disk` folders, a folder's split,
and Hub dataset ids (`--data ORG/NAME[:SPLIT]`).

- A `datasets` `save_to_disk` folder of one split holds `state.json` (its `_data_files`: the
  Arrow stream files `data-00000-of-0000N.arrow`, in order) and `dataset_info.json`; those
  files are the shards, read by pyarrow as any Arrow file (spmd.io.corpora). A DatasetDict
  folder holds `dataset_dict.json` (its `splits`) and one such folder per split: `DIR` reads
  its `train` split, `DIR:SPLIT` (or `DIR/SPLIT`) another.
- `DIR:SPLIT` of any other folder, such as a Hub snapshot, is the files whose path names the
  split, as the Hub's conventions lay data files out: a path segment or file name word that
  is the split or a synonym of it (train: train, training; validation: validation, valid,
  val, dev; test: test, testing, eval, evaluation), as in `data/train-00000-of-00002.parquet`,
  `test.jsonl` or `default/validation/0000.parquet`. Where no file names any split, they all
  are the train split (the Hub's rule too).
- A Hub dataset id (`org/name`, not a local path) is the snapshot spmd.io.hub finds in the
  local Hugging Face cache (`datasets--org--name`) or downloads when online; offline and not
  cached it is a UsageError in one line. `:SPLIT` picks the split (default train).

Not read: a dataset's named configurations (subsets) as such; give the folder of one, or its
files. A `save_to_disk` folder's files are read whole: `datasets` flattens a selection or
shuffle into them when it saves.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from spmd.errors import UsageError

SPLIT = re.compile(r"^(?P<path>.+):(?P<split>[A-Za-z_][\w.-]*)$")
SYNONYMS = {
    "train": ("train", "training"),
    "validation": ("validation", "valid", "val", "dev"),
    "test": ("test", "testing", "eval", "evaluation"),
}
DEFAULT_SPLIT = "train"
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".parquet", ".arrow", ".txt", ".bin", ".gz")
METADATA = ("state.json", "dataset_info.json", "dataset_dict.json", "dataset_infos.json")


def local(data: str, flag: str) -> str:
    """`data` with a Hub dataset id (`org/name[:split]`, not a local path) replaced by its local
    snapshot and split, `SNAPSHOT:SPLIT`; anything else as it is."""
    if not data or Path(data).exists():
        return data
    match = SPLIT.match(data)
    repo, split = (match["path"], match["split"]) if match else (data, DEFAULT_SPLIT)
    from spmd.io import hub

    if repo.endswith(DATA_SUFFIXES) or Path(repo).exists() or not hub.is_repo_id(repo):
        return data
    return f"{hub.dataset_folder(repo, flag)}:{split}"


def split_files(data: str, suffixes: tuple[str, ...]) -> list[Path] | None:
    """The record shards a Hugging Face layout `data` names (a save_to_disk folder, a
    DatasetDict folder, `FOLDER:SPLIT`), in order; None when `data` is none of these (a plain
    folder, file or glob: spmd.io.corpora reads it). `suffixes`: the record files' endings."""
    folder, split = Path(data), None
    if not folder.is_dir():
        match = SPLIT.match(data)
        if match is None or not Path(match["path"]).is_dir():
            return None
        folder, split = Path(match["path"]), match["split"]
    if (folder / "state.json").is_file():
        if split is not None:
            raise UsageError(
                f"--data {data}: {folder} is a save_to_disk folder of one split; give it "
                f"without :{split}"
            )
        return saved_files(folder)
    if (folder / "dataset_dict.json").is_file():
        splits = _json(folder / "dataset_dict.json").get("splits") or []
        chosen = split or DEFAULT_SPLIT
        if chosen not in splits:
            raise UsageError(
                f"--data {data}: the DatasetDict folder {folder} has the splits "
                f"{', '.join(map(str, splits)) or 'none'}, not {chosen}; give FOLDER:SPLIT"
            )
        return saved_files(folder / chosen)
    if split is None:
        return None
    return named_split(folder, split, suffixes, data)


def saved_files(folder: Path) -> list[Path]:
    """The Arrow files of save_to_disk folder `folder`, as its state.json lists them."""
    state = _json(folder / "state.json")
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not entries:
        raise UsageError(f"--data {folder}: its state.json lists no _data_files")
    files = [folder / str(entry.get("filename", "")) for entry in entries]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise UsageError(f"--data {folder}: its state.json lists {missing[0]}, which is not there")
    return files


def named_split(folder: Path, split: str, suffixes: tuple[str, ...], data: str) -> list[Path]:
    """The record files under `folder` whose path names `split` (or all of them where none
    names a split and `split` is train), sorted."""
    files = sorted(
        p
        for p in folder.rglob("*")
        if p.is_file() and p.name.endswith(suffixes) and p.name not in METADATA
    )
    words = {f: set(re.split(r"[^a-z0-9]+", str(f.relative_to(folder)).lower())) for f in files}
    known = {name for names in SYNONYMS.values() for name in names} | {split.lower()}
    if not any(words[f] & known for f in files):  # no split named: all of it is train
        if split == DEFAULT_SPLIT and files:
            return files
        raise UsageError(
            f"--data {data}: {folder} holds {len(files)} data files naming no split (all of "
            f"them are the train split); give :train"
        )
    wanted = set(SYNONYMS.get(split.lower(), (split.lower(),)))
    picked = [f for f in files if words[f] & wanted]
    if not picked:
        found = [s for s, names in SYNONYMS.items() if any(words[f] & set(names) for f in files)]
        raise UsageError(
            f"--data {data}: no data file of {folder} names the split {split}; it has "
            f"{', '.join(found) or 'other splits'}"
        )
    return picked


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UsageError(f"--data {path.parent}: cannot read {path.name} ({e})") from None
    return value if isinstance(value, dict) else {}
