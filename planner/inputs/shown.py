"""Values from a user's file, cut short for an error line.

An error line names the value it refuses, but a value can be a 1 MB string or a list that an
alias-built YAML expands to millions of items; `shown` renders at most about 80 characters of
it (reprlib: the first few items of each container, a few levels deep, long strings cut in
the middle), so every error stays one readable line.
"""

from __future__ import annotations

import reprlib
from typing import Any

_REPR = reprlib.Repr()
_REPR.maxlevel = 3
_REPR.maxlist = _REPR.maxtuple = _REPR.maxset = _REPR.maxfrozenset = 4
_REPR.maxdict = 3
_REPR.maxstring = 60
_REPR.maxlong = 40
_REPR.maxother = 60
MAX_SHOWN = 80  # characters of a value in an error line


def shown(value: Any) -> str:
    """repr(value), at most MAX_SHOWN characters, computed without rendering all of it."""
    try:
        text = _REPR.repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits() has no repr
        return f"<an integer of {value.bit_length()} bits>"
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


def shown_text(text: Any, limit: int = 60) -> str:
    """str(text) (a key, a name) cut to `limit` characters, ending in '...' when cut."""
    out = text if isinstance(text, str) else shown(text)
    return out if len(out) <= limit else out[: limit - 3] + "..."
