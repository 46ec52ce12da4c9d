"""Atomic output: write a set of files so an interrupted run leaves the old set or the new one.

`write_files(out_dir, files)` takes every file's content rendered beforehand and:
- when `out_dir` does not exist yet, writes the set into a hidden sibling directory and renames
  it to `out_dir` in one step, so a run killed at any moment leaves no `out_dir` at all;
- when `out_dir` exists (earlier results, other files), writes every file to a temporary
  sibling first, then renames them over the old ones in a tight loop.
Ctrl-C (SIGINT) and SIGTERM arriving during the write are held until the set is complete and
then delivered as usual, so an interrupted command never leaves a mixed set. New files get
the usual permissions (0666 minus the umask), not the 0600 of a bare temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

from planner.outputs.interrupts import raise_pending
from planner.specs import SpecError

_DEFERRED = (signal.SIGINT, signal.SIGTERM)


def _umask() -> int:
    """The process umask, read without changing it where /proc allows (thread-safe)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM until the block ends, then deliver the first one that arrived.

    Only the main thread can install handlers; elsewhere the block runs unprotected.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []

    def hold(signum: int, _frame: object) -> None:
        caught.append(signum)

    previous = {s: signal.signal(s, hold) for s in _DEFERRED}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)
        if caught:
            os.kill(os.getpid(), caught[0])  # the restored handler acts (SIGINT: KeyboardInterrupt)


def _as_target(exc: OSError, path: Path) -> OSError:
    """The same error naming the file the user asked for, not its temporary sibling."""
    return type(exc)(exc.errno, exc.strerror, str(path))


def _write_tmp(path: Path, data: str | bytes, mode: int) -> str:
    """Write `data` to a new temporary sibling of `path`; returns the temporary's path. An
    OSError names `path` (or the folder that could not be made)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _as_target(exc, path.parent) from None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _as_target(exc, path) from None
    try:
        with os.fdopen(fd, "wb" if isinstance(data, bytes) else "w") as fh:
            fh.write(data)
        os.chmod(tmp, mode)
    except BaseException as exc:
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise _as_target(exc, path) from None
        raise
    return tmp


def write_atomic(path: str | Path, data: str | bytes) -> None:
    """Write one file through a temporary sibling and os.replace (atomic on POSIX)."""
    p = Path(path)
    raise_pending()  # a Ctrl-C swallowed earlier stops the command before it writes
    _refuse_folder(p)
    with signals_deferred():
        tmp = _write_tmp(p, data, 0o666 & ~_umask())
        try:
            os.replace(tmp, p)
        except BaseException as exc:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(exc, OSError):
                raise _as_target(exc, p) from None
            raise


def _write_new_dir(out: Path, files: dict[str, str | bytes], umask: int) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    stage = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".tmp", dir=out.parent))
    try:
        for name in sorted(files):
            os.replace(_write_tmp(stage / name, files[name], 0o666 & ~umask), stage / name)
        os.chmod(stage, 0o777 & ~umask)
        os.rename(stage, out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise


def _refuse_folder(target: Path) -> None:
    """A folder where a file is to be written: one line, before anything is written."""
    if target.is_dir():
        raise SpecError(
            f"{target}: a folder is in the way of the file this command writes; move it or "
            "choose another output path"
        )


def _replace_in_place(out: Path, files: dict[str, str | bytes], umask: int) -> None:
    """Every file written beside its target first, then each moved over it: a failure before
    the moves leaves the folder as it was."""
    for name in sorted(files):
        _refuse_folder(out / name)
    tmps: dict[str, str] = {}
    try:
        for name in sorted(files):
            tmps[name] = _write_tmp(out / name, files[name], 0o666 & ~umask)
        for name in sorted(files):
            os.replace(tmps[name], out / name)
            del tmps[name]
    finally:
        for tmp in tmps.values():
            Path(tmp).unlink(missing_ok=True)


def write_files(out_dir: str | Path, files: dict[str, str | bytes]) -> list[Path]:
    """Write every file of a result set atomically; all contents must be ready beforehand.

    Args:
        out_dir: the result directory (created when missing, with its parents).
        files: file name (relative to out_dir) -> content (str as text, bytes as is).
    Returns:
        The written paths, sorted by name.
    """
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, "exists and is not a directory", str(out))
    umask = _umask()
    raise_pending()  # a Ctrl-C swallowed earlier stops the command before it writes
    try:
        _write_set(out, files, umask)
    except OSError as exc:  # name the output directory, not a hidden temporary
        if exc.filename is None or ".tmp" not in str(exc.filename):
            raise
        raise type(exc)(exc.errno, exc.strerror, str(out)) from None
    return [out / name for name in sorted(files)]


def _write_set(out: Path, files: dict[str, str | bytes], umask: int) -> None:
    with signals_deferred():
        if out.is_dir():
            _replace_in_place(out, files, umask)
        else:
            try:
                _write_new_dir(out, files, umask)
            except OSError as exc:
                if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or not out.is_dir():
                    raise
                _replace_in_place(out, files, umask)  # created meanwhile: merge into it
