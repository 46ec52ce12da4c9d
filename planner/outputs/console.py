"""What the `piper` commands show: rich progress bars, phase lines and rich tables.

`progress(description)` draws a bar on stderr while a long step runs, only when stderr is a
terminal; `phases()` times a command's phases and shows them: a bar on a terminal, one line
per phase and a heartbeat when stderr is a log; `print_table(title, columns, rows)` prints a
table on stdout, wrapped to fit the terminal or, on a pipe or a file, TABLE_WIDTH columns.
"""

from __future__ import annotations

import logging
import os
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from numbers import Real
from pathlib import Path
from typing import Any, TextIO

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
from rich.text import Text

from planner.numbers import EMPTY, number

TABLE_WIDTH = 100  # the widest a table prints: on a pipe or a file, and on a wider terminal
Update = Callable[[int, int | None], None]  # (done, total or None to keep it)


def console(stderr: bool = False) -> Console:
    """A rich Console on stdout (or stderr) as it is now; plain text when not a terminal."""
    file = sys.stderr if stderr else sys.stdout
    terminal = file.isatty()
    return Console(file=file, width=None if terminal else TABLE_WIDTH, highlight=False,
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


HEARTBEAT_S = 5.0  # off a terminal, a phase running longer says so this often
log = logging.getLogger("planner.progress")


class Phases:
    """The phases of one command, back to back: `start(name, label)` ends the phase running
    and starts the next; `times()` is every phase's wall time (s), the first from the
    process's own start (`process_age_s`: interpreter, imports, arguments), so the phases sum
    to the command's wall time so far.

    On a terminal one bar on stderr shows the phase's label and its done/total counter (from
    `update(done, total)`). With `stream` (stderr when it is a log), each phase is one line,
    `PREFIX: LABEL (at T s)`, and a phase running longer than `heartbeat_s` adds a line
    `PREFIX: LABEL: still running, DONE/TOTAL, T s` every `heartbeat_s`. The `silent` phases
    (reading and checking the inputs) print no line, and a `lazy` phase (the search, which
    checks the layout flags first) prints its line at its first update or heartbeat, so an
    input refused there is the command's one line on stderr. Every update is also
    a logging INFO line of "planner.progress" (shown by `piper -v`)."""

    def __init__(
        self,
        bar: Progress | None,
        stream: TextIO | None = None,
        prefix: str = "piper",
        heartbeat_s: float = HEARTBEAT_S,
        silent: tuple[str, ...] = ("inputs",),
        lazy: tuple[str, ...] = ("search",),
    ) -> None:
        self._bar = bar
        self._silent, self._lazy, self._announced = silent, lazy, False
        self._task = bar.add_task("", total=None) if bar is not None else None
        self._times = {"startup": process_age_s()}
        self._name, self._since = "", time.perf_counter()
        self._stream, self._prefix, self._heartbeat_s = stream, prefix, heartbeat_s
        self._text, self._done, self._total = "", 0, None
        self._shown_at = self._since
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None
        if stream is not None:
            self._beat = threading.Thread(target=self._heartbeat, daemon=True)
            self._beat.start()

    def start(self, name: str, label: str, total: int | None = None) -> None:
        now = time.perf_counter()
        if self._name:
            self._times[self._name] = self._times.get(self._name, 0.0) + now - self._since
        self._name, self._since = name, now
        self._show(label, total, lazy=name in self._lazy)

    def label(self, text: str) -> None:
        """Show `text` on the bar (or as a line) without starting a new phase."""
        self._show(text, None)

    def _show(self, text: str, total: int | None, lazy: bool = False) -> None:
        """A fresh task (rich cannot take a total back to None): the text, no progress yet."""
        with self._lock:
            self._text, self._done, self._total = text, 0, total
            self._shown_at = time.perf_counter()
        self._announced = self._name in self._silent
        if not self._announced and not lazy:
            self._announce()
        if self._bar is not None and self._task is not None:
            self._bar.remove_task(self._task)
            self._task = self._bar.add_task(text, total=total)

    def update(self, done: int, total: int | None = None) -> None:
        with self._lock:
            self._done, self._total = done, total if total is not None else self._total
        if not self._announced:
            self._announce()
        log.info("%s: %d/%s", self._text, done, self._total if self._total is not None else "?")
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

    def close(self) -> None:
        """Stop the heartbeat (idempotent)."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()

    def _announce(self) -> None:
        """The phase's line, once: its label and when it started."""
        self._announced = True
        self._line(f"{self._text} (at {self._elapsed_s() - self._running_s():.1f} s)")

    def _running_s(self) -> float:
        return time.perf_counter() - self._shown_at

    def _elapsed_s(self) -> float:
        return sum(self.times().values())

    def _line(self, text: str) -> None:
        if self._stream is not None:
            with self._lock:
                self._stream.write(f"{self._prefix}: {text}\n")
                self._stream.flush()

    def _heartbeat(self) -> None:
        """Every heartbeat_s, a line for a phase that has run at least that long."""
        while not self._stop.wait(self._heartbeat_s):
            with self._lock:
                text, done, total = self._text, self._done, self._total
                running_s = time.perf_counter() - self._shown_at
            if not text or running_s < self._heartbeat_s or self._name in self._silent:
                continue
            if not self._announced:
                self._announce()
            count = f", {done}/{total}" if total else ""
            self._line(f"{text}: still running{count}, {running_s:.0f} s")


@contextmanager
def phases(prefix: str = "piper", heartbeat_s: float = HEARTBEAT_S) -> Iterator[Phases]:
    """A Phases clock for the block: a bar on stderr when stderr is a terminal (it disappears
    when the block ends), else a line per phase and a heartbeat on stderr."""
    if not sys.stderr.isatty():
        clock = Phases(None, sys.stderr, prefix, heartbeat_s)
        try:
            yield clock
        finally:
            clock.close()
        return
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(),
               _Count(), TimeElapsedColumn())  # fmt: skip
    with Progress(*columns, console=console(stderr=True), transient=True) as bar:
        yield Phases(bar)


class _Count(MofNCompleteColumn):
    """done/total once the total is known; nothing before (not "0/?")."""

    def render(self, task):  # type: ignore[no-untyped-def]
        return super().render(task) if task.total is not None else Text("")


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
    right-aligned; numeric cells written by planner.numbers.number, text as given. It fits
    min(terminal, TABLE_WIDTH) columns: text cells wrap at spaces; where the columns cannot
    all keep their longest word (and MIN_TEXT_CELL characters of text) side by side, each row
    prints as a block of `column: value` lines instead."""
    out = console(stderr)
    width = min(out.width, TABLE_WIDTH)
    if title:
        out.print(title)
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [all(_is_number(r[i]) for r in rows) for i in range(len(columns))]
    least = _least_widths(columns, cells, numeric)
    if sum(least) + GAP * (len(columns) - 1) > width:
        for line in _records(columns, cells, width):
            out.print(line, highlight=False, overflow="ignore", crop=False, soft_wrap=True)
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    widths = _widths(columns, cells, least, width - GAP * (len(columns) - 1))
    for name, right, w in zip(columns, numeric, widths, strict=True):
        table.add_column(name, justify="right" if right and rows else "left", width=w)
    for row in cells:
        table.add_row(*row)
    out.print(table, width=width)


def _widths(
    columns: Sequence[str], cells: Sequence[Sequence[str]], least: list[int], room: int
) -> list[int]:
    """Column widths within `room`: each its widest cell (header included) when all fit,
    else its least width plus a share of the rest in proportion to what it lacks."""
    full = [
        max(len(c) for c in [name, *(row[i] for row in cells)]) for i, name in enumerate(columns)
    ]
    if sum(full) <= room:
        return full
    spare, lack = room - sum(least), [f - lo for f, lo in zip(full, least, strict=True)]
    out = [lo + spare * short // sum(lack) for lo, short in zip(least, lack, strict=True)]
    return out


MIN_TEXT_CELL = 14  # narrower text columns read as one word per line
GAP = 3  # characters between two columns: padding, the box's blank divider, padding


def _least_widths(
    columns: Sequence[str], cells: Sequence[Sequence[str]], numeric: list[bool]
) -> list[int]:
    """Per column, the width that breaks no word: numbers whole, text its longest word and
    at least MIN_TEXT_CELL (or its longest cell when shorter)."""
    out = []
    for i, name in enumerate(columns):
        texts = [row[i] for row in cells]
        longest_word = max(len(w) for t in [name, *texts] for w in [*t.split(), ""])
        if numeric[i]:
            out.append(max([longest_word, *(len(t) for t in texts)]))
        else:
            out.append(max(longest_word, min(MIN_TEXT_CELL, max(map(len, texts), default=0))))
    return out


def _records(columns: Sequence[str], cells: Sequence[Sequence[str]], width: int) -> list[str]:
    """Each row as its first cell, then `  column: value` for its other non-empty cells,
    wrapped to `width`."""
    lines = []
    for row in cells:
        lines.append(row[0])
        for name, value in zip(columns[1:], row[1:], strict=True):
            if not value:
                continue
            lines += textwrap.wrap(f"{name}: {value}", width, initial_indent="  ",
                                   subsequent_indent="    ", break_long_words=False,
                                   break_on_hyphens=False)  # fmt: skip
    return lines


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
