"""What the `piper` commands show on a terminal: rich progress bars and rich tables.

`progress(description)` draws a bar on stderr while a long step runs, only when stderr is a
terminal (pipes, files and tests see nothing); `print_table(title, columns, rows)` prints a
table on stdout, at a fixed wide width when stdout is not a terminal so piped output does
not wrap.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from numbers import Real
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from planner.numbers import EMPTY, number

PIPE_WIDTH = 200  # columns of a table printed to a pipe or a file
Update = Callable[[int, int | None], None]  # (done, total or None to keep it)


def console(stderr: bool = False) -> Console:
    """A rich Console on stdout (or stderr) as it is now; plain text when not a terminal."""
    file = sys.stderr if stderr else sys.stdout
    terminal = file.isatty()
    return Console(file=file, width=None if terminal else PIPE_WIDTH, highlight=False,
                   force_terminal=terminal, no_color=not terminal)  # fmt: skip


@contextmanager
def progress(description: str, total: int | None = None) -> Iterator[Update]:
    """A progress bar on stderr for the block, on a terminal only; yields update(done, total).

    The bar disappears when the block ends (the command's summary follows it).
    """
    if not sys.stderr.isatty():
        yield lambda done, total=None: None
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console(stderr=True), transient=True) as bar:
        task = bar.add_task(description, total=total)

        def update(done: int, new_total: int | None = None) -> None:
            if new_total is not None:
                bar.update(task, total=new_total)
            bar.update(task, completed=done)

        yield update


class Phases:
    """The phases of one command, back to back: `start(name, label)` ends the phase running
    and starts the next; `times()` is every phase's wall time (s), the first from the
    process's own start (`process_age_s`: interpreter, imports, arguments), so the phases sum
    to the command's wall time so far. On a terminal one bar on stderr shows the phase's
    label (and its progress when `update(done, total)` is called); elsewhere nothing."""

    def __init__(self, bar: Progress | None) -> None:
        self._bar = bar
        self._task = bar.add_task("", total=None) if bar is not None else None
        self._times = {"startup": process_age_s()}
        self._name, self._since = "", time.perf_counter()

    def start(self, name: str, label: str, total: int | None = None) -> None:
        now = time.perf_counter()
        if self._name:
            self._times[self._name] = self._times.get(self._name, 0.0) + now - self._since
        self._name, self._since = name, now
        self._show(label, total)

    def label(self, text: str) -> None:
        """Show `text` on the bar without starting a new phase."""
        self._show(text, None)

    def _show(self, text: str, total: int | None) -> None:
        """A fresh task (rich cannot take a total back to None): the text, no progress yet."""
        if self._bar is not None and self._task is not None:
            self._bar.remove_task(self._task)
            self._task = self._bar.add_task(text, total=total)

    def update(self, done: int, total: int | None = None) -> None:
        if self._bar is not None and self._task is not None:
            if total is not None:
                self._bar.update(self._task, total=total)
            self._bar.update(self._task, completed=done)

    def times(self) -> dict[str, float]:
        """Seconds per phase, the one running counted up to now."""
        out = dict(self._times)
        if self._name:
            out[self._name] = out.get(self._name, 0.0) + time.perf_counter() - self._since
        return out


@contextmanager
def phases() -> Iterator[Phases]:
    """A Phases clock for the block, with its bar on stderr when stderr is a terminal (the
    bar disappears when the block ends)."""
    if not sys.stderr.isatty():
        yield Phases(None)
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               MofNCompleteColumn(), TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console(stderr=True), transient=True) as bar:
        yield Phases(bar)


def process_age_s() -> float:
    """Wall seconds since this process started (Linux /proc; 0.0 where it cannot be read):
    what a command spent before its own code ran."""
    try:
        stat = Path("/proc/self/stat").read_text()
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, after "(comm)"
    return max(0.0, uptime_s - ticks / os.sysconf("SC_CLK_TCK"))  # both since boot, 10 ms


def print_table(
    title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]], stderr: bool = False
) -> None:
    """A rich table under an optional title line: one header per column, numbers
    right-aligned; numeric cells written by planner.numbers.number, text as given."""
    out = console(stderr)
    if title:
        out.print(title)
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    numeric = [all(_is_number(r[i]) for r in rows) for i in range(len(columns))]
    for name, right in zip(columns, numeric, strict=True):
        table.add_column(name, justify="right" if right and rows else "left")
    for row in rows:
        table.add_row(*(_cell(v) for v in row))
    out.print(table)


def _cell(value: Any) -> str:
    """A number as people read it (separators, no exponent for counts), else str()."""
    if isinstance(value, Real) and not isinstance(value, bool):
        return number(value)
    return str(value)


def _is_number(value: Any) -> bool:
    """An int, a float, or text that reads as one (a formatted number, a percentage, a
    ratio such as 1.25x)."""
    if isinstance(value, Real) or value == EMPTY:
        return True
    try:
        float(str(value).replace(",", "").removesuffix("%").removesuffix("x"))
    except ValueError:
        return False
    return True
