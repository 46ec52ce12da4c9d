"""Lines `piper` prints: wrapped to LINE_WIDTH columns, MFU labelled with the peak it is
against. No heavy imports: `piper estimate` shares them with `piper plan`."""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence

from planner.numbers import percent
from planner.resources.precision import LOW_PRECISION

LINE_WIDTH = 100  # the widest line `piper plan` and `piper estimate` print


def wrapped(lines: Sequence[str], width: int = LINE_WIDTH) -> list[str]:
    """Each line wrapped at spaces to `width`, its continuation indented 4 past its own
    indent; words are never broken (a path longer than the line stays whole)."""
    out = []
    for line in lines:
        indent = " " * (len(line) - len(line.lstrip(" ")))
        out += textwrap.wrap(line, width, subsequent_indent=indent + "    ",
                             break_long_words=False, break_on_hyphens=False) or [""]  # fmt: skip
    return out


def mfu_text(tflops_per_gpu: float, mfu: float, dtype: str, peaks: Mapping[str, float]) -> str:
    """MFU against the BF16 peak ("MFU x%"); in an FP8 or FP4 dtype the figure against that
    precision's peak (the resource model's mfu) follows, labelled as such."""
    if dtype in LOW_PRECISION and peaks.get("bf16"):
        bf16 = tflops_per_gpu / peaks["bf16"]
        return f"MFU {percent(bf16)} of the BF16 peak, {percent(mfu)} of the {dtype.upper()} peak"
    return f"MFU {percent(mfu)}"


def cluster_label(name: str) -> str:
    """A cluster's name as people read it: a resized profile's `h100-32n` is
    `h100 (32 nodes)`; any other name as it is."""
    found = re.fullmatch(r"(.+)-(\d+)n", name)
    return f"{found[1]} ({int(found[2]):,} nodes)" if found else name
