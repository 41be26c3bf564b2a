"""Hugging Face Hub names for the flags that take a Hugging Face folder or tokenizer.

`--init-from-hf`, `--from-hf` (spmd.generate, spmd.convert) and `--tokenizer` take a local
path or a Hub repo id such as `meta-llama/Llama-3.2-1B`. An existing local path always wins;
otherwise a value of the form `org/name` (huggingface_hub's own rule for repo ids, with
exactly one slash) names a Hub repo, which is looked up

1. in the local Hugging Face cache ($HF_HUB_CACHE, else $HF_HOME/hub, else
   ~/.cache/huggingface/hub), with no network call, where it holds the files spmd reads;
2. else downloaded into that cache (only the files spmd reads: config, safetensors,
   tokenizer and generation config; not the `original/` folders or other formats), unless
   HF_HUB_OFFLINE=1 forbids the network.

`--data` and `--eval-data` take a Hub dataset id the same way (spmd.io.hf_datasets), looked up
in the cache's `datasets--ORG--NAME` folder and downloaded (its data files only: Parquet, JSON
lines, Arrow) where it is not there.

Neither works: a UsageError naming the id and why (not cached while offline, no such repo,
gated, the network unreachable). A value that is neither an existing path nor a repo id is
returned as it is, for the reader to report as a missing file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from spmd.errors import UsageError
from spmd.sections import flag_name

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
MODEL_FILES = (
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    *TOKENIZER_FILES,
)
SUBFOLDERS = ["*/*"]  # e.g. Llama's original/ (consolidated .pth): never read here
# a dataset's files spmd reads (at any depth: the Hub's data/train-*.parquet)
DATASET_FILES = ("*.parquet", "*.arrow", "*.jsonl", "*.jsonl.gz", "*.json")
# config fields naming a Hugging Face folder
FOLDER_FIELDS = ("init_from_hf", "from_hf", "lora_base", "dpo_reference")
TOKENIZER_FIELDS = ("tokenizer",)  # config fields naming a tokenizer.json


def is_repo_id(value: str) -> bool:
    """Whether `value` names a Hub repo rather than a local path: not an existing path, and
    `org/name` as huggingface_hub validates repo ids."""
    if not value or value.count("/") != 1 or Path(value).exists():
        return False
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    try:
        validate_repo_id(value)
    except HFValidationError:
        return False
    return True


def model_folder(value: str, flag: str) -> str:
    """The local folder `value` names: itself, or the cached snapshot of Hub repo `value`."""
    if not is_repo_id(value):
        return value
    return str(snapshot(value, flag, MODEL_FILES, "config.json"))


def config_folder(value: str, flag: str) -> str:
    """The local folder `value` names for its config.json alone: itself, or the cached
    snapshot of Hub repo `value` (downloading config.json only, never the weights)."""
    if not is_repo_id(value):
        return value
    return str(snapshot(value, flag, ("config.json",), "config.json"))


def tokenizer_file(value: str, flag: str) -> str:
    """The tokenizer.json `value` names: the file itself, the tokenizer.json of a folder, or
    that of the cached snapshot of Hub repo `value` (downloading its tokenizer files only)."""
    if value and Path(value).is_dir():
        if not (Path(value) / "tokenizer.json").is_file():
            raise UsageError(
                f"{flag} {value} is a folder that holds no tokenizer.json; give a tokenizer.json "
                f"or the Hugging Face folder that holds one"
            )
        return str(Path(value) / "tokenizer.json")
    if not is_repo_id(value):
        return value
    return str(snapshot(value, flag, TOKENIZER_FILES, "tokenizer.json") / "tokenizer.json")


def dataset_folder(repo_id: str, flag: str) -> Path:
    """The local snapshot folder of Hub dataset `repo_id` (its data files): the cache's, else
    a download; UsageError naming the id where neither works."""
    return snapshot(repo_id, flag, DATASET_FILES, "", "dataset")


def resolve_names(sections: dict[str, Any]) -> dict[str, Any]:
    """`sections` (a command's resolved config) with each section's Hub ids resolved."""
    return {
        name: resolve_section(s) if dataclasses.is_dataclass(s) else s
        for name, s in sections.items()
    }


def resolve_section(section: Any) -> Any:
    """Config section `section` (a dataclass) with every Hub id in a folder or tokenizer field
    replaced by the local path it resolves to (downloading where needed)."""
    changes = {}
    for field in dataclasses.fields(section):
        value, flag = getattr(section, field.name), flag_name(field.name)
        if field.name in FOLDER_FIELDS and value:
            changes[field.name] = model_folder(value, flag)
        elif field.name in TOKENIZER_FIELDS and value:
            changes[field.name] = tokenizer_file(value, flag)
    return dataclasses.replace(section, **changes) if changes else section


def _holds(folder: Path, needed: str) -> bool:
    """Whether `folder` holds file `needed` ("": any file at all)."""
    if needed:
        return (folder / needed).is_file()
    return any(p.is_file() for p in folder.rglob("*"))


def snapshot(
    repo_id: str, flag: str, patterns: tuple[str, ...], needed: str, repo_type: str = "model"
) -> Path:
    """The local snapshot folder of Hub repo `repo_id` (a `repo_type` repo: model or dataset)
    holding `patterns`: the cache's, where it holds `needed` ("": any file), else a download;
    UsageError naming the id where neither works."""
    import huggingface_hub
    from huggingface_hub import constants, errors

    wanted = list(patterns)
    unwanted = list(SUBFOLDERS) if repo_type == "model" else None

    def download(local_files_only: bool) -> Path:
        return Path(
            huggingface_hub.snapshot_download(
                repo_id,
                repo_type=repo_type,
                local_files_only=local_files_only,
                allow_patterns=wanted,
                ignore_patterns=unwanted,
            )
        )

    try:
        cached = download(local_files_only=True)
        if _holds(cached, needed):
            return cached
    except errors.LocalEntryNotFoundError:  # not cached, or known to be incomplete
        pass
    kind = "repo" if repo_type == "model" else repo_type
    where = f"{flag} {repo_id}: no such local path, and the Hugging Face Hub {kind} {repo_id}"
    if constants.HF_HUB_OFFLINE:
        typed = "" if repo_type == "model" else f" --repo-type {repo_type}"
        raise UsageError(
            f"{where} is not (completely) in the local cache {constants.HF_HUB_CACHE} and "
            f"HF_HUB_OFFLINE forbids downloading it; download it first (hf download {repo_id}"
            f"{typed}) or unset HF_HUB_OFFLINE"
        )
    try:
        folder = download(local_files_only=False)
    except errors.GatedRepoError:
        raise UsageError(
            f"{where} is gated: accept its terms on huggingface.co and log in (hf auth login, "
            f"or HF_TOKEN)"
        ) from None
    except errors.RepositoryNotFoundError:
        raise UsageError(
            f"{where} does not exist on the Hub (or is private: log in with hf auth login, or "
            f"HF_TOKEN)"
        ) from None
    except Exception as e:  # network errors are httpx's, requests' or OSErrors depending on
        # the huggingface_hub version; each means the same here: not reachable
        cause = e.__cause__ or e  # huggingface_hub wraps the connection's error
        reason = (str(cause).strip().splitlines() or [""])[0]
        raise UsageError(
            f"{where} is not in the local cache {constants.HF_HUB_CACHE} and cannot be "
            f"downloaded ({type(cause).__name__}: {reason})"
        ) from None
    if not _holds(folder, needed):
        if needed:
            raise UsageError(f"{where} has no {needed}; is it a Hugging Face Transformers repo?")
        raise UsageError(f"{where} holds no data files ({', '.join(patterns)})")
    return folder
