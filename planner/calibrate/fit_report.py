"""A fit as tables (constants, runs, errors) and as the fitted cluster profile's YAML.

The fitted profile is the starting cluster with the fitted constants, named `<cluster>-fitted`,
and a `calibration` mapping that records where they come from: the runs file, the runs used,
the constants fitted, the date, and the fit's and the leave-one-out errors (geomean
predicted / measured, share within +-15%, worst run, RMS log error).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import yaml

from planner.calibrate.fit import PRIOR_WEIGHT, WITHIN, FitError, FitResult, RunFit
from planner.inputs.clusters import cluster_from_dict, cluster_to_dict
from planner.numbers import number
from planner.specs import EFFICIENCIES, ClusterSpec

Table = tuple[str, tuple[str, ...], list[tuple[Any, ...]]]


def constant_text(value: float) -> str:
    """A constant as the tables print it (4 significant digits, planner.numbers.number)."""
    return number(value, 4)


def fit_tables(result: FitResult) -> list[Table]:
    """(title, columns, rows) of the constants, the runs and the errors."""
    fitted = {e.name for e in result.params}
    constants = [
        (e.name, constant_text(getattr(result.start, e.name)),
         constant_text(getattr(result.fitted, e.name)), "yes" if e.name in fitted else "kept",
         f"{e.low:g}-{e.high:g}{' (log)' if e.log else ''}", e.meaning)
        for e in EFFICIENCIES
    ]  # fmt: skip
    return [
        (f"constants of {result.start.name}: {len(fitted)} fitted",
         ("constant", "before", "after", "fitted", "bounds", "meaning"), constants),
        runs_table(result.runs),
        errors_table(result.before, result.after, result.left_out),
    ]  # fmt: skip


def runs_table(fits: Sequence[RunFit]) -> Table:
    """Each run: measured, predicted before, fitted and left out, with the ratios and peaks."""
    runs = []
    for r in fits:
        m = r.run.measured
        loo = r.left_out
        runs.append((
            r.run.label, r.run.metric, number(m), number(r.before), f"{r.before / m:.2f}",
            number(r.after), f"{r.after / m:.2f}", number(loo),
            "-" if loo is None else f"{loo / m:.2f}", number(r.peak_gib, 3),
            number(r.run.measured_peak_gib, 3),
        ))  # fmt: skip
    return (
        "runs: predicted vs measured (ratio = predicted / measured; peak GiB predicted with "
        "the fitted constants)",
        ("run", "metric", "measured", "before", "ratio", "fit", "ratio", "left out",
         "ratio", "peak GiB", "measured GiB"), runs,
    )  # fmt: skip


def errors_table(before: FitError, after: FitError, left_out: FitError | None) -> Table:
    """The errors before the fit, of the fit and left out."""
    errors = [_error_row("before (start)", before), _error_row("fit", after)]
    if left_out is not None:
        errors.append(_error_row("leave-one-out", left_out))
    return (
        "errors (predicted / measured)",
        ("", "runs", "geomean", f"within +-{WITHIN:.0%}", "worst run", "worst ratio",
         "RMS log"), errors,
    )  # fmt: skip


def _error_row(name: str, e: FitError) -> tuple[Any, ...]:
    return (name, e.runs, f"{e.geomean:.3f}", f"{e.within:.0%}", e.worst,
            f"{e.worst_ratio:.3f}", f"{e.rms_log:.3f}")  # fmt: skip


def fitted_profile(result: FitResult, runs_file: str, date: str) -> ClusterSpec:
    """The fitted cluster: `<cluster>-fitted` with the provenance mapping (module docstring)."""
    cal: list[tuple[str, Any]] = [
        ("fitted_by", "piper calibrate --fit"), ("date", date), ("runs_file", runs_file),
        ("from_cluster", result.start.name), ("runs", len(result.runs)),
        ("runs_used", ", ".join(r.run.label for r in result.runs)),
        ("params", ",".join(e.name for e in result.params)), ("prior_weight", PRIOR_WEIGHT),
    ]  # fmt: skip
    for prefix, err in (("before", result.before), ("fit", result.after),
                        ("loo", result.left_out)):  # fmt: skip
        if err is None:
            continue
        cal += [
            (f"{prefix}_geomean", round(err.geomean, 4)),
            (f"{prefix}_within_15pct", round(err.within, 4)),
            (f"{prefix}_worst", f"{err.worst} {err.worst_ratio:.3f}"),
            (f"{prefix}_rms_log", round(err.rms_log, 4)),
        ]
    return replace(
        result.fitted,
        name=f"{result.start.name}-fitted",
        source=f"{result.start.name} fitted by piper calibrate --fit on {runs_file}",
        calibration=tuple((k, str(v)) for k, v in cal),
    )


def fitted_profile_yaml(result: FitResult, runs_file: str, date: str) -> str:
    """The fitted profile as cluster YAML; `load_cluster` reads it back to the same
    constants (checked here)."""
    cluster = fitted_profile(result, runs_file, date)
    data = cluster_to_dict(cluster)
    for e in EFFICIENCIES:
        data[e.name] = getattr(cluster, e.name)
    text = yaml.safe_dump(data, sort_keys=False)
    back = cluster_from_dict(yaml.safe_load(text), source="fitted profile")
    lost = [e.name for e in EFFICIENCIES if getattr(back, e.name) != getattr(cluster, e.name)]
    if lost:
        raise RuntimeError(f"the cluster reader does not read {', '.join(lost)} back")
    header = (
        f"# {cluster.name}: {result.start.name} with {len(result.params)} constants fitted by "
        f"'piper calibrate --fit' on {runs_file} ({len(result.runs)} runs); see calibration.\n"
    )
    return header + text
