"""Cross-hardware answers: one model and global batch planned on several clusters, side by side.

`piper plan --cluster a,b,c` plans on each cluster in turn (each into its own folder) and
prints one row per cluster: tokens/s for the whole job, per GPU and per node, the largest
stage's memory, each with its interval where the plan carries one, and the layout. A cluster
on which no plan was made keeps its row, with the one-line reason in place of the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from planner.numbers import number
from planner.plan.schema import Interval
from planner.search.make_plan import PlanResult
from planner.search.rows import describe
from planner.specs import SpecError

COLUMNS = ("cluster", "tokens/s", "per GPU", "per node", "memory GiB", "layout")


@dataclass(frozen=True)
class CrossRow:
    """One cluster's answer. Intervals are (lo, mid, hi) at `level`; mid alone when the plan
    has no intervals (lo = hi = mid); all None when no plan was made (`note` says why)."""

    cluster: str
    out: str
    gpus: int
    gpus_per_node: int
    tokens_per_s: Interval | None
    memory_gib: Interval | None
    layout: str
    note: str = ""

    def per_gpu(self) -> Interval | None:
        return _scaled(self.tokens_per_s, 1 / self.gpus) if self.gpus else None

    def per_node(self) -> Interval | None:
        return _scaled(self.tokens_per_s, self.gpus_per_node / self.gpus) if self.gpus else None

    def to_dict(self) -> dict[str, Any]:
        figures = {"tokens_per_s": self.tokens_per_s, "tokens_per_s_per_gpu": self.per_gpu(),
                   "tokens_per_s_per_node": self.per_node(),
                   "memory_gib": self.memory_gib}  # fmt: skip
        out: dict[str, Any] = {"cluster": self.cluster, "out": self.out, "gpus": self.gpus,
                               "gpus_per_node": self.gpus_per_node, "layout": self.layout,
                               "note": self.note}  # fmt: skip
        for key, iv in figures.items():
            out[key] = None if iv is None else {"lo": iv.lo, "mid": iv.mid, "hi": iv.hi}
        return out


def cluster_names(text: str) -> list[str]:
    """The clusters of `--cluster a,b,c` (presets or YAML paths), each once. SpecError naming
    --cluster for an empty entry or one listed twice (their folders would collide)."""
    names = [n.strip() for n in text.split(",")]
    if any(not n for n in names):
        raise SpecError(f"--cluster '{text}': an empty name between commas; list a,b,c")
    folders = [folder(n) for n in names]
    twice = sorted({f for f in folders if folders.count(f) > 1})
    if twice:
        raise SpecError(f"--cluster '{text}' lists {twice[0]} twice; list each cluster once")
    return names


def folder(cluster: str) -> str:
    """The subfolder of --out a cluster's plan goes to: the preset name or the file's stem."""
    return Path(cluster).stem if Path(cluster).suffix in (".yaml", ".yml") else cluster


def cross_row(cluster: str, result: PlanResult, out: str) -> CrossRow:
    """The row of a cluster's plan (`result` with its intervals, as `piper plan` writes it)."""
    plan, best = result.plan, result.best
    assert plan is not None and best is not None and best.estimate is not None
    est, iv = best.estimate, plan.predicted.intervals
    stages = est.memory_gib_per_stage
    top = max(range(len(stages)), key=stages.__getitem__)
    tokens = Interval(est.tokens_per_s, est.tokens_per_s, est.tokens_per_s)
    memory = Interval(stages[top], stages[top], stages[top])
    if iv is not None:
        tokens = Interval(iv.tokens_per_s.lo, est.tokens_per_s, iv.tokens_per_s.hi, iv.level)
        m = iv.memory_gib_per_stage[top]
        memory = Interval(m.lo, stages[top], m.hi, iv.level)
    gpn = plan.cluster.gpus_per_node or 1
    layout = describe(best.parallel, best.knobs)
    return CrossRow(cluster, out, result.gpus, gpn, tokens, memory, layout)


def failed_row(cluster: str, out: str, reason: str) -> CrossRow:
    """The row of a cluster on which no plan was made: the reason in the layout column."""
    return CrossRow(cluster, out, 0, 0, None, None, "", note=reason)


def cross_cells(rows: list[CrossRow]) -> list[list[str]]:
    """The table's cells, one list per row in COLUMNS order: the cluster with its GPU count,
    each figure with its interval in brackets, the layout (or why there is no plan)."""
    cells = []
    for r in rows:
        if r.tokens_per_s is None:
            cells.append([folder(r.cluster), "", "", "", "", f"no plan: {r.note}"])
            continue
        name = f"{folder(r.cluster)}\n{number(r.gpus)} GPUs"
        cells.append([name, _interval(r.tokens_per_s),
                      _interval(r.per_gpu()), _interval(r.per_node()),
                      _interval(r.memory_gib), r.layout])  # fmt: skip
    return cells


def cross_title(rows: list[CrossRow], model: str) -> str:
    """The line above the table: the model and what the brackets are."""
    levels = {r.tokens_per_s.level for r in rows if r.tokens_per_s is not None}
    if not levels:
        return f"{model} side by side"
    level = ", ".join(f"{lv:.0%}" for lv in sorted(levels))
    return f"{model} side by side: each figure predicted, its {level} interval in brackets"


def _interval(iv: Interval | None) -> str:
    if iv is None:
        return ""
    if iv.lo == iv.mid == iv.hi:
        return _short(iv.mid)
    return f"{_short(iv.mid)}\n[{_short(iv.lo)}, {_short(iv.hi)}]"  # its own line: no wrap


def _short(x: float) -> str:
    """Three significant digits with k / M: 1.23M, 45.6k, 789."""
    for scale, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{suffix}"
    return f"{x:.3g}"


def _scaled(iv: Interval | None, factor: float) -> Interval | None:
    if iv is None:
        return None
    return Interval(iv.lo * factor, iv.mid * factor, iv.hi * factor, iv.level)
