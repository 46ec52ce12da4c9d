"""framework_overhead_gib from the runs' measured peak memory.

Runs with a measured peak move framework_overhead_gib, the constant the resource model adds to
every stage (planner/resources/cost.py), by the shrunk mean of measured minus predicted peak,
sum_r d_r / (n + (MEMORY_SIGMA_GIB / MEMORY_WIDTH_GIB)^2): the least-squares optimum of a
Gaussian likelihood (sd MEMORY_SIGMA_GIB per run) and prior (sd MEMORY_WIDTH_GIB) in GiB, held
within [MEMORY_FLOOR_GIB, MEMORY_CEILING_SHARE x the device's memory]. Time constants do not
change memory, so this fit is separate from planner/calibrate/prior.py's. Leave-one-out:
framework_overhead_gib refitted without each run's peak.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.calibrate.runs import Run, estimate_run
from planner.specs import ClusterSpec

MEMORY_SIGMA_GIB = 1.0
MEMORY_WIDTH_GIB = 4.0
MEMORY_FLOOR_GIB = 0.5  # the CUDA context alone takes about this much
MEMORY_CEILING_SHARE = 0.5  # an overhead above half the device's memory is not an overhead


@dataclass(frozen=True)
class MemoryFit:
    """framework_overhead_gib from the runs' measured peaks."""

    runs: int
    prior_gib: float
    fitted_gib: float
    mean_error_before_gib: float  # mean of predicted - measured peak
    mean_error_after_gib: float
    loo_rms_log: float | None = None  # RMS log(predicted / measured) peak, each run left out


def fit_memory(runs: Sequence[Run], cluster: ClusterSpec) -> MemoryFit | None:
    """framework_overhead_gib moved by the shrunk mean peak error (module docstring); None
    when no run has a measured peak."""
    measured = [r for r in runs if r.measured_peak_gib]
    if not measured:
        return None
    diffs = [
        float(r.measured_peak_gib or 0.0) - max(estimate_run(r, cluster).memory_gib_per_stage)
        for r in measured
    ]
    prior = cluster.framework_overhead_gib
    fitted = _overhead(diffs, prior, cluster)
    mean = sum(diffs) / len(diffs)
    loo = None
    if len(diffs) >= 2:
        logs = []
        for i, r in enumerate(measured):
            moved = _overhead(diffs[:i] + diffs[i + 1 :], prior, cluster) - prior
            peak = float(r.measured_peak_gib or 0.0)
            logs.append(math.log(max(peak - diffs[i] + moved, 1e-9) / peak))
        loo = math.sqrt(sum(x * x for x in logs) / len(logs))
    return MemoryFit(len(diffs), prior, fitted, -mean, (fitted - prior) - mean, loo)


def _overhead(diffs: Sequence[float], prior: float, cluster: ClusterSpec) -> float:
    """framework_overhead_gib moved by the shrunk mean of `diffs` (measured - predicted GiB),
    held within its floor and ceiling (module docstring)."""
    shrink = len(diffs) + (MEMORY_SIGMA_GIB / MEMORY_WIDTH_GIB) ** 2
    ceiling = MEMORY_CEILING_SHARE * cluster.device.memory_gib
    return min(max(prior + sum(diffs) / shrink, MEMORY_FLOOR_GIB), ceiling)
