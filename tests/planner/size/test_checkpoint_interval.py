"""A plan's checkpoint interval: sqrt(2 C M) in steps, from piper size's failure model."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from planner.inputs.models import load_model
from planner.resources.params import count_params
from planner.size.checkpoint_interval import interval_or_reason, plan_checkpoint_interval
from planner.size.request import FAILURES_PER_GPU_HOUR, STORAGE_GBPS, FailureModel
from planner.specs import SpecError
from tests.planner.outputs.export_plans import make_plan


def with_step(plan, step_time_s: float):
    return replace(plan, predicted=replace(plan.predicted, step_time_s=step_time_s))


def test_blocking_interval_is_sqrt_2cm_in_steps_by_hand():
    """8 GPUs at 1.125 failures per GPU-hour: M = 3600 / 9 = 400 s; the storage bandwidth
    chosen so a save takes C = 2 s; tau = sqrt(2 x 2 x 400) = 40 s = 10 steps of 4 s."""
    plan = with_step(make_plan(), 4.0)
    state = count_params(load_model("tiny-moe-deep")).total * (2 + 12)  # bf16 w, fp32 state
    failures = FailureModel(per_gpu_hour=1.125, storage_gbps=state / 2.0 / 1e9)
    got = plan_checkpoint_interval(plan, failures, target="megatron")
    assert (got.gpus, got.mode, got.target) == (8, "blocking", "megatron")
    assert got.state_bytes == pytest.approx(state, 1e-12)
    assert (got.save_s, got.mtbf_s) == (pytest.approx(2.0, 1e-12), pytest.approx(400.0, 1e-12))
    assert got.interval_s == pytest.approx(40.0, 1e-12)
    assert got.steps == 10
    assert "C = 2 s per blocking save (megatron)" in got.inputs()
    assert "M = 0.111 h between failures of 8 GPUs at 1.12 per GPU-hour" in got.inputs()


def test_defaults_are_piper_sizes_and_the_engine_decides_the_save_mode():
    plan = make_plan()  # priced for the piper target, whose runtime saves asynchronously
    got = plan_checkpoint_interval(plan)
    assert (got.per_gpu_hour, got.storage_gbps) == (FAILURES_PER_GPU_HOUR, STORAGE_GBPS)
    assert (got.mode, got.target) == ("async", "piper")
    mtbf = 3600 / (FAILURES_PER_GPU_HOUR * 8)
    assert got.interval_s == pytest.approx(math.sqrt(2 * got.save_s * mtbf), 1e-12)
    titan = plan_checkpoint_interval(plan, target="torchtitan")
    assert titan.mode == "blocking"
    assert titan.save_s == pytest.approx(titan.state_bytes / (STORAGE_GBPS * 1e9), 1e-12)
    assert titan.steps == max(1, round(math.sqrt(2 * titan.save_s * mtbf) / 1.0))


def test_async_interval_is_at_least_the_write_and_at_least_one_step():
    plan = with_step(make_plan(), 3.0)
    slow = FailureModel(storage_gbps=1e-6)  # the write takes far longer than sqrt(2 C M)
    got = plan_checkpoint_interval(plan, slow)
    assert got.interval_s == pytest.approx(got.state_bytes / 1e3, 1e-12)
    assert got.steps == round(got.interval_s / 3.0)
    fast = FailureModel(per_gpu_hour=1e3, storage_gbps=1e9)  # sqrt(2 C M) << one step
    assert plan_checkpoint_interval(plan, fast, target="megatron").steps == 1


def test_a_plan_without_a_step_time_has_no_interval():
    plan = with_step(make_plan(), 0.0)
    with pytest.raises(SpecError, match="predicted.step_time_s is 0"):
        plan_checkpoint_interval(plan)
    got, why = interval_or_reason(plan)
    assert got is None and "make the plan with 'piper plan'" in why
