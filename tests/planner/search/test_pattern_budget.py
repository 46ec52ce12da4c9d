"""The expert IP solves of one plan share one --time-limit-s: split evenly over the distinct
load patterns that need a solve (equal loads and ep=1 need none)."""

from __future__ import annotations

from planner.ip.solvers import SolverOptions
from planner.parallel import ParallelConfig
from planner.search.assemble import pattern_options, place
from tests.planner.search.plan_stubs import ToyEvaluator, toy_cluster, toy_model


class RecordingEvaluator(ToyEvaluator):
    def __init__(self) -> None:
        super().__init__()
        self.expert_limits_s: list[float] = []
        self.rank_limits_s: list[float] = []

    def place_experts(self, load_E, ep, options):
        self.expert_limits_s.append(options.time_limit_s)
        assert options.threads == 1
        return super().place_experts(load_E, ep, options)

    def place_ranks(self, par, cluster, allocation, options):
        self.rank_limits_s.append(options.time_limit_s)
        return super().place_ranks(par, cluster, allocation, options)


def test_pattern_options_split_the_limit_and_use_one_thread():
    opts = SolverOptions("cpsat", 12.0, 4, 7)
    assert pattern_options(opts, 3) == SolverOptions("cpsat", 4.0, 1, 7)
    assert pattern_options(opts, 0) == SolverOptions("cpsat", 12.0, 1, 7)


def test_distinct_patterns_share_the_limit_and_the_rank_ip_keeps_it():
    model = toy_model(layers=6, experts=8)  # MoE layers 1..5
    skew_a, skew_b, skew_c = (
        (8, 1, 1, 1, 1, 1, 1, 1),
        (1, 9, 2, 1, 1, 1, 1, 1),
        (3, 3, 1) + (1,) * 5,
    )
    loads = {1: skew_a, 2: skew_b, 3: skew_a, 4: skew_c, 5: (2,) * 8}  # 3 patterns to solve
    evaluator = RecordingEvaluator()
    par = ParallelConfig(pp=1, dp=4, tp=1, ep=4)
    placement = place(
        evaluator, model, par, toy_cluster(), None, loads, SolverOptions(time_limit_s=6.0)
    )
    assert evaluator.expert_limits_s == [2.0, 2.0, 2.0]
    assert evaluator.rank_limits_s == [6.0]
    assert [p.layer for p in placement.experts] == [1, 2, 3, 4, 5]
