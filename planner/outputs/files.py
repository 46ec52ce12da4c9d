"""Atomic output: write a set of files so an interrupted run leaves the old set or the new one."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write one file through a temporary sibling and os.replace (atomic on POSIX)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    mode = "wb" if isinstance(data, bytes) else "w"
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, mode) as fh:
            fh.write(data)
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_files(out_dir: str | Path, files: dict[str, str | bytes]) -> list[Path]:
    """Write every file of a result set atomically; all contents must be ready beforehand.

    Contents are rendered before this is called, so a failure while computing never leaves
    a half-written directory; each file is replaced atomically.
    """
    out = Path(out_dir)
    written = []
    for name in sorted(files):
        write_atomic(out / name, files[name])
        written.append(out / name)
    return written
