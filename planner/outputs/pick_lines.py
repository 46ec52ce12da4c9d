"""The lines `piper plan` prints under its summary about the pick: its odds of being truly the
fastest (plan.json `extra.pick`, planner.search.uncertain_rank) and the published
measurements of the same setting (`extra.published`, planner.calibrate.pick_odds), each
measured figure as published beside the resource model's prediction of that layout.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

from planner.numbers import number
from planner.outputs.lines import wrapped
from planner.search.uncertain_rank import odds_line, tie_line


def published_entries(published: Sequence[Any]) -> list[dict[str, Any]]:
    """plan.json's `extra.published`: one mapping per PublishedLayout, predictions rounded."""
    out = []
    for p in published:
        d = asdict(p)
        for key in ("measured_tokens_per_s_per_gpu", "releases", "row_ids", "files"):
            d[key] = list(d[key])
        x = d["predicted_tokens_per_s_per_gpu"]
        d["predicted_tokens_per_s_per_gpu"] = round(x, 1) if x == x else None
        out.append(d)
    return out


def pick_lines(extra: Mapping[str, Any], pick_tokens_per_s_per_gpu: float) -> list[str]:
    """The printed lines (wrapped to the console width): the pick's P(best), the tie warning
    when it applies, then one line per published layout of the setting."""
    lines = []
    odds = extra.get("pick")
    if odds:
        lines.append(f"  pick: {odds_line(odds)}")
        shortlist = odds.get("shortlist_p_best")
        if shortlist is not None:
            lines.append(f"  shortlist: {odds['shortlist_trials']} trials, summed P(best) "
                         f"{float(shortlist):.2f}")  # fmt: skip
        tie = tie_line(odds)
        if tie:
            lines.append(f"  note: {tie}")
    for p in extra.get("published", ()):
        lines.append("  " + published_line(p, pick_tokens_per_s_per_gpu))
    return wrapped(lines)


def published_line(p: Mapping[str, Any], pick_tokens_per_s_per_gpu: float) -> str:
    """The line, e.g. "published: Megatron-Bridge 26.02.01 measured 9,058 tokens/s/GPU at
    LAYOUT (also 5,113 in 26.02; holdout_runs.csv id 103, 104) (this plan predicts 10,935 for
    its pick; the published layout is predicted 9,208)"."""
    measured, releases = p["measured_tokens_per_s_per_gpu"], p["releases"]
    head = f"{p['source']} {releases[0]}".strip()
    pairs = zip(measured[1:], releases[1:], strict=True)
    also = [f"{number(x)}{f' in {r}' if r else ''}" for x, r in pairs]
    rows = list(zip(p["row_ids"], p["files"], strict=True))
    ids = "; ".join(
        f"{f} id {', '.join(i for i, g in rows if g == f)}" for f in dict.fromkeys(p["files"])
    )
    predicted = p["predicted_tokens_per_s_per_gpu"]
    priced = (f"the published layout is predicted {number(predicted)}" if predicted is not None
              else "the resource model cannot price the published layout")  # fmt: skip
    return (f"published: {head} measured {number(measured[0])} tokens/s/GPU at {p['layout']} "
            f"({'also ' + ', '.join(also) + '; ' if also else ''}{ids}) (this plan predicts "
            f"{number(pick_tokens_per_s_per_gpu)} for its pick; {priced})")  # fmt: skip
