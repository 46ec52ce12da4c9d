"""Opening a file that a user, a plan or another file names, without letting the path hang
Piper or exhaust its memory.

A path is read only when it is a regular file outside the kernel's trees (/proc, /sys,
/dev: their files block, like /proc/kmsg, or never end) and at most `max_bytes` long. It is
checked with stat before it is opened, opened without blocking, and checked again on the
open descriptor, so a FIFO, a device or a directory swapped in between is refused as well.
Every refusal is one SpecError line naming the path, what is wrong and the fix.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from planner.specs import SpecError

MAX_TEXT_BYTES = 64 * 2**20  # a config, plan, cluster or allocation: far below this
KERNEL_TREES = (Path("/proc"), Path("/sys"), Path("/dev"))
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def _refuse_kind(p: Path, mode: int, what: str) -> SpecError:
    if stat.S_ISDIR(mode):
        return SpecError(f"{p}: is a directory; pass the {what} file inside it")
    return SpecError(
        f"{p}: is {_kind(mode)}, not a regular file; a {what} is read only from a file on disk"
    )


def _stat(p: Path, what: str) -> os.stat_result:
    try:
        return p.stat()
    except FileNotFoundError:
        raise SpecError(f"{p}: no such {what} file; check the path") from None
    except OSError as exc:
        raise SpecError(f"{p}: cannot read the {what} ({exc.strerror or exc})") from None


def open_input(path: str | Path, what: str, max_bytes: int | None = MAX_TEXT_BYTES) -> BinaryIO:
    """The file at `path` opened for binary reading, after the checks of the module doc;
    `what` names it in errors ("model config", "trace"). `max_bytes` bounds its size on disk
    (None: no bound, for a reader that caps what it reads itself)."""
    p = Path(path)
    st = _stat(p, what)
    if not stat.S_ISREG(st.st_mode):
        raise _refuse_kind(p, st.st_mode, what)
    real = p.resolve()
    if any(real.is_relative_to(tree) for tree in KERNEL_TREES):
        raise SpecError(
            f"{p}: a kernel file ({real}) is not a {what}: its reads block or never end; "
            "copy what you need into a file and pass that"
        )
    if max_bytes is not None and st.st_size > max_bytes:
        raise _too_large(p, what, max_bytes)
    flags = os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOCTTY", 0)
    try:
        fd = os.open(p, flags)
    except OSError as exc:
        raise SpecError(f"{p}: cannot read the {what} ({exc.strerror or exc})") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # replaced between the stat and the open
        os.close(fd)
        raise _refuse_kind(p, mode, what)
    return os.fdopen(fd, "rb")


def _too_large(p: Path, what: str, max_bytes: int) -> SpecError:
    return SpecError(
        f"{p}: larger than {max_bytes // 2**20} MiB, more than any {what} holds; "
        f"pass the {what} itself"
    )


def read_input_bytes(path: str | Path, what: str, max_bytes: int = MAX_TEXT_BYTES) -> bytes:
    """The bytes of the file at `path` (open_input's checks), never more than `max_bytes`:
    a file that grows past it while read is refused too."""
    p = Path(path)
    with open_input(p, what, max_bytes) as fh:
        try:
            data = fh.read(max_bytes + 1)
        except OSError as exc:
            raise SpecError(f"{p}: cannot read the {what} ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise _too_large(p, what, max_bytes)
    return data
