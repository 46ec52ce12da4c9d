"""The regularised fit (planner/calibrate/prior.py) as tables and as the fitted profile's YAML.

The fitted profile is the starting cluster with the fitted constants (and framework_overhead_gib
where the runs measured peak memory), named `<cluster>-fitted`, with a `calibration` mapping:
the fit's method and likelihood (`noise_sd`, `noise_dof`), the inputs (`runs_file`, and
`run_1`, `run_2`, ...: each run's label and where it came from), for every candidate constant
`prior_<name>` (the start's value), `prior_sd_<name>` (its prior sd in t, which a fit from this
profile uses in turn) and `fitted_<name>` (the value; `kept_<name>` says why one stayed at the
preset), the runs reported as outliers (`outliers`), the memory fit,
and the errors before the fit, of the fit and left out (geomean predicted / measured, share
within +-15%, worst run, RMS log error). What the error bars read
(planner/calibrate/uncertainty.py): `runs` and `loo_rms_log`, `memory_runs` and
`memory_loo_rms_log`, the start profile's `start_runs` and `start_loo_rms_log` (its own error
record, pooled in), and the fitted constants' posterior covariance in t = log(c + a) as
`se_<name>` (standard errors, in the order of `params`) and `corr_<a>__<b>` (correlations).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import yaml

from planner.calibrate.fit_report import Table, constant_text, errors_table, runs_table
from planner.calibrate.prior import PriorFit
from planner.calibrate.uncertainty import covariance_items, error_model
from planner.inputs.clusters import cluster_from_dict, cluster_to_dict
from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES, ClusterSpec


def prior_tables(result: PriorFit) -> list[Table]:
    """(title, columns, rows): the constants (prior, width, fitted, why), runs and errors."""
    why = dict(result.selection.dropped)
    elasticity = dict(result.selection.elasticity)
    priors = {p.name: p for p in result.priors}
    constants = []
    named = [e for e in TOPOLOGY_EFFICIENCIES if e.name in priors]  # fitted only when named
    for e in (*EFFICIENCIES, *named):
        p = priors.get(e.name)
        fitted = e.name in result.selection.kept
        width = "-" if p is None else f"{p.width:.3g}" + (f" (+{p.offset:g})" if p.offset else "")
        constants.append((
            e.name, constant_text(getattr(result.start, e.name)),
            constant_text(getattr(result.fitted, e.name)), "yes" if fitted else "kept", width,
            "-" if p is None else f"{elasticity[e.name]:.3f}",
            "" if fitted else why.get(e.name, "not among --params"),
        ))  # fmt: skip
    tables = [
        (f"constants of {result.start.name}: {len(result.selection.kept)} of "
         f"{len(result.priors)} fitted (prior = the preset; prior sd of log(constant + offset); "
         "elasticity = RMS d log predicted / d log constant over the runs)",
         ("constant", "prior", "fitted", "fitted?", "prior sd", "elasticity", "why kept"),
         constants),
        runs_table(result.runs),
        errors_table(result.before, result.after, result.left_out),
    ]  # fmt: skip
    mem = result.memory
    if mem is not None:
        tables.append((
            f"memory: framework_overhead_gib from {mem.runs} measured peak(s)",
            ("", "framework_overhead_gib", "mean predicted - measured peak GiB"),
            [("prior", constant_text(mem.prior_gib), f"{mem.mean_error_before_gib:+.2f}"),
             ("fitted", constant_text(mem.fitted_gib), f"{mem.mean_error_after_gib:+.2f}")],
        ))  # fmt: skip
    return tables


def calibration_items(result: PriorFit, runs_file: str, date: str) -> list[tuple[str, Any]]:
    """The `calibration` mapping of the fitted profile (module docstring), in order."""
    noise = result.likelihood
    cal: list[tuple[str, Any]] = [
        ("fitted_by", "piper calibrate --fit"), ("method", "posterior mode, Student-t runs"),
        ("noise_sd", round(noise.sigma, 4)), ("noise_dof", noise.dof), ("date", date),
        ("runs_file", runs_file or "-"),
        ("from_cluster", result.start.name), ("runs", len(result.runs)),
        ("runs_used", ", ".join(r.run.label for r in result.runs)),
        ("params", ",".join(result.selection.kept)),
    ]  # fmt: skip
    start = error_model(result.start)
    if start.runs:
        cal += [("start_runs", start.runs), ("start_loo_rms_log", round(start.time_log_sd, 4))]
    cal += [(f"run_{i}", f"{r.run.label} ({r.run.where})") for i, r in
            enumerate(result.runs, start=1)]  # fmt: skip
    why = dict(result.selection.dropped)
    for p in result.priors:
        cal += [(f"prior_{p.name}", p.value), (f"prior_sd_{p.name}", p.width),
                (f"fitted_{p.name}", getattr(result.fitted, p.name))]  # fmt: skip
        if p.name in why:
            cal.append((f"kept_{p.name}", why[p.name]))
    if result.outliers:
        cal.append(("outliers", "; ".join(f"{o.label} z {o.z:+.2f} weight {o.weight:.2f}"
                                          for o in result.outliers)))  # fmt: skip
    if result.memory is not None:
        cal += [("prior_framework_overhead_gib", result.memory.prior_gib),
                ("fitted_framework_overhead_gib", result.memory.fitted_gib),
                ("memory_runs", result.memory.runs)]  # fmt: skip
        if result.memory.loo_rms_log is not None:
            cal.append(("memory_loo_rms_log", round(result.memory.loo_rms_log, 4)))
    if result.covariance_t:
        cal += covariance_items(result.selection.kept, np.array(result.covariance_t))
    for prefix, err in (("before", result.before), ("fit", result.after),
                        ("loo", result.left_out)):  # fmt: skip
        if err is not None:
            cal += [
                (f"{prefix}_geomean", round(err.geomean, 4)),
                (f"{prefix}_within_15pct", round(err.within, 4)),
                (f"{prefix}_worst", f"{err.worst} {err.worst_ratio:.3f}"),
                (f"{prefix}_rms_log", round(err.rms_log, 4)),
            ]
    return cal


def prior_profile(result: PriorFit, runs_file: str, date: str) -> ClusterSpec:
    """The fitted cluster with its calibration mapping."""
    return replace(
        result.fitted,
        name=f"{result.start.name}-fitted",
        source=f"{result.start.name} fitted by piper calibrate --fit ({len(result.runs)} runs)",
        calibration=tuple((k, str(v)) for k, v in calibration_items(result, runs_file, date)),
    )


def prior_profile_yaml(result: PriorFit, runs_file: str, date: str) -> str:
    """The fitted profile as cluster YAML; `load_cluster` reads it back to the same
    constants (checked here)."""
    cluster = prior_profile(result, runs_file, date)
    data = cluster_to_dict(cluster)
    for e in EFFICIENCIES:
        data[e.name] = getattr(cluster, e.name)
    data["framework_overhead_gib"] = cluster.framework_overhead_gib
    text = yaml.safe_dump(data, sort_keys=False)
    back = cluster_from_dict(yaml.safe_load(text), source="fitted profile")
    names = [e.name for e in EFFICIENCIES] + ["framework_overhead_gib"]
    lost = [n for n in names if getattr(back, n) != getattr(cluster, n)]
    if lost:
        raise RuntimeError(f"the cluster reader does not read {', '.join(lost)} back")
    header = (
        f"# {cluster.name}: {result.start.name} with {', '.join(result.selection.kept) or 'no'} "
        f"constant(s) fitted by 'piper calibrate --fit' on {len(result.runs)} run(s), "
        "regularised toward the preset; see calibration.\n"
    )
    return header + text
