"""Error bars: each predicted figure's interval, from what the profile's calibration records.

The contract (planner/PROFILING.md, "Error bars", has the numbers):

    intervals(cluster, est, level=0.8, reprice=None) -> Intervals
    interval(value, log_sd, quantile) -> Interval          # one figure
    describe_source(cluster) -> str                        # one line: where the error comes from
    error_model(cluster) -> ErrorModel                     # what the profile records, parsed

**Model.** For a run's throughput, log(measured / predicted) ~ N(0, sigma_time^2); for each
pipeline stage's peak memory, log(measured / predicted) ~ N(0, sigma_mem^2). An interval at
`level` is [x exp(-q sigma), x exp(q sigma)] around the prediction x. Tokens/s, TFLOPS/GPU and
MFU are proportional to one another and step time is tokens per step / tokens/s, so the four
share sigma_time (step time's interval is the reciprocal one); MFU's upper end is held at 1.
No throughput interval is wider than the uncalibrated model's at the same level
(`widest_time_half_width`: x0.59-x1.70 at 80%): the quantile is cut to fit.

**sigma_time** = sqrt(s_loo^2 + g' C g):
- s_loo: the profile's `calibration.loo_rms_log`, the RMS of log(predicted / measured) of its
  calibration runs each predicted by a fit made without it (leave-one-out; the in-sample
  residuals of a fit are optimistic). `piper calibrate --fit` writes it; the committed
  presets that were fitted record it.
- C: the fitted constants' covariance in t_k = log(c_k + a_k) (a_k: planner.calibrate.prior's
  offsets), recorded by `piper calibrate --fit` as `se_<name>` (standard errors) and
  `corr_<a>__<b>` (correlations); g_k = d log(tokens/s) / d t_k of the layout at hand, by
  forward differences (step JACOBIAN_STEP, backward at the upper bound) through `reprice`,
  which prices the same layout on a changed cluster. Without `reprice` or a covariance this
  term is 0. s_loo already holds the constants' error as it showed at the calibration
  layouts; adding g' C g widens the interval for layouts whose prediction leans on a constant
  more than theirs did (a conservative sum, not a split).
- q: the Student-t quantile with `runs` degrees of freedom (s_loo^2 is the mean of `runs`
  squared residuals around 0, so log-error / s_loo of a new run is t-distributed with that
  many under the model), the normal quantile for a default.
A profile fitted from a calibrated start (`piper calibrate --fit` from a preset that records
its own) also records the start's error as `start_runs` and `start_loo_rms_log`; the two are
pooled, s_loo^2 = (n s^2 + n0 s0^2) / (n + n0) with n + n0 runs, the start's runs counting as
evidence of the same model's error (a fit of 1 run, with no leave-one-out of its own, keeps
the start's). A profile with neither (a preset never fitted, or fitted without leave-one-out
from an uncalibrated start) uses DEFAULT_TIME_LOG_SD with the normal quantile, and
describe_source says so.

**sigma_mem**: the profile's `calibration.memory_loo_rms_log` over `memory_runs` (>= 2) runs with
a measured peak (leave-one-out on framework_overhead_gib's fit), else DEFAULT_MEMORY_LOG_SD.

A fit not yet written to YAML gives its profile with
planner.calibrate.prior_report.prior_profile(result, runs_file, date), whose calibration mapping
holds the same keys.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from statistics import NormalDist
from typing import Protocol

import numpy as np

from planner.inputs.shown import shown, shown_text
from planner.plan.schema import Interval, Intervals
from planner.specs import ClusterSpec, SpecError

LEVEL = 0.8
# The uncalibrated model's error: RMS of log(predicted / measured) of ClusterSpec's derived
# constants (no fit) on the 12 H100 published runs, results/published_runs.md ("start ... RMS
# log 0.412"); a preset whose constants nobody fitted is taken to be as wrong as that.
DEFAULT_TIME_LOG_SD = 0.412
# a_k of t_k = log(c_k + a_k) for the constants whose range starts at 0: the scale below
# which the constant barely moves a step (1 ms of host time per layer, a tenth of the overlap,
# 100 us: a few switch traversals of delay).
OFFSETS: dict[str, float] = {
    "layer_overhead_us": 1000.0,
    "overlap_efficiency": 0.1,
    "network_jitter_us": 100.0,
}
# forward-difference step in t of the sensitivities (the fit's Jacobian and the error bars' g)
JACOBIAN_STEP = 0.05
# RMS of log(measured / predicted) peak memory over the default set of
# profiles/runs/memory_runs.csv (current engines, no named model gap: the rows the
# --memory-margin default is set on), results/interval_coverage.md.
DEFAULT_MEMORY_LOG_SD = 0.228
Reprice = Callable[[ClusterSpec], float]  # tokens/s of the same layout on another cluster


class Estimated(Protocol):
    """What `intervals` reads of an estimate (resources.cost.Estimate, search's EstimateView,
    plan.json's Predicted all have it)."""

    tokens_per_s: float
    step_time_s: float
    tflops_per_gpu: float
    mfu: float
    memory_gib_per_stage: Sequence[float]


@dataclass(frozen=True)
class ErrorModel:
    """The error a profile's calibration records (module docstring).

    runs: calibration runs behind time_log_sd (0: the default); memory_runs likewise.
    names / covariance_t: the fitted constants and their covariance in t = log(c + a),
    names x names (empty when the profile records none).
    """

    time_log_sd: float
    runs: int
    memory_log_sd: float
    memory_runs: int
    names: tuple[str, ...] = ()
    covariance_t: tuple[tuple[float, ...], ...] = ()
    start_runs: int = 0  # of `runs`, those of the start profile's record pooled in

    @property
    def calibrated(self) -> bool:
        return self.runs > 0

    def time_quantile(self, level: float = LEVEL) -> float:
        return quantile(level, self.runs or None)

    def memory_quantile(self, level: float = LEVEL) -> float:
        return quantile(level, self.memory_runs or None)


@functools.lru_cache(maxsize=256)
def quantile(level: float, dof: int | None) -> float:
    """The two-sided `level` quantile: Student-t with `dof` degrees of freedom, normal for
    None; raises SpecError for a level outside (0, 1)."""
    if not 0 < level < 1:
        raise SpecError(f"interval level must lie in (0, 1), got {level}; use e.g. 0.8")
    p = 0.5 + level / 2
    if dof is None:
        return NormalDist().inv_cdf(p)
    # scipy.stats.t.ppf's own function (t_gen._ppf), without importing scipy.stats: a second
    from scipy.special import stdtrit

    return float(stdtrit(dof, p))


def widest_time_half_width(level: float = LEVEL) -> float:
    """The widest log half-width a throughput interval at `level` takes: the uncalibrated
    model's (DEFAULT_TIME_LOG_SD at the normal quantile). A calibration that would print a
    wider one (a few runs far apart, a t quantile of 1-2 degrees of freedom) says less than
    no calibration; `piper calibrate --fit` refuses the runs that would need it
    (planner/calibrate/applies.py), so the cap only trims what few runs cannot support."""
    return quantile(level, None) * DEFAULT_TIME_LOG_SD


def interval(value: float, log_sd: float, q: float, level: float = LEVEL) -> Interval:
    """[value exp(-q log_sd), value exp(q log_sd)] around `value`."""
    spread = math.exp(q * log_sd)
    return Interval(value / spread, value, value * spread, level)


def error_model(cluster: ClusterSpec) -> ErrorModel:
    """The profile's recorded error (calibration mapping), defaults where it records none;
    a recorded value that is not a number >= 0 raises SpecError naming the key."""
    cal = dict(cluster.calibration)

    def number(key: str) -> float | None:
        if key not in cal:
            return None
        low, high = (-1.0, 1.0) if key.startswith("corr_") else (0.0, math.inf)
        try:
            x = float(cal[key])
        except ValueError:
            x = math.nan
        if not low <= x < high or (high == 1.0 and x > 1.0):
            rule = "a number in [-1, 1]" if high == 1.0 else "a finite number >= 0"
            raise SpecError(
                f"cluster {cluster.name}: calibration.{shown_text(key)} = {shown(cal[key])} must "
                f"be {rule}; fix the profile or refit it with 'piper calibrate --fit'"
            )
        return x

    own = _recorded(number("loo_rms_log"), number("runs"))
    start = _recorded(number("start_loo_rms_log"), number("start_runs"))
    memory = _recorded(number("memory_loo_rms_log"), number("memory_runs"))
    runs = own[1] + start[1]
    names, cov = _covariance(cluster, number) if runs else ((), ())
    return ErrorModel(
        time_log_sd=math.sqrt((own[1] * own[0] ** 2 + start[1] * start[0] ** 2) / runs)
        if runs
        else DEFAULT_TIME_LOG_SD,
        runs=runs,
        memory_log_sd=memory[0] if memory[1] else DEFAULT_MEMORY_LOG_SD,
        memory_runs=memory[1],
        names=names,
        covariance_t=cov,
        start_runs=start[1],
    )


def _recorded(sd: float | None, runs: float | None) -> tuple[float, int]:
    """(sd, runs) of a recorded leave-one-out error; (0, 0) unless both are there with runs
    >= 2 (one run leaves no leave-one-out)."""
    if sd is None or runs is None or runs < 2:
        return 0.0, 0
    return sd, int(runs)


def _covariance(
    cluster: ClusterSpec, number: Callable[[str], float | None]
) -> tuple[tuple[str, ...], tuple[tuple[float, ...], ...]]:
    """(names, covariance) from `se_<name>` and `corr_<a>__<b>` (0 when absent); a name that
    is not a constant a fit may set raises SpecError."""
    keys = [k[3:] for k, _ in cluster.calibration if k.startswith("se_")]
    if not keys:
        return (), ()
    from planner.calibrate.fit import fit_params  # scipy.optimize: only a fitted profile's

    try:
        names = tuple(e.name for e in fit_params(keys))
    except SpecError as err:
        raise SpecError(f"cluster {cluster.name}: calibration se_<name>: {err}") from None
    se = [number(f"se_{n}") or 0.0 for n in names]
    cov = []
    for i, a in enumerate(names):
        row = []
        for j, b in enumerate(names):
            r = 1.0 if i == j else _first(number(f"corr_{a}__{b}"), number(f"corr_{b}__{a}"))
            row.append(se[i] * se[j] * r)
        cov.append(tuple(row))
    return names, tuple(cov)


def _first(*values: float | None) -> float:
    return next((v for v in values if v is not None), 0.0)


def describe_source(cluster: ClusterSpec, level: float = LEVEL) -> str:
    """One line: where the intervals of `cluster` come from, with the spread at `level`."""
    return _describe(error_model(cluster), bool(cluster.calibration), level)


def _describe(m: ErrorModel, has_calibration: bool, level: float) -> str:
    mq = m.memory_quantile(level)
    half = min(m.time_quantile(level) * m.time_log_sd, widest_time_half_width(level))
    time, memory = math.exp(half), math.exp(mq * m.memory_log_sd)
    if m.calibrated:
        own = m.runs - m.start_runs
        runs = (f"{own} runs pooled with the start profile's {m.start_runs}" if own and m.start_runs
                else f"the start profile's {m.runs} runs (no leave-one-out of its own)"
                if m.start_runs else f"{m.runs} runs")  # fmt: skip
        head = (f"fitted on {runs}, leave-one-out log-error sd {m.time_log_sd:.3f}"
                + (f" and the covariance of {len(m.names)} fitted constant(s)" if m.names
                   else ""))  # fmt: skip
    else:
        what = ("calibration without a leave-one-out error (loo_rms_log)" if has_calibration
                else "preset without calibration")  # fmt: skip
        head = f"{what}: default log-error sd {DEFAULT_TIME_LOG_SD} (planner/PROFILING.md)"
    mem_head = (f"memory: {m.memory_runs} measured peaks, sd {m.memory_log_sd:.3f}"
                if m.memory_runs else f"memory: default sd {DEFAULT_MEMORY_LOG_SD}")  # fmt: skip
    return (f"{head}; {mem_head}; {level:.0%} interval: tokens/s x{1 / time:.2f}-x{time:.2f}, "
            f"memory x{1 / memory:.2f}-x{memory:.2f}")  # fmt: skip


def parameter_log_sd(cluster: ClusterSpec, reprice: Reprice, model: ErrorModel) -> float:
    """sqrt(g' C g): the fitted constants' covariance propagated to log(tokens/s) of the
    layout `reprice` prices (module docstring); 0 without a covariance."""
    if not model.names:
        return 0.0
    from planner.calibrate.fit import fit_params  # scipy.optimize: only a fitted profile's

    base = math.log(reprice(cluster))
    grad = []
    for e in fit_params(model.names):
        name, offset = e.name, OFFSETS.get(e.name, 0.0)
        t0 = math.log(float(getattr(cluster, name)) + offset)
        step = JACOBIAN_STEP if math.exp(t0 + JACOBIAN_STEP) - offset <= e.high else -JACOBIAN_STEP
        value = min(max(math.exp(t0 + step) - offset, e.low), e.high)
        dt = math.log(value + offset) - t0
        if dt == 0:
            grad.append(0.0)
            continue
        grad.append((math.log(reprice(replace(cluster, **{name: value}))) - base) / dt)
    g = np.array(grad)
    return math.sqrt(max(float(g @ np.array(model.covariance_t) @ g), 0.0))


def intervals(
    cluster: ClusterSpec, est: Estimated, level: float = LEVEL, reprice: Reprice | None = None
) -> Intervals:
    """Every figure of `est` with its interval at `level` on `cluster` (module docstring).

    Args:
        cluster: the profile `est` was priced on; its calibration mapping sets the error.
        est: the prediction (tokens_per_s, step_time_s, tflops_per_gpu, mfu,
            memory_gib_per_stage: one GiB value per pipeline stage).
        level: the probability each interval holds the measured value, in (0, 1).
        reprice: tokens/s of the same layout on a changed cluster; adds the fitted constants'
            covariance where the profile records one (omitted: that term is 0).
    Returns:
        Intervals (planner.plan.schema): one Interval per figure and per stage, the sds used
        and describe_source's line.
    """
    m = error_model(cluster)
    param = parameter_log_sd(cluster, reprice, m) if reprice is not None else 0.0
    sigma = math.hypot(m.time_log_sd, param)
    tq, mq = m.time_quantile(level), m.memory_quantile(level)
    if sigma > 0:
        tq = min(tq, widest_time_half_width(level) / sigma)
    mfu = interval(est.mfu, sigma, tq, level)
    return Intervals(
        level=level, source=_describe(m, bool(cluster.calibration), level), time_log_sd=sigma,
        param_log_sd=param, memory_log_sd=m.memory_log_sd,
        tokens_per_s=interval(est.tokens_per_s, sigma, tq, level),
        step_time_s=interval(est.step_time_s, sigma, tq, level),
        tflops_per_gpu=interval(est.tflops_per_gpu, sigma, tq, level),
        mfu=replace(mfu, hi=min(mfu.hi, 1.0)),  # no run exceeds the peak
        memory_gib_per_stage=tuple(interval(x, m.memory_log_sd, mq, level)
                                   for x in est.memory_gib_per_stage),
    )  # fmt: skip


def covariance_items(names: Sequence[str], cov: np.ndarray) -> list[tuple[str, float]]:
    """The calibration mapping's `se_<name>` and `corr_<a>__<b>` entries for covariance `cov`
    of `names` in t = log(c + a), the form error_model reads back."""
    se = np.sqrt(np.clip(np.diag(cov), 0.0, None))
    items = [(f"se_{n}", round(float(s), 6)) for n, s in zip(names, se, strict=True)]
    for i, a in enumerate(names):
        for j in range(i + 1, len(names)):
            r = cov[i, j] / (se[i] * se[j]) if se[i] > 0 and se[j] > 0 else 0.0
            items.append((f"corr_{a}__{names[j]}", round(float(r), 6)))
    return items
