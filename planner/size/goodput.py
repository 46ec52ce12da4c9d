"""Goodput: the wall-clock time a training run takes once failures, restarts and checkpoints
are paid, beside the failure-free (ideal) time.

    state_bytes(model, training) -> bytes a checkpoint holds
    checkpoint_cost(state, gpus, cluster, failures, mode) -> CheckpointCost
    young_daly_interval_s(checkpoint_s, mtbf_s) -> sqrt(2 C M)
    job_mtbf_s(failures, gpus) -> M;  save_interval_s(cost, mtbf_s, step_time_s) -> tau
    interval_steps(interval_s, step_time_s) -> the interval in whole steps
    goodput(ideal_s, gpus, step_time_s, cost, failures) -> Goodput

Model (planner/SIZING.md, "Failures"): failures arrive as a Poisson process at `per_gpu_hour`
per GPU-hour, so a job on N GPUs fails every M = 3600 / (rate N) seconds on average. A save
stops training for C seconds every tau seconds of work; a failure loses the work since the last
save (tau / 2 on average) and the restart R (relaunch + reading the checkpoint back). To first
order the wall time W of `ideal` seconds of work satisfies

    W (1 - (R + tau / 2) / M) tau / (tau + C) = ideal

minimised at tau* = sqrt(2 C M) (J. W. Young, "A first order approximation to the optimum
checkpoint interval", CACM 1974; J. T. Daly, FGCS 2006). An asynchronous save blocks only for
the copy to host memory, but the next save waits for the write to storage, so tau is at least
the write time. Where R + tau / 2 >= M the run never finishes: wall time is infinite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from planner.resources.memory import optimizer_bytes_per_param, weight_bytes_per_param
from planner.resources.offload import host_link
from planner.resources.params import count_params
from planner.size.request import CheckpointMode, FailureModel
from planner.specs import ClusterSpec, ModelSpec, TrainingSpec


@dataclass(frozen=True)
class CheckpointCost:
    """One save: state_bytes written, blocking_s training waits, write_s to storage, read_s to
    load it back at a restart (all at the storage bandwidth but blocking_s under "async")."""

    state_bytes: float
    mode: CheckpointMode
    blocking_s: float
    write_s: float
    read_s: float


@dataclass(frozen=True)
class Goodput:
    """Failures priced for one run: mtbf_s of the job, the save interval (s and steps), the
    restart (s, relaunch + reload), the wall time over the ideal, expected interruptions."""

    mtbf_s: float
    interval_s: float
    interval_steps: int
    restart_s: float
    checkpoint_s: float
    wall_over_ideal: float  # inf when failures outpace progress
    interruptions: float

    @property
    def effective_fraction(self) -> float:
        """Ideal time over wall time: the share of the run that trains."""
        return 1.0 / self.wall_over_ideal


def state_bytes(model: ModelSpec, training: TrainingSpec) -> float:
    """Weights and optimizer state a checkpoint holds, B: every parameter (MTP layers included
    when trained) at the weight bytes plus the master weights and moments of the memory model
    (planner.resources.memory); gradients are not saved."""
    counts = count_params(model)
    mtp = counts.mtp if training.mtp_layers is None or training.mtp_layers > 0 else 0
    per_param = weight_bytes_per_param(training) + optimizer_bytes_per_param(training)
    return float(counts.total + mtp) * per_param


def checkpoint_cost(
    state: float, gpus: int, cluster: ClusterSpec, failures: FailureModel, mode: CheckpointMode
) -> CheckpointCost:
    """Blocking: training waits for the whole write, state / storage bandwidth. Async: training
    waits while each rank copies its share (state / gpus, the deduplicated save plan of
    torch.distributed.checkpoint) to host memory over its host link
    (planner.resources.offload.host_link); the write goes on behind it."""
    write_s = state / (failures.storage_gbps * 1e9)
    if mode == "async":
        blocking_s = state / gpus / (host_link(cluster).link_gbps * 1e9)
    else:
        blocking_s = write_s
    return CheckpointCost(state, mode, blocking_s, write_s, write_s)


def young_daly_interval_s(checkpoint_s: float, mtbf_s: float) -> float:
    """sqrt(2 C M): the first-order optimal time between saves (module docstring)."""
    return math.sqrt(2.0 * checkpoint_s * mtbf_s)


def wall_over_ideal(
    interval_s: float, checkpoint_s: float, restart_s: float, mtbf_s: float
) -> float:
    """W / ideal at save interval tau (module docstring); inf when R + tau / 2 >= M."""
    lost = (restart_s + interval_s / 2.0) / mtbf_s
    if lost >= 1.0:
        return math.inf
    return (1.0 + checkpoint_s / interval_s) / (1.0 - lost)


def job_mtbf_s(failures: FailureModel, gpus: int) -> float:
    """M = 3600 / (rate x gpus), s: the job's mean time between failures (inf at rate 0)."""
    return 3600.0 / (failures.per_gpu_hour * gpus) if failures.per_gpu_hour > 0 else math.inf


def save_interval_s(cost: CheckpointCost, mtbf_s: float, step_time_s: float) -> float:
    """The save interval that minimises the wall time, s: sqrt(2 C M) with C the blocking
    seconds, at least the write time when saves are async, at least one step; inf when the job
    never fails."""
    if math.isinf(mtbf_s):
        return math.inf
    interval_s = young_daly_interval_s(cost.blocking_s, mtbf_s)
    if cost.mode == "async":
        interval_s = max(interval_s, cost.write_s)
    return max(interval_s, step_time_s)


def interval_steps(interval_s: float, step_time_s: float) -> int:
    """`interval_s` in whole steps of `step_time_s`, at least 1 (0: no interval, inf)."""
    return 0 if math.isinf(interval_s) else max(1, round(interval_s / step_time_s))


def goodput(
    ideal_s: float, gpus: int, step_time_s: float, cost: CheckpointCost, failures: FailureModel
) -> Goodput:
    """Failures priced for `ideal_s` seconds of failure-free training on `gpus` GPUs.

    Args:
        ideal_s: training time without failures, s.
        gpus: devices in the job.
        step_time_s: one optimizer step, s (the save interval in steps, at least 1).
        cost: the checkpoint's cost (checkpoint_cost).
        failures: rate per GPU-hour and relaunch time.
    Returns:
        Goodput at the Young/Daly interval (save_interval_s).
    """
    mtbf_s = job_mtbf_s(failures, gpus)
    restart_s = failures.restart_s + cost.read_s
    interval_s = save_interval_s(cost, mtbf_s, step_time_s)
    ratio = 1.0
    if not math.isinf(interval_s):
        ratio = wall_over_ideal(interval_s, cost.blocking_s, restart_s, mtbf_s)
    wall_h = ideal_s * ratio / 3600.0
    return Goodput(
        mtbf_s=mtbf_s,
        interval_s=interval_s,
        interval_steps=interval_steps(interval_s, step_time_s),
        restart_s=restart_s,
        checkpoint_s=cost.blocking_s,
        wall_over_ideal=ratio,
        interruptions=wall_h * gpus * failures.per_gpu_hour,
    )
