"""Local paths and URLs alike: the checkpoint folder, the metrics file, the run folder and the
data may be `gs://`, `s3://` or `file://` URLs as well as local paths.

Two libraries, one for each kind of user:

- checkpoints go through `etils.epath`, the path type orbax itself uses (gs://, s3://, az://
  through fsspec; orbax's arrays through tensorstore, which writes buckets natively);
- files spmd writes or reads whole (the metrics JSONL, config.toml, a data file fetched into
  the local cache) go through fsspec, which epath's bucket backend is built on and which also
  knows `memory://` (the tests' stand-in for a bucket) and any filesystem a package registers.

epath knows no `file://`, so a `file://` URL is turned into its local path first: every local
path operation then applies. A bucket URL needs fsspec's package for it (gcsfs for gs://,
s3fs for s3://) and the cloud's credentials, as orbax does.

The bottom of spmd's package order, beside spmd.log: every package may open files through
here, and this module imports nothing of spmd.
"""

from __future__ import annotations

from pathlib import Path
from typing import IO, Any

FILE_SCHEME = "file://"


def is_url(path: str) -> bool:
    """Whether `path` is a URL other than file:// (a bucket, an fsspec filesystem)."""
    return "://" in str(path) and not str(path).startswith(FILE_SCHEME)


def local(path: str) -> str:
    """`path` with a file:// scheme removed (file:///tmp/x -> /tmp/x); other paths as given."""
    path = str(path)
    return path[len(FILE_SCHEME) :] if path.startswith(FILE_SCHEME) else path


def epath(path: str) -> Any:
    """An etils.epath.Path of a local path or URL (what orbax's CheckpointManager takes): a
    local path is made absolute, as orbax needs."""
    from etils import epath as ep

    path = local(path)
    return ep.Path(path) if is_url(path) else ep.Path(Path(path).absolute())


def open_file(path: str, mode: str = "r") -> IO[Any]:
    """Open a local file (its folder made for writing) or a URL through fsspec; text modes
    read and write UTF-8."""
    path = local(path)
    if not is_url(path):
        if mode[0] in "wa":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        encoding = None if "b" in mode else "utf-8"
        return Path(path).open(mode, encoding=encoding)
    import fsspec

    return fsspec.open(path, mode, encoding=None if "b" in mode else "utf-8").open()


def write_text(path: str, text: str) -> None:
    with open_file(path, "w") as f:
        f.write(text)


def read_text(path: str) -> str:
    with open_file(path, "r") as f:
        return f.read()


def exists(path: str) -> bool:
    path = local(path)
    if not is_url(path):
        return Path(path).exists()
    import fsspec

    fs, inner = fsspec.core.url_to_fs(path)
    return fs.exists(inner)
