"""Ctrl-C that lands where Python cannot raise it.

A KeyboardInterrupt raised inside a finalizer or a weakref callback (matplotlib frees many
while it renders a plot, and more while the interpreter shuts down) cannot propagate: Python
reports it through `sys.unraisablehook` ("Exception ignored in ...", with a traceback) and
carries on as if nothing happened. `hold_interrupts()` replaces that report with a note that
a Ctrl-C is pending, and `raise_pending()` turns the note back into a KeyboardInterrupt at a
safe point (before any output is written), so such a Ctrl-C still stops the command cleanly.

The CLI installs the hook and leaves it in place (again only if something replaced it), so
a Ctrl-C landing in a finalizer after the command returned (interpreter shutdown) is not
printed either. Any other unraisable exception is passed on to the hook that was there
before.
"""

from __future__ import annotations

import sys
import threading

_pending = threading.Event()
_hook = None  # the hook hold_interrupts installed last


def hold_interrupts() -> None:
    """Install the hook (unless it is the current one) and forget any Ctrl-C held from an
    earlier call."""
    global _hook
    _pending.clear()
    if _hook is not None and sys.unraisablehook is _hook:
        return
    previous = sys.unraisablehook

    def hook(unraisable) -> None:  # type: ignore[no-untyped-def]
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            _pending.set()
            return
        previous(unraisable)

    sys.unraisablehook = _hook = hook


def raise_pending() -> None:
    """Raise the KeyboardInterrupt that a finalizer swallowed, if one did."""
    if _pending.is_set():
        _pending.clear()
        raise KeyboardInterrupt
