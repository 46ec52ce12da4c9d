"""What `piper calibrate --fit` believes before the runs: a run's noise, each constant's prior.

**Noise (the likelihood).** A run's log(predicted / measured) at the true constants is the
model's own error, which no constant absorbs. Its scale sigma is the start profile's
leave-one-out RMS log error (planner.calibrate.uncertainty.error_model: `calibration.loo_rms_log`
over `runs`, pooled with a start's own record), and its shape Student-t with nu = those runs
degrees of freedom: the predictive distribution the error bars use (an RMS of nu residuals
around 0 makes a new residual / sigma t-distributed with nu dof). A profile without a recorded
error uses DEFAULT_RUN_SIGMA with DEFAULT_RUN_DOF. The t likelihood lets a run far off the
prediction pull on the constants less than a Gaussian would: its curvature, the information one
run carries, falls to 0 at |z| = sqrt(nu).

**Priors.** Each constant c_k moves in t_k = log(c_k + a_k) (a_k > 0 only where the range
starts at 0), with a Gaussian prior centred on the start profile's value and sd w_k:
`calibration.prior_sd_<name>` where the profile records one, else DEFAULT_PRIOR_SD (the
statistics below). Constants whose range starts at 0 carry the offset a_k of OFFSETS.

DEFAULT_PRIOR_SD[k] is how far the same constant sits on one fitted stack from another: the
sample sd (n - 1) of t_k over the presets that fitted it independently (h100, gb200-nvl72,
frontier: their profiles/clusters/*.yaml; h200 copies h100 and is not counted; a
value at its bound is where a fit stopped, not an estimate, and is left out), capped at the sd
of a uniform distribution over its bounds in t, (t_high - t_low) / sqrt(12) (what the bounds
alone say); a constant with fewer than two such values takes that cap. It applies when the
start profile was fitted; a start nobody fitted takes the cap for every constant (prior_sds).

| constant | fitted values (at a bound: left out) | spread | cap | sd |
|---|---|---|---|---|
| gemm_efficiency | 0.7918, 0.7914, 0.6723 | 0.0943 | 0.333 | 0.0943 |
| grouped_gemm_half_rows | 1528 (gb200's 8) | - | 1.801 | 1.801 |
| attention_efficiency | 0.8793 (gb200's 0.9; frontier's is assumed) | - | 0.517 | 0.517 |
| hbm_efficiency | (h100's 0.3) | - | 0.348 | 0.348 |
| layer_overhead_us (a = 1000) | 1465, 5919 | 0.730 | 0.879 | 0.730 |
| scale_up_efficiency | (measured, not fitted) | - | 0.348 | 0.348 |
| scale_out_efficiency | (h100's 1.0) | - | 0.465 | 0.465 |
| overlap_efficiency (a = 0.1) | (h100's 1.0) | - | 0.692 | 0.692 |
| network_jitter_us (a = 100) | 2845 (frontier only) | - | 1.795 | 1.795 |
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.calibrate.uncertainty import OFFSETS, error_model
from planner.inputs.shown import shown, shown_text
from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES, ClusterSpec, SpecError

# The pooled leave-one-out RMS log error of the fitted presets, sqrt((12 x 0.087^2 + 6 x
# 0.208^2) / 18) (h100: 12 runs, gb200-nvl72: 6; their calibration blocks,
# results/interval_coverage.md), with their 18 dof.
DEFAULT_RUN_SIGMA = 0.140
DEFAULT_RUN_DOF = 18
DEFAULT_PRIOR_SD: dict[str, float] = {  # module docstring's table
    "gemm_efficiency": 0.0943,
    "grouped_gemm_half_rows": 1.801,
    "attention_efficiency": 0.517,
    "hbm_efficiency": 0.348,
    "layer_overhead_us": 0.730,
    "scale_up_efficiency": 0.348,
    "scale_out_efficiency": 0.465,
    "overlap_efficiency": 0.692,
    "network_jitter_us": 1.795,
}
PRIOR_KEY = "prior_sd_"


@dataclass(frozen=True)
class Likelihood:
    """Student-t noise on log(predicted / measured): scale sigma, nu degrees of freedom."""

    sigma: float
    dof: int
    source: str  # where sigma comes from, for the report

    def psi(self, z: float) -> float:
        """The signed root of the t loss, sign(z) sqrt((nu + 1) log(1 + z^2 / nu)): a least
        squares over psi(r / sigma) maximises the t likelihood (z^2 as nu grows)."""
        nu = self.dof
        return math.copysign(math.sqrt((nu + 1) * math.log1p(z * z / nu)), z)

    def curvature(self, z: float) -> float:
        """d^2 / dz^2 of half the t loss, held at 0 beyond sqrt(nu): the information one run
        at standardised residual z carries (the Laplace approximation's weight)."""
        nu = self.dof
        return max((nu + 1) * (nu - z * z) / (nu + z * z) ** 2, 0.0)

    def weight(self, z: float) -> float:
        """How much a run at z pulls relative to one on the prediction: nu / (nu + z^2)."""
        return self.dof / (self.dof + z * z)


def likelihood_of(cluster: ClusterSpec) -> Likelihood:
    """The noise of runs on `cluster` (module docstring)."""
    model = error_model(cluster)
    if model.calibrated:
        source = f"{cluster.name}'s leave-one-out error over {model.runs} runs"
        return Likelihood(model.time_log_sd, model.runs, source)
    return Likelihood(DEFAULT_RUN_SIGMA, DEFAULT_RUN_DOF,
                      "the fitted presets' pooled leave-one-out error (no record in "
                      f"{cluster.name})")  # fmt: skip


def uniform_sd(name: str) -> float:
    """The sd in t of a uniform distribution over the constant's bounds: what the bounds alone
    say about it."""
    e = next(e for e in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES) if e.name == name)
    a = OFFSETS.get(name, 0.0)
    return (math.log(e.high + a) - math.log(e.low + a)) / math.sqrt(12)


def prior_sds(cluster: ClusterSpec) -> dict[str, float]:
    """Each constant's prior sd in t: DEFAULT_PRIOR_SD (how far one fitted stack sits from
    another) when the start profile's constants were fitted (its calibration records a
    leave-one-out error), uniform_sd when nobody fitted them (datasheet values and
    assumptions carry no such evidence); then the profile's `calibration.prior_sd_<name>`.
    Raises SpecError (one line) for an unknown name or a value that is not a finite
    number > 0."""
    known = {e.name for e in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES)}
    if error_model(cluster).calibrated:
        out = dict(DEFAULT_PRIOR_SD)
    else:
        out = {name: uniform_sd(name) for name in DEFAULT_PRIOR_SD}
    for key, text in cluster.calibration:
        if not key.startswith(PRIOR_KEY):
            continue
        name = key[len(PRIOR_KEY) :]
        if name not in known:
            raise SpecError(
                f"cluster {cluster.name}: calibration.{PRIOR_KEY}{shown_text(name, 30)} is not a "
                f"constant a fit may set; use one of {', '.join(sorted(known))}"
            )
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise SpecError(
                f"cluster {cluster.name}: calibration.{shown_text(key)} = {shown(text)} must be a "
                "number > 0 (the prior sd of log(constant + offset), e.g. 0.1); fix the profile"
            )
        out[name] = value
    return out
