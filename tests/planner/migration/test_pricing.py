"""Move pricing by the topology level a move crosses, and the imbalance price."""

from __future__ import annotations

import pytest

from planner.migration.pricing import balanced_expert_s, build_move_costs, expert_bytes
from planner.specs import SpecError
from tests.planner.migration.conftest import tiny_model

EXPERT_PARAMS = 3 * 64 * 128  # gated expert of the tiny model: up, gate, down


def test_expert_bytes_are_16_per_param(model):
    assert expert_bytes(model, 1) == 16 * EXPERT_PARAMS
    assert expert_bytes(model, 0) == 16 * EXPERT_PARAMS  # a dense layer id falls back to MoE
    assert expert_bytes(model, 1, 18) == 18 * EXPERT_PARAMS


@pytest.mark.parametrize(
    ("dst", "level", "gbps", "latency_us"),
    [(1, 0, 200.0, 1.0), (2, 1, 50.0, 2.0), (7, 1, 50.0, 2.0), (8, 2, 25.0, 5.0)],
)
def test_move_seconds_follow_the_link_level(model, cluster, dst, level, gbps, latency_us):
    costs = build_move_costs(model, cluster, [1], [list(range(16))])
    nbytes = 16 * EXPERT_PARAMS
    assert costs.level_LRR[0, 0, dst] == level
    assert costs.move_s_LRR[0, 0, dst] == pytest.approx(nbytes / (gbps * 1e9) + latency_us * 1e-6)
    assert costs.move_s_LRR[0, dst, 0] == costs.move_s_LRR[0, 0, dst]
    assert costs.move_s_LRR[0, 3, 3] == 0.0 and costs.level_LRR[0, 3, 3] == -1


def test_devices_come_from_the_caller(model, cluster):
    # EP ranks 0 and 1 on devices 0 and 9: different nodes, so the move crosses the system
    costs = build_move_costs(model, cluster, [1], [[0, 9]])
    assert costs.level_LRR[0, 0, 1] == 2


def test_balanced_seconds_formula(model, cluster):
    got = balanced_expert_s(model, cluster, 1, steps_per_interval=10, tokens_per_rank_step=1000)
    flops = 10 * 1000 * 2 * 6 * EXPERT_PARAMS  # steps x tokens x top_k x 6 x params
    assert got == pytest.approx(flops / (100.0e12 * 0.5))


def test_non_positive_interval_is_rejected(model, cluster):
    with pytest.raises(SpecError, match="steps-per-interval"):
        build_move_costs(model, cluster, [1], [[0, 1]], steps_per_interval=0)


def test_model_without_moe_is_rejected(cluster):
    dense = tiny_model()
    dense = type(dense)(**{**dense.__dict__, "layers": dense.layers[:1]})
    with pytest.raises(SpecError, match="no MoE layer"):
        expert_bytes(dense, 0)
