"""A fit that cannot overfit silently: regularised toward the preset, only what the runs identify.

`piper calibrate --fit` fits a team's few runs with this module (planner/calibrate/fit.py's
plain least squares stays the fit of the presets on the published runs). For runs r with
measured throughput m_r and a cluster whose named efficiencies (planner.specs.EFFICIENCIES)
have the preset's values c0_k, each constant is moved in t_k = log(c_k + a_k) (a_k > 0 only
for constants whose range starts at 0) and the fit solves, within each constant's bounds,

    min  sum_r (log(p_r / m_r) / RUN_SIGMA)^2  +  sum_k ((t_k - t0_k) / w_k)^2

RUN_SIGMA = 0.1 is the model's per-run log error the data term is scaled by (ASSUMPTION: the
spread of the presets' own fit, results/published_runs.md); w_k (PRIORS) is how far, in log
units, a constant may plausibly sit from the preset (ASSUMPTION, per constant below).

Which constants: at the preset, J_rk = d log p_r / d t_k by forward differences (step
JACOBIAN_STEP in t). A constant is dropped when its RMS column over the runs is below
MIN_ELASTICITY (no run's prediction moves with it) and, of the rest, a QR with column pivoting
(scipy.linalg.qr) keeps columns in pivot order while |R_jj| >= COLLINEAR x |R_00| and there
are fewer than max_fitted(runs) of them: a dropped column moves the runs' predictions as the
kept ones do (collinear). The others stay at the preset; the result says which and why.

Memory (runs with a measured peak): framework_overhead_gib, the constant the resource model
adds to every stage (planner/resources/cost.py), moves by the shrunk mean of measured minus
predicted peak, sum_r d_r / (n + (MEMORY_SIGMA_GIB / MEMORY_WIDTH_GIB)^2), the least-squares
optimum of the same data-plus-prior form in GiB, held within [MEMORY_FLOOR_GIB,
MEMORY_CEILING_SHARE x the device's memory]; time constants do not change memory, so the two
fits are separate.

Leave-one-out: for each run, the selection and the fit are redone on the others and the run is
predicted; for memory, framework_overhead_gib is refitted without each run's peak.

Uncertainty (planner/calibrate/uncertainty.py reads it from the fitted profile): the kept
constants' covariance in t at the fit, (J'J / RUN_SIGMA^2 + diag(1 / w_k^2))^-1 with J the
runs' d log p / d t there (the Laplace approximation of the posterior the objective is the
negative log of, up to a factor 2).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.linalg import qr
from scipy.optimize import least_squares

from planner.calibrate.fit import FitError, RunFit, fit_error, fit_params
from planner.calibrate.runs import Run, estimate_run, predicted_value
from planner.specs import ClusterSpec, Efficiency, SpecError

RUN_SIGMA = 0.1
# name -> (prior width w in log units, offset a added before the log)
PRIORS: dict[str, tuple[float, float]] = {
    "gemm_efficiency": (0.3, 0.0),
    "grouped_gemm_half_rows": (1.0, 0.0),
    "attention_efficiency": (0.3, 0.0),
    "hbm_efficiency": (0.3, 0.0),
    "layer_overhead_us": (1.0, 1000.0),  # 1 ms: the scale of the h100 preset's 1,911 us
    "scale_up_efficiency": (0.3, 0.0),
    "scale_out_efficiency": (0.3, 0.0),
    "overlap_efficiency": (0.5, 0.1),
    "network_jitter_us": (1.0, 100.0),  # 100 us: a few switch traversals' worth of delay
}
JACOBIAN_STEP = 0.05
MIN_ELASTICITY = 0.01  # RMS d log p / d t below this: no run sees the constant
COLLINEAR = 0.1  # |R_jj| / |R_00| below this: the column repeats the kept ones
MEMORY_SIGMA_GIB = 1.0
MEMORY_WIDTH_GIB = 4.0
MEMORY_FLOOR_GIB = 0.5  # the CUDA context alone takes about this much
MEMORY_CEILING_SHARE = 0.5  # an overhead above half the device's memory is not an overhead
MAX_EVALUATIONS = 80
Progress = Callable[[int, int | None], None]


def max_fitted(runs: int) -> int:
    """The most constants `runs` runs may set: one fewer than the runs (one with one run), so
    every fit keeps a run's worth of residual to judge it by."""
    return max(1, runs - 1)


@dataclass(frozen=True)
class Prior:
    """One constant's prior: the preset's value, the width and offset of its log scale."""

    efficiency: Efficiency
    value: float
    width: float
    offset: float

    @property
    def name(self) -> str:
        return self.efficiency.name

    def t(self, value: float) -> float:
        return math.log(value + self.offset)

    def value_at(self, t: float) -> float:
        e = self.efficiency
        return min(max(math.exp(t) - self.offset, e.low), e.high)

    @property
    def t_bounds(self) -> tuple[float, float]:
        e = self.efficiency
        return self.t(e.low), self.t(e.high)


@dataclass(frozen=True)
class Selection:
    """Which candidate constants the runs identify, with a reason for each one left out."""

    kept: tuple[str, ...]
    dropped: tuple[tuple[str, str], ...]  # (name, why)
    elasticity: tuple[tuple[str, float], ...]  # RMS d log p / d log(c + a) over the runs


@dataclass(frozen=True)
class MemoryFit:
    """framework_overhead_gib from the runs' measured peaks."""

    runs: int
    prior_gib: float
    fitted_gib: float
    mean_error_before_gib: float  # mean of predicted - measured peak
    mean_error_after_gib: float
    loo_rms_log: float | None = None  # RMS log(predicted / measured) peak, each run left out


@dataclass(frozen=True)
class PriorFit:
    priors: tuple[Prior, ...]
    selection: Selection
    start: ClusterSpec
    fitted: ClusterSpec
    runs: tuple[RunFit, ...]
    before: FitError
    after: FitError
    left_out: FitError | None
    memory: MemoryFit | None
    converged: bool
    message: str
    covariance_t: tuple[tuple[float, ...], ...] = ()  # selection.kept x kept, in t units


def priors_of(cluster: ClusterSpec, names: Sequence[str] | None) -> tuple[Prior, ...]:
    """The candidates' priors: the cluster's values with PRIORS' widths and offsets."""
    out = []
    for e in fit_params(names):
        width, offset = PRIORS[e.name]
        value = min(max(float(getattr(cluster, e.name)), e.low), e.high)
        out.append(Prior(e, value, width, offset))
    return tuple(out)


class _Problem:
    """Predictions of the runs at constants t (cached), for one set of candidate priors."""

    def __init__(self, runs: Sequence[Run], cluster: ClusterSpec, priors: tuple[Prior, ...]):
        self.runs, self.cluster, self.priors = tuple(runs), cluster, priors
        self.t0 = np.array([p.t(p.value) for p in priors])
        self._cache: dict[tuple[int, tuple[float, ...]], float] = {}

    def cluster_at(self, t: np.ndarray) -> ClusterSpec:
        if np.array_equal(t, self.t0):
            return self.cluster
        values = {
            p.name: p.value_at(x)
            for p, x, x0 in zip(self.priors, t, self.t0, strict=True)
            if x != x0  # a constant left at the prior keeps the cluster's exact value
        }
        return replace(self.cluster, **values)

    def log_ratio(self, i: int, t: np.ndarray) -> float:
        key = (i, tuple(float(x) for x in t))
        if key not in self._cache:
            run = self.runs[i]
            self._cache[key] = predicted_value(run, estimate_run(run, self.cluster_at(t)))
        return math.log(max(self._cache[key], 1e-300) / self.runs[i].measured)

    def jacobian(
        self, rows: Sequence[int], at: np.ndarray | None = None, only: Sequence[int] | None = None
    ) -> np.ndarray:
        """d log p_r / d t_k at `at` (default the prior) for the constants `only` (default
        all), forward differences (backward at the top bound)."""
        t_at = self.t0 if at is None else at
        base = np.array([self.log_ratio(i, t_at) for i in rows])
        cols = []
        for k in range(len(self.priors)) if only is None else only:
            high = self.priors[k].t_bounds[1]
            step = JACOBIAN_STEP if t_at[k] + JACOBIAN_STEP <= high else -JACOBIAN_STEP
            t = t_at.copy()
            t[k] += step
            cols.append((np.array([self.log_ratio(i, t) for i in rows]) - base) / step)
        return np.column_stack(cols)

    def covariance(self, rows: Sequence[int], kept: Sequence[str], t: np.ndarray) -> np.ndarray:
        """The kept constants' covariance in t at the fit t: the inverse of the Gauss-Newton
        Hessian of the objective / 2, J'J / RUN_SIGMA^2 + diag(1 / w_k^2) (Laplace's
        approximation of the posterior the regularised fit maximises)."""
        idx = [k for k, p in enumerate(self.priors) if p.name in kept]
        if not idx:
            return np.zeros((0, 0))
        jac = self.jacobian(rows, at=t, only=idx)
        prior = np.diag([1.0 / self.priors[k].width ** 2 for k in idx])
        return np.linalg.inv(jac.T @ jac / RUN_SIGMA**2 + prior)

    def select(self, rows: Sequence[int]) -> Selection:
        """The identifiable constants over `rows` (module docstring)."""
        jac = self.jacobian(rows)
        rms = np.linalg.norm(jac, axis=0) / math.sqrt(len(rows))
        names = [p.name for p in self.priors]
        flat = f"no run's prediction moves with it (elasticity {{:.3f}} < {MIN_ELASTICITY})"
        dropped = [(names[k], flat.format(rms[k])) for k in range(len(names))
                   if rms[k] < MIN_ELASTICITY]  # fmt: skip
        live = [k for k in range(len(names)) if rms[k] >= MIN_ELASTICITY]
        kept, more = _pivoted(jac[:, live], [names[k] for k in live], max_fitted(len(rows)))
        order = {n: i for i, n in enumerate(names)}
        return Selection(
            tuple(sorted(kept, key=order.__getitem__)),
            tuple(sorted(dropped + more, key=lambda d: order[d[0]])),
            tuple((n, float(x)) for n, x in zip(names, rms, strict=True)),
        )

    def solve(self, rows: Sequence[int], kept: Sequence[str]) -> tuple[np.ndarray, bool, str]:
        """The regularised least squares over `rows`, moving only `kept`."""
        idx = [k for k, p in enumerate(self.priors) if p.name in kept]
        if not idx:
            return self.t0.copy(), True, "nothing to fit"
        widths = np.array([self.priors[k].width for k in idx])
        low = np.array([self.priors[k].t_bounds[0] for k in idx])
        high = np.array([self.priors[k].t_bounds[1] for k in idx])

        def full(x: np.ndarray) -> np.ndarray:
            t = self.t0.copy()
            t[idx] = x
            return t

        def residuals(x: np.ndarray) -> np.ndarray:
            t = full(x)
            data = [self.log_ratio(i, t) / RUN_SIGMA for i in rows]
            return np.concatenate([np.array(data), (x - self.t0[idx]) / widths])

        x0 = np.clip(self.t0[idx], low, high)
        sol = least_squares(residuals, x0, bounds=(low, high), method="trf",
                            diff_step=1e-3, max_nfev=MAX_EVALUATIONS)  # fmt: skip
        return full(np.clip(sol.x, low, high)), bool(sol.status > 0), str(sol.message)

    def fit_rows(self, rows: Sequence[int]) -> tuple[Selection, np.ndarray, bool, str]:
        selection = self.select(rows)
        t, converged, message = self.solve(rows, selection.kept)
        return selection, t, converged, message


def _pivoted(
    jac: np.ndarray, names: list[str], cap: int
) -> tuple[list[str], list[tuple[str, str]]]:
    """QR with column pivoting: the columns kept in pivot order while |R_jj| >= COLLINEAR x
    |R_00| and fewer than `cap` are kept; the others with the reason."""
    kept: list[str] = []
    dropped: list[tuple[str, str]] = []
    if not names:
        return kept, dropped
    _, r, piv = qr(jac, mode="economic", pivoting=True)
    rank, top = min(r.shape), abs(r[0, 0])
    for j, col in enumerate(piv):
        name, after = names[col], ", ".join(kept)
        ratio = abs(r[j, j]) / top if j < rank and top > 0 else 0.0
        if j >= rank:
            why = f"{jac.shape[0]} run(s) leave no direction for it beyond {after}"
        elif ratio < COLLINEAR:
            why = f"moves the runs' predictions as {after} (collinear: {ratio:.3f} < {COLLINEAR})"
        elif len(kept) >= cap:
            why = f"{jac.shape[0]} run(s) set at most {cap} constant(s)"
        else:
            kept.append(name)
            continue
        dropped.append((name, why))
    return kept, dropped


def fit_with_prior(
    runs: Sequence[Run],
    cluster: ClusterSpec,
    names: Sequence[str] | None = None,
    leave_one_out: bool = True,
    progress: Progress | None = None,
) -> PriorFit:
    """Fit the identifiable constants among `names` (default all EFFICIENCIES) to `runs`,
    regularised toward `cluster`'s values; framework_overhead_gib from measured peaks."""
    if not runs:
        raise SpecError("no runs to fit; give at least one measured run")
    problem = _Problem(runs, cluster, priors_of(cluster, names))
    rows = tuple(range(len(runs)))
    selection, t_fit, converged, message = problem.fit_rows(rows)
    fitted = problem.cluster_at(t_fit)
    cov = problem.covariance(rows, selection.kept, t_fit)
    before = [math.exp(problem.log_ratio(i, problem.t0)) * runs[i].measured for i in rows]
    after = [math.exp(problem.log_ratio(i, t_fit)) * runs[i].measured for i in rows]
    left_out: list[float] | None = None
    if leave_one_out and len(runs) >= 2:
        left_out = []
        for i in rows:
            _, t_i, _, _ = problem.fit_rows(tuple(j for j in rows if j != i))
            left_out.append(math.exp(problem.log_ratio(i, t_i)) * runs[i].measured)
            if progress is not None:
                progress(i + 1, len(runs))
    memory = fit_memory(runs, fitted)
    if memory is not None:
        fitted = replace(fitted, framework_overhead_gib=memory.fitted_gib)
    rows_out = tuple(
        RunFit(run, before[i], after[i], left_out[i] if left_out else None,
               max(estimate_run(run, fitted).memory_gib_per_stage))
        for i, run in enumerate(runs)
    )  # fmt: skip
    labels, measured = [r.label for r in runs], [r.measured for r in runs]
    return PriorFit(
        priors=problem.priors, selection=selection, start=cluster, fitted=fitted,
        runs=rows_out, before=fit_error(labels, before, measured),
        after=fit_error(labels, after, measured),
        left_out=fit_error(labels, left_out, measured) if left_out else None,
        memory=memory, converged=converged, message=message,
        covariance_t=tuple(tuple(float(x) for x in row) for row in cov),
    )  # fmt: skip


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


def warning_line(result: PriorFit) -> str:
    """'' when every candidate was fitted, else one line: how many runs for how many
    candidates, what was fitted and what kept at the preset and why."""
    sel = result.selection
    if not sel.dropped:
        return ""
    n, k = len(result.runs), len(result.priors)
    kept = ", ".join(sel.kept) or "nothing"
    why = "; ".join(f"{name}: {reason}" for name, reason in sel.dropped)
    head = "warning: " if n < k else ""
    return f"{head}{n} run(s) for {k} constant(s): fitting {kept}; kept at the preset: {why}"
