"""Whether a profile describes the machine its runs came from: the refusals of a fit.

`piper calibrate --fit` moves a profile's named efficiencies within their ranges. That repairs
a profile whose constants are somewhat off; it cannot repair a profile of another machine (a
preset used on hardware it does not describe, a profile measured on an idle machine and runs
on a loaded one), and bending constants to such runs writes a profile whose intervals hold
nothing. `does_not_apply(result)` names the first of three signs, in this order:

1. **Far**: every run lies beyond its 99% predictive interval at the start (the start's
   prediction with its prior uncertainty: planner/calibrate/prior.py's predictive sd) by more
   than FAR_FACTOR. One run that far is an outlier the Student-t likelihood down-weights; all
   of them are the profile.
2. **Unmoved**: the fit moved no constant while a run lies outside its 99% interval at the
   start: nothing within the ranges explains it.
3. **Unpredicted**: after the fit, the runs themselves (geometric mean of predicted /
   measured) or the runs each left out of a fit made on the others are predicted more than
   FAR_FACTOR off: the fitted constants do not carry from one run to the next.

The remedy is the same for all three: measure the machine (`piper profile`), then plan and
fit from that profile.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from planner.calibrate.fit import FitError
from planner.calibrate.uncertainty import quantile

FAR_FACTOR = 2.0  # beyond the 99% interval, or off after the fit, by more than this
FAR_LEVEL = 0.99


@dataclass(frozen=True)
class StartResidual:
    """One run at the start: log(predicted / measured) and its predictive sd."""

    label: str
    log_ratio: float
    predictive_sd: float


def _beyond(r: StartResidual, q: float) -> float:
    """How far (a factor >= 1) the run lies beyond its FAR_LEVEL interval; 1 inside it."""
    return math.exp(max(abs(r.log_ratio) - q * r.predictive_sd, 0.0))


def _ratios(residuals: Sequence[StartResidual]) -> str:
    return ", ".join(f"{math.exp(r.log_ratio):.3g}" for r in residuals)


def does_not_apply(
    start: Sequence[StartResidual],
    dof: int,
    moved: int,
    after: FitError,
    left_out: FitError | None,
) -> str:
    """'' when the fit may be written, else the reason (module docstring), one clause.

    Args:
        start: each run's residual and predictive sd at the start profile.
        dof: the likelihood's degrees of freedom (the t quantile of the 99% interval).
        moved: how many constants the fit moved.
        after / left_out: predicted / measured with the fitted constants, and each run left
            out of the fit (None without leave-one-out).
    """
    if not start:
        return ""
    q = quantile(FAR_LEVEL, dof)
    factors = [_beyond(r, q) for r in start]
    if min(factors) > FAR_FACTOR:
        return (f"every run lies beyond its {FAR_LEVEL:.0%} interval by more than "
                f"x{FAR_FACTOR:g} (predicted / measured {_ratios(start)})")  # fmt: skip
    if moved == 0 and max(factors) > 1.0:
        worst = start[factors.index(max(factors))]
        return (f"the fit moved no constant while {worst.label} lies outside its "
                f"{FAR_LEVEL:.0%} interval (predicted / measured "
                f"{math.exp(worst.log_ratio):.3g})")  # fmt: skip
    for name, err in (
        ("the fitted runs are", after),
        ("the runs, each left out of the fit made on the others, are", left_out),
    ):
        if err is not None and abs(math.log(err.geomean)) > math.log(FAR_FACTOR):
            return (f"after the fit, {name} predicted x{err.geomean:.3g} off (geometric "
                    f"mean of predicted / measured)")  # fmt: skip
    return ""


def refusal_line(reason: str, cluster_name: str, measured_here: bool) -> str:
    """The one line `piper calibrate --fit` ends with when the profile does not apply;
    `measured_here`: the profile came from `piper profile` (then the machine changed, or
    was busy while one of the two was measured)."""
    if measured_here:
        fix = (
            "re-measure it with 'piper profile' on the machine the runs use, with nothing "
            "else running during the profile or the runs, then plan and fit from that profile"
        )
    else:
        fix = (
            "measure the machine with 'piper profile --out PROFILE.yaml', plan with "
            "'--cluster PROFILE.yaml' and fit from that profile"
        )
    return (
        f"the profile {cluster_name!r} does not describe the machine these runs came from: "
        f"{reason}; {fix}; no fitted profile written"
    )
