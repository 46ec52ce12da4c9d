"""How numbers read by people are written: one formatter for the console, tables and reports.

`number(x, digits)` writes a value by its magnitude: integers (counts) in full with thousands
separators, never in scientific notation; other values to `digits` significant digits, in
fixed notation, so a small value stays non-zero (0.009513, not 0.0); values of
10**(digits - 1) and more are rounded to a whole number with separators (54,329, not
5.433e+04). Only values under `SCIENTIFIC_BELOW` in magnitude use an exponent (fixed notation
would print a row of zeros). `percent(fraction)` writes a fraction as a percentage the same
way. CSV files keep their own full-precision, machine-readable numbers
(planner.outputs.tables.to_csv).
"""

from __future__ import annotations

import math
from numbers import Integral, Real

SCIENTIFIC_BELOW = 1e-6  # smaller non-zero magnitudes are written with an exponent
EMPTY = "-"  # what a missing value (None, nan) reads as


def number(x: float | int | None, digits: int = 4) -> str:
    """`x` as people read it (see the module docstring); EMPTY for None or nan.

    Args:
        x: the value; bools and integers are counts, written in full.
        digits: significant digits of a non-integer value (>= 1).
    """
    if x is None or isinstance(x, bool):
        return EMPTY if x is None else str(x)
    if isinstance(x, Integral):
        return f"{int(x):,}"
    if not isinstance(x, Real) or math.isnan(x):
        return EMPTY
    value = float(x)
    if math.isinf(value):
        return "inf" if value > 0 else "-inf"
    if value == 0:
        return "0"
    magnitude = abs(value)
    if magnitude < SCIENTIFIC_BELOW:
        return f"{value:.{max(digits - 1, 0)}e}"
    exponent = math.floor(math.log10(magnitude))
    decimals = max(digits - 1 - exponent, 0)
    text = f"{value:,.{decimals}f}"
    if "." in text:
        text = text.rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def percent(fraction: float | None, decimals: int = 1) -> str:
    """`fraction` (0.095 for 9.5%) as a percentage with `decimals` decimals, or with two
    significant digits when that would round a non-zero value to 0."""
    if fraction is None or math.isnan(fraction):
        return EMPTY
    pct = 100 * fraction
    if pct != 0 and abs(pct) < 0.5 * 10**-decimals:
        return f"{number(pct, 2)}%"
    return f"{pct:.{decimals}f}%"
