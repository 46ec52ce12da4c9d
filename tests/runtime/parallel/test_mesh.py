"""Rank coordinates from a plan: the rank IP's convention, node layout, permuted allocations."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.plan.schema import RankPlan
from planner.run.spec import physical_order, run_spec_from_plan
from planner.specs import SpecError
from runtime.parallel.mesh import rank_coords
from tests.runtime.tiny_plans import hand_plan, tiny_model


def _spec(pp, dp, ep, g, ranks=None):
    model = tiny_model()
    plan = hand_plan(model, pp, dp, ep, gpus_per_node=g)
    if ranks is not None:
        plan = replace(plan, ranks=ranks)
    return run_spec_from_plan(plan, model, 1.0, g)


def test_coordinates_follow_the_rank_ip_convention():
    spec = _spec(pp=2, dp=4, ep=2, g=2)
    coords = rank_coords(spec)
    for c in coords:  # identity placement: logical == physical
        assert c.logical == c.physical == c.stage * 4 + c.dp_idx
        assert (c.ep_idx, c.edp_idx) == (c.dp_idx % 2, c.dp_idx // 2)
        assert (c.node, c.local_rank) == divmod(c.physical, 2)
    # an EP group is ep consecutive logical ranks of one stage
    groups = {(c.stage, c.edp_idx): [] for c in coords}
    for c in coords:
        groups[(c.stage, c.edp_idx)].append(c.logical)
    assert sorted(groups.values()) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_permuted_rank_table_maps_processes_by_device_order():
    # the rank IP put logical rank 3 on node 0 and logical rank 1 on node 1
    rows = [
        RankPlan(0, 0, 0, 0, 0, 0, 0),
        RankPlan(3, 0, 1, 1, 1, 0, 1),
        RankPlan(2, 1, 0, 1, 0, 0, 0),
        RankPlan(1, 1, 1, 0, 1, 0, 1),
    ]
    spec = _spec(pp=2, dp=2, ep=2, g=2, ranks=tuple(rows))
    assert spec.logical_of_physical == (0, 3, 2, 1)
    coords = rank_coords(spec)
    assert [(c.stage, c.dp_idx) for c in coords] == [(0, 0), (1, 1), (1, 0), (0, 1)]
    assert [c.node for c in coords] == [0, 0, 1, 1]


def test_rank_table_must_be_a_permutation():
    rows = tuple(RankPlan(r % 3, 0, r, 0, 0, 0, 0) for r in range(4))
    model = tiny_model()
    plan = replace(hand_plan(model, 2, 2, 2), ranks=rows)
    with pytest.raises(SpecError, match="ranks"):
        physical_order(plan)
