"""Failures priced: the Young/Daly interval, the wall time over the ideal, Llama 3's scale."""

from __future__ import annotations

import math

import pytest

from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.resources.params import count_params
from planner.size.goodput import (
    CheckpointCost,
    checkpoint_cost,
    goodput,
    state_bytes,
    wall_over_ideal,
    young_daly_interval_s,
)
from planner.size.request import FAILURES_PER_GPU_HOUR, FailureModel
from planner.specs import TrainingSpec

DAY_S = 86400.0


def test_young_daly_interval_is_sqrt_2cm():
    assert young_daly_interval_s(30.0, 3600.0) == pytest.approx(math.sqrt(2 * 30 * 3600), 1e-12)
    assert young_daly_interval_s(2.0, 10_000.0) == pytest.approx(200.0, 1e-12)


def test_the_interval_minimises_the_wall_time():
    c, r, m = 5.0, 600.0, 20_000.0
    best = young_daly_interval_s(c, m)
    at_best = wall_over_ideal(best, c, r, m)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert wall_over_ideal(best * factor, c, r, m) > at_best


def test_wall_over_ideal_by_hand_and_when_failures_outpace_progress():
    # (1 + C / tau) / (1 - (R + tau / 2) / M)
    assert wall_over_ideal(100.0, 10.0, 50.0, 1000.0) == pytest.approx(1.1 / 0.9, 1e-12)
    assert math.isinf(wall_over_ideal(100.0, 10.0, 1000.0, 1000.0))


def test_failure_rate_is_llama3s():
    assert FAILURES_PER_GPU_HOUR == pytest.approx(419 / (16_384 * 54 * 24), 1e-12)
    assert FAILURES_PER_GPU_HOUR == pytest.approx(1.973e-5, 1e-3)


def test_llama3_405b_scale_gives_419_interruptions_and_over_90_percent_effective():
    """405B parameters at 14 B (bf16 weights, fp32 master and moments) saved blocking at 2 TB/s
    on 16,384 GPUs, a 10-minute relaunch: the wall time of 54 days holds 419 interruptions and
    trains more than 90% of it (Llama 3 reports > 90% effective training time)."""
    failures = FailureModel()
    cost = CheckpointCost(405e9 * 14, "blocking", 405e9 * 14 / 2e12, 2.835, 2.835)
    probe = goodput(DAY_S, 16_384, 10.0, cost, failures)
    gp = goodput(54 * DAY_S / probe.wall_over_ideal, 16_384, 10.0, cost, failures)
    assert gp.interruptions == pytest.approx(419, rel=1e-9)
    mtbf = 3600 / (FAILURES_PER_GPU_HOUR * 16_384)
    tau = math.sqrt(2 * 2.835 * mtbf)
    by_hand = (1 + 2.835 / tau) / (1 - (600 + 2.835 + tau / 2) / mtbf)
    assert gp.mtbf_s == pytest.approx(mtbf, 1e-12) and mtbf == pytest.approx(11_124, 1e-3)
    assert gp.interval_s == pytest.approx(tau, 1e-12)
    assert gp.wall_over_ideal == pytest.approx(by_hand, 1e-12)
    assert 0.90 < gp.effective_fraction == pytest.approx(0.924, abs=1e-3)
    assert gp.interval_steps == round(tau / 10.0)


def test_async_saves_block_for_the_host_copy_and_wait_for_the_write():
    cluster = load_cluster("h100")  # PCIe Gen5: 64 GB/s per GPU to the host
    failures = FailureModel(storage_gbps=10.0)
    cost = checkpoint_cost(1e12, 16_384, cluster, failures, "async")
    assert cost.blocking_s == pytest.approx(1e12 / 16_384 / 64e9, 1e-12)
    assert cost.write_s == pytest.approx(100.0, 1e-12)
    gp = goodput(DAY_S, 16_384, 1.0, cost, failures)
    assert young_daly_interval_s(cost.blocking_s, gp.mtbf_s) < 5.0  # below the write time
    assert gp.interval_s == pytest.approx(100.0, 1e-12)
    assert gp.interval_steps == 100
    blocking = checkpoint_cost(1e12, 64, cluster, failures, "blocking")
    assert blocking.blocking_s == pytest.approx(100.0, 1e-12)


def test_no_failures_cost_nothing():
    cost = CheckpointCost(1e12, "blocking", 1.0, 1.0, 1.0)
    gp = goodput(DAY_S, 1024, 2.0, cost, FailureModel(per_gpu_hour=0.0))
    assert gp.wall_over_ideal == 1.0 and gp.interruptions == 0.0


def test_state_bytes_are_weights_and_optimizer_state_of_the_memory_model():
    model = load_model("mixtral-8x7b")
    total = count_params(model).total
    assert state_bytes(model, TrainingSpec()) == pytest.approx(total * (2 + 12), 1e-12)
    bf16_moments = TrainingSpec(optimizer_dtype="bf16")
    assert state_bytes(model, bf16_moments) == pytest.approx(total * (2 + 4 + 4), 1e-12)
