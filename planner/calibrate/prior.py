"""A fit that cannot overfit silently: the posterior of the constants given a few runs.

`piper calibrate --fit` fits a team's few runs with this module (planner/calibrate/fit.py's
plain least squares stays the fit of the presets on the published runs). For runs r with
measured throughput m_r and the candidate constants c_k (planner.specs.EFFICIENCIES, or
--params), each moved in t_k = log(c_k + a_k), the fit maximises the posterior

    sum_r -log t_nu(log(p_r / m_r) / s_r)  +  sum_k (t_k - t0_k)^2 / (2 w_k^2)

(planner/calibrate/likelihood.py: sigma and nu from the start profile's leave-one-out error,
w_k the prior sd, t0_k the start profile's value) within each constant's bounds, with
scipy.optimize.least_squares on the signed roots of the terms. The fitted constants S are the
ones the runs identify; the others stay at the start, and their prior uncertainty joins each
run's noise: s_r^2 = sigma^2 + sum_{k not in S} J_rk^2 w_k^2 (J_rk = d log p_r / d t_k at the
start, forward differences of JACOBIAN_STEP; the linearised marginal over the unfitted
constants, cross-run correlation left out). The step is the posterior mode: shrunk toward the
start by the prior, and a run far off the prediction pulls less (Student-t).

**Which constants (identifiability).** With H_S = J_S' diag(kappa_r / s_r^2) J_S + diag(1 /
w_S^2) (kappa_r: the t likelihood's curvature at run r's standardised residual at the start,
0 for a run beyond sqrt(nu)), constant k's posterior sd is sqrt((H_S^-1)_kk). Greedily, the
constant whose posterior sd falls furthest below its prior sd joins S, while every member of
S keeps a posterior sd at most SHRINK = 1/sqrt(2) of its prior's (the runs carry at least as
much information about it as the prior does) and S has fewer than max_fitted(runs) members.
A constant no run moves (RMS column below MIN_ELASTICITY) is named as such.

**Outliers.** A run whose residual at the start lies outside the OUTLIER_LEVEL predictive
interval, |r| / sqrt(sigma^2 + sum_k J_rk^2 w_k^2) above the t quantile, is reported with its
weight nu / (nu + z^2) at the fit (1 for a run on the prediction); the t likelihood is what
down-weights it.

**Covariance** (planner/calibrate/uncertainty.py reads it from the fitted profile): the
Laplace approximation at the fit, H_S^-1 with J and kappa evaluated there.

Memory (runs with a measured peak): framework_overhead_gib, separately
(planner/calibrate/memory_fit.py); time constants do not change memory.

Leave-one-out: for each run, the selection and the fit are redone on the others and the run is
predicted; for memory, framework_overhead_gib is refitted without each run's peak.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import numpy as np
from scipy.optimize import least_squares

from planner.calibrate.applies import StartResidual, does_not_apply
from planner.calibrate.fit import FitError, RunFit, fit_error, fit_params
from planner.calibrate.likelihood import OFFSETS, Likelihood, likelihood_of, prior_sds
from planner.calibrate.memory_fit import MemoryFit, fit_memory
from planner.calibrate.runs import Run, estimate_run, predicted_value
from planner.calibrate.uncertainty import JACOBIAN_STEP, quantile
from planner.specs import ClusterSpec, Efficiency, SpecError

MIN_ELASTICITY = 0.01  # RMS d log p / d t below this: no run sees the constant
SHRINK = 1 / math.sqrt(2)  # posterior sd / prior sd at most this: the runs identify it
OUTLIER_LEVEL = 0.95  # a run outside this predictive interval at the start is reported
MAX_EVALUATIONS = 80
Progress = Callable[[int, int | None], None]


def max_fitted(runs: int) -> int:
    """The most constants `runs` runs may set: one fewer than the runs (one with one run), so
    every fit keeps a run's worth of residual to judge it by."""
    return max(1, runs - 1)


@dataclass(frozen=True)
class Prior:
    """One constant's prior: the start's value, the sd and offset of its log scale."""

    efficiency: Efficiency
    value: float
    width: float  # prior sd of t = log(c + offset)
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
    shrink: tuple[tuple[str, float], ...] = ()  # posterior sd / prior sd, kept ones at the fit


@dataclass(frozen=True)
class Outlier:
    """A run outside the predictive interval at the start, and its weight at the fit."""

    label: str
    z: float  # residual at the start / predictive sd
    weight: float  # nu / (nu + z^2) at the fit


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
    likelihood: Likelihood
    covariance_t: tuple[tuple[float, ...], ...] = ()  # selection.kept x kept, in t units
    outliers: tuple[Outlier, ...] = ()
    start_residuals: tuple[StartResidual, ...] = ()  # each run at the start, predictive sd

    @property
    def moved(self) -> int:
        """How many constants the fit moved off the start."""
        return sum(getattr(self.fitted, p.name) != getattr(self.start, p.name) for p in self.priors)

    def does_not_apply(self) -> str:
        """'' when the fitted profile may be written, else why the start profile does not
        describe the runs' machine (planner/calibrate/applies.py)."""
        return does_not_apply(self.start_residuals, self.likelihood.dof, self.moved,
                              self.after, self.left_out)  # fmt: skip


def priors_of(cluster: ClusterSpec, names: Sequence[str] | None) -> tuple[Prior, ...]:
    """The candidates' priors: the cluster's values, sds (likelihood.prior_sds) and offsets."""
    sds = prior_sds(cluster)
    out = []
    for e in fit_params(names):
        value = min(max(float(getattr(cluster, e.name)), e.low), e.high)
        out.append(Prior(e, value, sds[e.name], OFFSETS.get(e.name, 0.0)))
    return tuple(out)


class _Problem:
    """Predictions of the runs at constants t (cached), for one set of candidate priors."""

    def __init__(self, runs: Sequence[Run], cluster: ClusterSpec, priors: tuple[Prior, ...],
                 noise: Likelihood) -> None:  # fmt: skip
        self.runs, self.cluster, self.priors, self.noise = tuple(runs), cluster, priors, noise
        self.t0 = np.array([p.t(p.value) for p in priors])
        self.widths = np.array([p.width for p in priors])
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
        return np.column_stack(cols) if cols else np.zeros((len(rows), 0))

    def run_sd(self, jac: np.ndarray, idx: Sequence[int]) -> np.ndarray:
        """s_r: sigma with the prior variance of the constants outside `idx` (docstring)."""
        out = [k for k in range(len(self.priors)) if k not in idx]
        spread = (jac[:, out] ** 2) @ (self.widths[out] ** 2) if out else np.zeros(len(jac))
        return np.sqrt(self.noise.sigma**2 + spread)

    def information(self, jac: np.ndarray, z: np.ndarray, idx) -> np.ndarray:
        """H_S for the constants `idx`, runs at standardised residuals z: the runs'
        curvature-weighted J'J plus the prior's."""
        sd = self.run_sd(jac, idx)
        kappa = np.array([self.noise.curvature(x) for x in z])
        cols = jac[:, list(idx)]
        return cols.T @ (cols * (kappa / sd**2)[:, None]) + np.diag(1 / self.widths[list(idx)] ** 2)

    def shrinks(self, jac: np.ndarray, z: np.ndarray, idx) -> np.ndarray:
        """Posterior sd / prior sd of each constant in `idx`, the others unfitted."""
        cov = np.linalg.inv(self.information(jac, z, idx))
        return np.sqrt(np.diag(cov)) / self.widths[list(idx)]

    def prior_z(self, rows: Sequence[int], jac: np.ndarray) -> np.ndarray:
        """Each run's residual at the start over its prior predictive sd (every candidate
        unfitted): how far off the start's prediction it lies."""
        sd = self.run_sd(jac, [])
        return np.array([self.log_ratio(i, self.t0) / s for i, s in zip(rows, sd, strict=True)])

    def covariance(self, rows: Sequence[int], kept: Sequence[str], t: np.ndarray) -> np.ndarray:
        """The kept constants' covariance in t at the fit t: H_S^-1 (Laplace)."""
        idx = [k for k, p in enumerate(self.priors) if p.name in kept]
        if not idx:
            return np.zeros((0, 0))
        jac = self.jacobian(rows, at=t)
        sd = self.run_sd(jac, idx)
        z = np.array([self.log_ratio(i, t) / s for i, s in zip(rows, sd, strict=True)])
        return np.linalg.inv(self.information(jac, z, idx))

    def select(self, rows: Sequence[int]) -> Selection:
        """The identifiable constants over `rows` (module docstring)."""
        jac = self.jacobian(rows)
        z = self.prior_z(rows, jac)
        rms = np.linalg.norm(jac, axis=0) / math.sqrt(len(rows))
        names = [p.name for p in self.priors]
        alone = {k: float(self.shrinks(jac, z, [k])[0]) for k in range(len(names))}
        kept: list[int] = []
        cap = max_fitted(len(rows))
        while len(kept) < cap:
            fits = {}
            for k in set(range(len(names))) - set(kept):
                ratios = self.shrinks(jac, z, [*kept, k])
                if rms[k] >= MIN_ELASTICITY and max(ratios) <= SHRINK:
                    fits[k] = ratios[-1]
            if not fits:
                break
            kept.append(min(fits, key=lambda k: (fits[k], k)))
        joint = self.shrinks(jac, z, kept) if kept else []
        dropped = []
        for k in range(len(names)):
            if k not in kept:
                collinear = max(self.shrinks(jac, z, [*kept, k])) if kept else alone[k]
                dropped.append((names[k], _why(k, names, kept, rms[k], alone[k], collinear,
                                               len(rows), cap)))  # fmt: skip
        return Selection(
            tuple(names[k] for k in sorted(kept)), tuple(dropped),
            tuple((n, float(x)) for n, x in zip(names, rms, strict=True)),
            tuple((names[k], float(r)) for k, r in zip(kept, joint, strict=True)),
        )  # fmt: skip

    def solve(self, rows: Sequence[int], kept: Sequence[str]) -> tuple[np.ndarray, bool, str]:
        """The posterior mode over `rows`, moving only `kept`."""
        idx = [k for k, p in enumerate(self.priors) if p.name in kept]
        if not idx:
            return self.t0.copy(), True, "nothing to fit"
        sd = self.run_sd(self.jacobian(rows), idx)
        low = np.array([self.priors[k].t_bounds[0] for k in idx])
        high = np.array([self.priors[k].t_bounds[1] for k in idx])

        def full(x: np.ndarray) -> np.ndarray:
            t = self.t0.copy()
            t[idx] = x
            return t

        def residuals(x: np.ndarray) -> np.ndarray:
            t = full(x)
            data = [self.noise.psi(self.log_ratio(i, t) / s) for i, s in zip(rows, sd, strict=True)]
            return np.concatenate([np.array(data), (x - self.t0[idx]) / self.widths[idx]])

        x0 = np.clip(self.t0[idx], low, high)
        sol = least_squares(residuals, x0, bounds=(low, high), method="trf",
                            diff_step=1e-3, max_nfev=MAX_EVALUATIONS)  # fmt: skip
        return full(np.clip(sol.x, low, high)), bool(sol.status > 0), str(sol.message)

    def fit_rows(self, rows: Sequence[int]) -> tuple[Selection, np.ndarray, bool, str]:
        selection = self.select(rows)
        t, converged, message = self.solve(rows, selection.kept)
        return selection, t, converged, message

    def outliers(self, rows: Sequence[int], t_fit: np.ndarray) -> tuple[Outlier, ...]:
        """Runs outside the OUTLIER_LEVEL predictive interval at the start (docstring)."""
        q = quantile(OUTLIER_LEVEL, self.noise.dof)
        out = []
        for i, z in zip(rows, self.prior_z(rows, self.jacobian(rows)), strict=True):
            if abs(z) > q:
                w = self.noise.weight(self.log_ratio(i, t_fit) / self.noise.sigma)
                out.append(Outlier(self.runs[i].label, float(z), w))
        return tuple(out)


def _why(k, names, kept, rms: float, alone: float, joint: float, runs: int, cap: int) -> str:
    """Why constant k stays at the start (module docstring): `alone` / `joint` are its
    posterior sd / prior sd fitted by itself / with the kept ones."""
    if rms < MIN_ELASTICITY:
        return f"no run's prediction moves with it (elasticity {rms:.3f} < {MIN_ELASTICITY})"
    if alone > SHRINK:
        return (f"the runs would shrink its sd only to {alone:.2f} of the prior's (fitted at "
                f"<= {SHRINK:.2f})")  # fmt: skip
    if len(kept) >= cap:
        return f"{runs} run(s) set at most {cap} constant(s)"
    after = ", ".join(names[j] for j in kept)
    return (f"moves the runs' predictions as {after} do (collinear: fitted together, a sd "
            f"would shrink only to {joint:.2f} of its prior's)")  # fmt: skip


def fit_with_prior(
    runs: Sequence[Run],
    cluster: ClusterSpec,
    names: Sequence[str] | None = None,
    leave_one_out: bool = True,
    progress: Progress | None = None,
) -> PriorFit:
    """Fit the identifiable constants among `names` (default all EFFICIENCIES) to `runs`:
    the posterior mode from `cluster`'s values (module docstring); framework_overhead_gib
    from measured peaks. Raises SpecError for no runs or a bad prior in the profile."""
    if not runs:
        raise SpecError("no runs to fit; give at least one measured run")
    problem = _Problem(runs, cluster, priors_of(cluster, names), likelihood_of(cluster))
    rows = tuple(range(len(runs)))
    selection, t_fit, converged, message = problem.fit_rows(rows)
    fitted = problem.cluster_at(t_fit)
    cov = problem.covariance(rows, selection.kept, t_fit)
    before = [math.exp(problem.log_ratio(i, problem.t0)) * runs[i].measured for i in rows]
    start_sd = problem.run_sd(problem.jacobian(rows), [])
    start = tuple(StartResidual(runs[i].label, problem.log_ratio(i, problem.t0), float(start_sd[i]))
                  for i in rows)  # fmt: skip
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
        likelihood=problem.noise, outliers=problem.outliers(rows, t_fit), start_residuals=start,
    )  # fmt: skip


def covariance_at(
    runs: Sequence[Run], cluster: ClusterSpec, names: Sequence[str]
) -> tuple[tuple[str, ...], np.ndarray]:
    """The Laplace covariance in t of `names` at `cluster`'s own constants, nothing refitted:
    H^-1 over `runs` with every named constant fitted (a preset fitted elsewhere records it
    with `piper calibrate --fit ... --covariance-only`)."""
    if not runs:
        raise SpecError("no runs to compute the covariance on; give at least one measured run")
    problem = _Problem(runs, cluster, priors_of(cluster, names), likelihood_of(cluster))
    kept = tuple(p.name for p in problem.priors)
    return kept, problem.covariance(tuple(range(len(runs))), kept, problem.t0)


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
