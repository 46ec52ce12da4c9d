"""A benchmark's printed report as results/NAME.md, headed by its command, machine and date.

    with recorded("results/ip_optimality.md", "IP optimality", enabled=not args.no_results):
        ...  # everything printed inside the block is shown and also written to the file

The file is written once, atomically (planner.outputs.files.write_atomic), after the block
finishes without an error; a failed run leaves the previous file as it was.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import platform
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from planner.outputs.files import write_atomic  # noqa: E402


class _Tee(io.TextIOBase):
    """Writes to the terminal and to a buffer."""

    def __init__(self, terminal, buffer: io.StringIO) -> None:
        self.terminal, self.buffer = terminal, buffer

    def write(self, text: str) -> int:
        self.terminal.write(text)
        return self.buffer.write(text)

    def flush(self) -> None:
        self.terminal.flush()


def command_line(argv: list[str] | None = None) -> str:
    """The command that ran this script, as typed from the repository root.

    Args:
        argv: the arguments after the script (default sys.argv[1:]).
    Returns:
        e.g. "OMP_NUM_THREADS=1 python3 benchmarks/ip_optimality.py --seed 0".
    """
    script = Path(sys.argv[0]).resolve()
    with contextlib.suppress(ValueError):
        script = script.relative_to(ROOT)
    threads = os.environ.get("OMP_NUM_THREADS")
    env = [f"OMP_NUM_THREADS={threads}"] if threads else []
    args = sys.argv[1:] if argv is None else argv
    return " ".join([*env, "python3", shlex.join([str(script), *args])])


def machine_line(load_at_start: float | None = None) -> str:
    """Date (UTC), OS, CPU count, load average and Python version of this machine."""
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    load = os.getloadavg()[0]
    start = f"{load_at_start:.1f} at the start, " if load_at_start is not None else ""
    return (
        f"{now}; {platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, "
        f"load average {start}{load:.1f} at the end; Python {platform.python_version()}"
    )


def render(title: str, command: str, context: str, body: str) -> str:
    """The markdown file: title, the command, the machine and date, then the printed report."""
    report = body.lstrip("\n").rstrip()
    return f"# {title}\n\n`{command}`\n\n{context}\n\n```text\n{report}\n```\n"


@contextlib.contextmanager
def recorded(path: str | Path, title: str, enabled: bool = True) -> Iterator[None]:
    """Tee stdout while the block runs, then write it to `path` under the command and machine.

    Args:
        path: the markdown file to write, e.g. results/ip_optimality.md (relative to the
            current directory).
        title: the file's heading.
        enabled: False prints only (nothing is written).
    """
    if not enabled:
        yield
        return
    load_at_start = os.getloadavg()[0]
    buffer = io.StringIO()
    with contextlib.redirect_stdout(_Tee(sys.stdout, buffer)):
        yield
    text = render(title, command_line(), machine_line(load_at_start), buffer.getvalue())
    write_atomic(path, text)
    print(f"wrote {path}")
