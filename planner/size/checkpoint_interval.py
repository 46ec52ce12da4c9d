"""The checkpoint interval that minimises lost time for one plan, in steps: `piper size`'s
failure model (planner.size.goodput, planner/SIZING.md "Failures") applied to what plan.json
says. `piper run --checkpoint-every` takes it by default, and the Megatron and torchtitan
exports write it as their save interval.

    plan_checkpoint_interval(plan) -> CheckpointInterval (steps, and every input)
    interval_or_reason(plan) -> (CheckpointInterval, "") or (None, why there is none)

Where each input comes from (plan.json carries no failure model):
- failures per GPU-hour, relaunch time, storage GB/s: `piper size`'s defaults (FailureModel:
  Llama 3's 1.97e-5 per GPU-hour, 600 s, 2,000 GB/s), or the FailureModel passed;
- GPUs: the plan's world, pp x dp x tp x cp;
- checkpoint bytes: weights and optimizer state of the plan's model (its embedded config) under
  its training settings with the target's accounting (goodput.state_bytes);
- blocking or async: how the engine saves with the flags Piper writes
  (request.TARGET_CHECKPOINT_MODE), the engine being the one asked for, else the plan's target
  (plan.json extra.target, default piper); an async save's copy to host memory is priced over
  the plan's cluster's host link;
- save seconds: goodput.checkpoint_cost; the step: the plan's predicted step time (a plan
  without one, written by hand, has no interval).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.calibrate.compare import plan_inputs
from planner.plan.schema import Plan
from planner.size.goodput import (
    checkpoint_cost,
    interval_steps,
    job_mtbf_s,
    save_interval_s,
    state_bytes,
)
from planner.size.request import TARGET_CHECKPOINT_MODE, CheckpointMode, FailureModel
from planner.specs import SpecError
from planner.targets import get_target, with_conventions


@dataclass(frozen=True)
class CheckpointInterval:
    """A save every `steps` steps (`interval_s` of training; 0 steps: the job never fails, so
    no interval) and the inputs it follows from."""

    steps: int
    interval_s: float
    step_time_s: float
    per_gpu_hour: float
    gpus: int
    mtbf_s: float
    state_bytes: float
    storage_gbps: float
    mode: CheckpointMode
    save_s: float  # training stopped per save (blocking: the write; async: the copy to host)
    target: str

    def inputs(self) -> str:
        """The interval's inputs on one line, for a log line or an export's comment."""
        return (
            f"sqrt(2 C M) = {self.interval_s:,.0f} s over a {self.step_time_s:.3g} s step: "
            f"C = {self.save_s:.3g} s per {self.mode} save ({self.target}) of "
            f"{_number(self.state_bytes / 1e9)} GB (weights + optimizer state) at "
            f"{_number(self.storage_gbps)} GB/s storage, M = {_number(self.mtbf_s / 3600)} h "
            f"between failures of {self.gpus} GPUs at {self.per_gpu_hour:.3g} per GPU-hour"
        )


def _number(x: float) -> str:
    """3 significant digits, without an exponent from 100 up (6,330, not 6.33e+03)."""
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def plan_checkpoint_interval(
    plan: Plan, failures: FailureModel | None = None, target: str | None = None
) -> CheckpointInterval:
    """The Young/Daly checkpoint interval of `plan`, in steps.

    Args:
        plan: a plan.json read back (planner.plan.load_plan).
        failures: rate, relaunch and storage bandwidth (None: `piper size`'s defaults); its
            `mode` overrides the engine's save mode.
        target: the engine that saves (None: the plan's target).
    Returns:
        CheckpointInterval: steps >= 1 (0 only for a zero failure rate) and its inputs.
    Raises:
        SpecError: the plan has no predicted step time, or its model or cluster cannot be read.
    """
    step_s = plan.predicted.step_time_s
    if not step_s > 0:
        raise SpecError(
            f"plan.json: predicted.step_time_s is {step_s:g}, so no checkpoint interval follows "
            "from it; make the plan with 'piper plan' or give the interval"
        )
    failures = failures or FailureModel()
    engine = get_target(target or str(plan.extra.get("target") or "piper"))
    model, cluster, training, parallel = plan_inputs(plan)
    mode = failures.mode or TARGET_CHECKPOINT_MODE[engine.name]
    state = state_bytes(model, with_conventions(training, engine))
    cost = checkpoint_cost(state, parallel.world, cluster, failures, mode)
    mtbf_s = job_mtbf_s(failures, parallel.world)
    interval_s = save_interval_s(cost, mtbf_s, step_s)
    return CheckpointInterval(
        steps=interval_steps(interval_s, step_s),
        interval_s=interval_s,
        step_time_s=step_s,
        per_gpu_hour=failures.per_gpu_hour,
        gpus=parallel.world,
        mtbf_s=mtbf_s,
        state_bytes=state,
        storage_gbps=failures.storage_gbps,
        mode=mode,
        save_s=cost.blocking_s,
        target=engine.name,
    )


def interval_or_reason(
    plan: Plan, target: str | None = None
) -> tuple[CheckpointInterval | None, str]:
    """(plan_checkpoint_interval at `piper size`'s defaults, "") or (None, the one-line reason
    the plan gives none)."""
    try:
        return plan_checkpoint_interval(plan, target=target), ""
    except SpecError as exc:
        return None, str(exc)
