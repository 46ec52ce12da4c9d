"""What the `piper` commands show on a terminal: rich progress bars and rich tables.

`progress(description)` draws a bar on stderr while a long step runs, only when stderr is a
terminal (pipes, files and tests see nothing); `print_table(title, columns, rows)` prints a
table on stdout, at a fixed wide width when stdout is not a terminal so piped output does
not wrap.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from numbers import Real
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
