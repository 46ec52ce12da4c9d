"""Ctrl-C that lands where Python cannot raise it.

A KeyboardInterrupt raised inside a finalizer or a weakref callback (matplotlib frees many
while it renders a plot) cannot propagate: Python reports it through `sys.unraisablehook`
("Exception ignored in ...", with a traceback) and carries on as if nothing happened.
`held_interrupts()` replaces that report with a note that a Ctrl-C is pending, and
`raise_pending()` turns the note back into a KeyboardInterrupt at a safe point (before any
output is written), so such a Ctrl-C still stops the command cleanly.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

_pending = threading.Event()


def _hook(previous):  # type: ignore[no-untyped-def]
    def hook(unraisable) -> None:  # type: ignore[no-untyped-def]
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _pending.set()
            return
        previous(unraisable)

    return hook


@contextlib.contextmanager
def held_interrupts() -> Iterator[None]:
    """Within the block, a Ctrl-C swallowed by a finalizer is remembered, not printed."""
    previous = sys.unraisablehook
    sys.unraisablehook = _hook(previous)
    try:
        yield
    finally:
        sys.unraisablehook = previous
        _pending.clear()


def raise_pending() -> None:
    """Raise the KeyboardInterrupt that a finalizer swallowed, if one did."""
    if _pending.is_set():
        _pending.clear()
        raise KeyboardInterrupt
