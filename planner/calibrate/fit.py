"""Fit the cluster profile's named efficiencies to measured runs, with leave-one-out errors.

The constants a fit may set are `planner.specs.EFFICIENCIES` (each a `ClusterSpec` field with
bounds and a physical meaning). For runs r with measured throughput m_r (tokens/s/GPU, or
TFLOPS/GPU where a run has only that) and the resource model's prediction p_r(theta) on the
cluster with constants theta, the fit solves

    min_theta  sum_r log(p_r(theta) / m_r)^2  +  w^2 sum_k (u_k - u_k0)^2,   theta in bounds

with scipy.optimize.least_squares (trust-region reflective, bounds, finite differences).
Each constant is fitted in unit coordinates u in [0, 1] across its bounds, in log space for
entries marked `log`. The second term (weight w = PRIOR_WEIGHT) is a weak pull toward the
starting values u0 (the cluster's own constants): moving one constant across its whole range
costs as much as a 3% error on one run, so it only decides directions the runs do not
constrain (a constant no run is sensitive to stays where it was). The start is the
cluster's values, so a fit is deterministic.

Errors over runs (ratio = predicted / measured): the geometric mean ratio, the share within
+-15%, the worst run (largest |log ratio|) and the RMS of log ratio. Leave-one-out: for each
run, fit on the others from the same start and predict it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields, replace

import numpy as np
from scipy.optimize import least_squares

from planner.calibrate.runs import Run, estimate_run, predicted_value
from planner.inputs.shown import shown
from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES, ClusterSpec, Efficiency, SpecError

MAX_PARAMS = 8  # the "at most 8 per hardware and software stack"
WITHIN = 0.15  # "within +-15%"
PRIOR_WEIGHT = 0.03
DIFF_STEP = 1e-3  # finite-difference step in unit coordinates
MAX_EVALUATIONS = 60  # residual evaluations per fit (the Jacobian's come on top)
Progress = Callable[[int, int | None], None]


@dataclass(frozen=True)
class FitError:
    """Predicted / measured over a set of runs."""

    runs: int
    geomean: float
    within: float  # share of runs with |ratio - 1| <= WITHIN
    worst: str  # label of the run with the largest |log ratio|
    worst_ratio: float
    rms_log: float


@dataclass(frozen=True)
class RunFit:
    """One run: its predictions before the fit, after it and left out of it."""

    run: Run
    before: float  # in the run's metric, with the starting constants
    after: float  # with the fitted constants
    left_out: float | None  # fitted without this run (None when leave-one-out was not run)
    peak_gib: float  # predicted peak memory of the largest stage, fitted constants


@dataclass(frozen=True)
class FitResult:
    params: tuple[Efficiency, ...]
    start: ClusterSpec
    fitted: ClusterSpec
    runs: tuple[RunFit, ...]
    before: FitError
    after: FitError
    left_out: FitError | None
    converged: bool
    message: str


def derived(cluster: ClusterSpec, names: Sequence[str] | None = None) -> ClusterSpec:
    """`cluster` with the named efficiencies (all of EFFICIENCIES when None) at ClusterSpec's
    defaults: the model as derived, before any fit."""
    defaults = {f.name: f.default for f in fields(ClusterSpec)}
    chosen = [e.name for e in EFFICIENCIES] if names is None else list(names)
    return replace(cluster, **{n: defaults[n] for n in chosen})


def fit_params(names: Sequence[str] | None) -> tuple[Efficiency, ...]:
    """The EFFICIENCIES or TOPOLOGY_EFFICIENCIES entries named (all of EFFICIENCIES when
    None), in the order given; raises SpecError for an unknown or repeated name or more than
    MAX_PARAMS."""
    known = {e.name: e for e in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES)}
    if names is None:
        chosen = tuple(EFFICIENCIES)
    else:
        unknown = [n for n in names if n not in known]
        if unknown:
            raise SpecError(
                f"--params: {shown(unknown[0])} is not a constant a fit may set; choose from "
                f"{', '.join(known)}"
            )
        if len(set(names)) != len(names) or not names:
            raise SpecError("--params: list each constant once, comma-separated (a,b,c)")
        chosen = tuple(known[n] for n in names)
    if len(chosen) > MAX_PARAMS:
        raise SpecError(
            f"--params: {len(chosen)} constants; fit at most {MAX_PARAMS} at once (name them "
            "with --params a,b,c)"
        )
    return chosen


def fit(
    runs: Sequence[Run],
    cluster: ClusterSpec,
    names: Sequence[str] | None = None,
    leave_one_out: bool = True,
    progress: Progress | None = None,
    prior_weight: float = PRIOR_WEIGHT,
) -> FitResult:
    """Fit `names` (default: every EFFICIENCIES entry) to `runs` from `cluster`'s values.

    Args:
        runs: measured runs (planner.calibrate.runs); at least one.
        cluster: the starting profile; its values are the start and the prior's centre.
        leave_one_out: also refit without each run (needs 2 runs) and predict it.
        progress: called with (refits done, refits in all) during leave-one-out.
    Returns:
        FitResult with the fitted cluster, per-run predictions and the errors.
    """
    params = fit_params(names)
    if not runs:
        raise SpecError("no runs to fit; give at least one measured run")
    model = _Model(tuple(runs), cluster, params, prior_weight)
    all_rows = tuple(range(len(runs)))
    u_fit, converged, message = model.solve(all_rows)
    fitted = model.cluster_at(u_fit)
    before = [model.predict(i, model.u0) for i in all_rows]
    after = [model.predict(i, u_fit) for i in all_rows]
    left_out: list[float] | None = None
    if leave_one_out and len(runs) >= 2:
        left_out = []
        for i in all_rows:
            u_i, _, _ = model.solve(tuple(j for j in all_rows if j != i))
            left_out.append(model.predict(i, u_i))
            if progress is not None:
                progress(i + 1, len(runs))
    rows = tuple(
        RunFit(run, before[i], after[i], left_out[i] if left_out else None,
               max(estimate_run(run, fitted).memory_gib_per_stage))
        for i, run in enumerate(runs)
    )  # fmt: skip
    labels = [r.label for r in runs]
    measured = [r.measured for r in runs]
    return FitResult(
        params=params, start=cluster, fitted=fitted, runs=rows,
        before=fit_error(labels, before, measured), after=fit_error(labels, after, measured),
        left_out=fit_error(labels, left_out, measured) if left_out else None,
        converged=converged, message=message,
    )  # fmt: skip


def fit_error(labels: Sequence[str], predicted: Sequence[float], measured: Sequence[float]):
    """FitError of predicted / measured (module docstring)."""
    logs = [math.log(p / m) for p, m in zip(predicted, measured, strict=True)]
    worst = max(range(len(logs)), key=lambda i: abs(logs[i]))
    return FitError(
        runs=len(logs),
        geomean=math.exp(sum(logs) / len(logs)),
        within=sum(abs(math.exp(x) - 1) <= WITHIN for x in logs) / len(logs),
        worst=labels[worst],
        worst_ratio=math.exp(logs[worst]),
        rms_log=math.sqrt(sum(x * x for x in logs) / len(logs)),
    )


def to_unit(e: Efficiency, value: float) -> float:
    """`value` in [0, 1] across e's bounds (log space when e.log), clipped to the bounds."""
    value = min(max(value, e.low), e.high)
    if e.log and e.low > 0:
        return math.log(value / e.low) / math.log(e.high / e.low)
    return (value - e.low) / (e.high - e.low)


def from_unit(e: Efficiency, u: float) -> float:
    """The inverse of to_unit."""
    u = min(max(float(u), 0.0), 1.0)
    if e.log and e.low > 0:
        return e.low * (e.high / e.low) ** u
    return e.low + u * (e.high - e.low)


class _Model:
    """The residuals of one fit problem, with predictions cached by (run, constants): the
    leave-one-out refits share their start and first Jacobian with the full fit."""

    def __init__(self, runs, cluster: ClusterSpec, params, prior_weight: float) -> None:
        self.runs, self.cluster, self.params = runs, cluster, params
        self.prior_weight = prior_weight
        self.u0 = np.array([to_unit(e, getattr(cluster, e.name)) for e in params])
        self._cache: dict[tuple[int, tuple[float, ...]], float] = {}

    def cluster_at(self, u: np.ndarray) -> ClusterSpec:
        """The cluster with the constants at u (the cluster itself at the start)."""
        if np.array_equal(u, self.u0):
            return self.cluster
        values = {e.name: from_unit(e, x) for e, x in zip(self.params, u, strict=True)}
        return replace(self.cluster, **values)

    def predict(self, i: int, u: np.ndarray) -> float:
        key = (i, tuple(float(x) for x in u))
        if key not in self._cache:
            est = estimate_run(self.runs[i], self.cluster_at(u))
            self._cache[key] = predicted_value(self.runs[i], est)
        return self._cache[key]

    def residuals(self, u: np.ndarray, rows: tuple[int, ...]) -> np.ndarray:
        logs = [math.log(max(self.predict(i, u), 1e-300) / self.runs[i].measured) for i in rows]
        return np.concatenate([np.array(logs), self.prior_weight * (u - self.u0)])

    def solve(self, rows: tuple[int, ...]) -> tuple[np.ndarray, bool, str]:
        """Least squares over `rows` from u0: (unit coordinates, converged, message)."""
        sol = least_squares(
            self.residuals, self.u0, bounds=(0.0, 1.0), method="trf", diff_step=DIFF_STEP,
            max_nfev=MAX_EVALUATIONS, args=(rows,),
        )  # fmt: skip
        return np.clip(sol.x, 0.0, 1.0), bool(sol.status > 0), str(sol.message)
