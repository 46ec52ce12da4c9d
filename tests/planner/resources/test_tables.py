"""Measured efficiency tables: log-linear interpolation, clamping, and estimate() reporting."""

from __future__ import annotations

import math

import pytest

from planner.parallel import ParallelConfig
from planner.resources.cost import estimate
from planner.resources.tables import interpolate, lookup
from planner.specs import EfficiencyTable, TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model


def test_interpolation_is_linear_in_log_x_and_clamped():
    t = EfficiencyTable("gemm_bf16", (1.0, 100.0, 1e4), (0.0, 10.0, 30.0))
    assert interpolate(t, 10.0) == pytest.approx(5.0)  # log-midpoint of 1 and 100
    assert interpolate(t, 1e3) == pytest.approx(20.0)
    x = 37.0
    assert interpolate(t, x) == pytest.approx(10.0 * math.log(x) / math.log(100.0))
    assert interpolate(t, 100.0) == 10.0
    assert interpolate(t, 0.5) == 0.0 and interpolate(t, 1e9) == 30.0  # clamped


def test_lookup_missing_table_is_none():
    assert lookup(make_cluster(), "gemm_bf16", 10.0) is None


def test_estimate_reports_the_tables_it_used():
    model = make_model(layers=2)
    par = ParallelConfig(pp=2, dp=8, ep=8, micro_batch=1, num_microbatches=2)
    tr = TrainingSpec(seq_len=64)
    assert estimate(model, make_cluster(), tr, par).used_measured_tables == ()
    tables = (
        EfficiencyTable("gemm_bf16", (1.0, 1e6), (10.0, 50.0)),
        EfficiencyTable("a2a_system", (1.0, 1e9), (1.0, 20.0)),
        EfficiencyTable("p2p_system", (1.0, 1e9), (1.0, 20.0)),
        EfficiencyTable("attention_fp16", (1.0, 1e6), (1.0, 1.0)),  # other dtype: unused
    )
    est = estimate(model, make_cluster(tables=tables), tr, par)
    assert est.used_measured_tables == ("a2a_system", "gemm_bf16", "p2p_system")
    slower = estimate(
        model,
        make_cluster(tables=(EfficiencyTable("gemm_bf16", (1.0, 1e6), (1.0, 1.0)),)),
        tr,
        par,
    )
    assert slower.step_time_s > est.step_time_s
