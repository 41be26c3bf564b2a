"""Data given as a URL (`--data gs://bucket/corpus.txt`, `s3://...`, any fsspec filesystem):
copied once into the local data cache, then read like a local file.

Tokens are memory-mapped and corpora tokenized into the cache (spmd.io.tokens, spmd.io.shards),
both of which need local files; a copy is what a bucket allows. The copy of a URL lives in
`<data cache>/remote/<hash of the URL>/<its name>` and is reused while the remote size is the
same; a file is copied to a temporary name and renamed, so a killed copy is never taken for a
whole one. A folder URL is copied file by file (its layout kept). `file://` URLs are local
paths (spmd.paths) and are not copied.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING

from spmd import paths
from spmd.errors import UsageError
from spmd.log import say

if TYPE_CHECKING:  # fsspec loads on the first URL only (local_copy)
    import fsspec

REMOTE = "remote"


def local_copy(path: str, cache_dir: Path, flag: str = "--data") -> str:
    """The local path to read `path` from: `path` itself when it is local (file:// removed),
    else its copy in `cache_dir` (made or refreshed now)."""
    path = paths.local(path)
    if not paths.is_url(path):
        return path
    import fsspec

    try:
        fs, inner = fsspec.core.url_to_fs(path)
        if not fs.exists(inner):
            raise UsageError(f"{flag} {path} does not exist")
        files = [inner] if fs.isfile(inner) else sorted(fs.find(inner))
    except (ImportError, ValueError) as e:  # no fsspec filesystem for the scheme (gcsfs, s3fs)
        raise UsageError(f"{flag} {path}: cannot read the URL ({e})") from None
    target = cache_dir / REMOTE / hashlib.sha256(path.encode()).hexdigest()[:20]
    base = inner.rstrip("/")
    name = base.rsplit("/", 1)[-1]
    for remote in files:
        relative = name if remote == base else f"{name}/{remote[len(base) + 1 :]}"
        _copy(fs, remote, target / relative)
    say(f"{flag} {path}: {len(files)} file(s) copied to {target / name}")
    return str(target / name)


def _copy(fs: fsspec.AbstractFileSystem, remote: str, local: Path) -> None:
    """Copy one remote file to `local` unless a copy of the same size is there."""
    size = fs.size(remote)
    if local.is_file() and local.stat().st_size == size:
        return
    local.parent.mkdir(parents=True, exist_ok=True)
    partial = local.with_name(f"{local.name}.partial-{os.getpid()}")
    fs.get_file(remote, str(partial))
    os.replace(partial, local)
