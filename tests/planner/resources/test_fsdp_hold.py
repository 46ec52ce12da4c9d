"""FSDP held unsharded through a step's micro-batches (torchtitan's FSDP2 under torch
pipelining, TrainingSpec.fsdp_hold_unsharded): memory and communication against hand oracles."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.parallel import ParallelConfig
from planner.resources.layer_comm import fsdp_exposed_s, fsdp_gather_s
from planner.resources.layer_cost import layer_costs
from planner.resources.memory import FSDP_HELD_GRAD_BYTES, fsdp_holds_unsharded, state_bytes
from planner.specs import TrainingSpec
from planner.targets import TARGETS, with_conventions
from tests.planner.resources.resource_specs import make_cluster, make_model

PAR = ParallelConfig(pp=2, dp=4, ep=2, num_microbatches=8)


def test_conventions_set_it_for_torchtitan_only():
    base = TrainingSpec(seq_len=32, fsdp=True)
    assert with_conventions(base, TARGETS["torchtitan"]).fsdp_hold_unsharded
    assert not with_conventions(base, TARGETS["megatron"]).fsdp_hold_unsharded
    assert not with_conventions(base, TARGETS["piper"]).fsdp_hold_unsharded
    hold = replace(base, fsdp_hold_unsharded=True)
    assert fsdp_holds_unsharded(hold, PAR)
    assert not fsdp_holds_unsharded(hold, replace(PAR, pp=1, dp=8))  # no pipelining
    assert not fsdp_holds_unsharded(replace(hold, fsdp=False, zero=True), PAR)


def test_state_adds_the_whole_bf16_weights_and_fp32_gradients():
    plain = TrainingSpec(seq_len=32, fsdp=True)
    hold = replace(plain, fsdp_hold_unsharded=True)
    dense, expert = 1000.0, 600.0  # edp = 4 / 2 = 2: FSDP shards the experts too
    a, b = state_bytes(dense, expert, plain, PAR), state_bytes(dense, expert, hold, PAR)
    assert b.weights - a.weights == pytest.approx(2 * (dense + expert))
    assert b.grads - a.grads == pytest.approx(FSDP_HELD_GRAD_BYTES * (dense + expert))
    assert FSDP_HELD_GRAD_BYTES == 4 and b.optimizer == a.optimizer
    whole = replace(PAR, ep=4)  # edp = 1: the experts are whole already, not held again
    a, b = state_bytes(dense, expert, plain, whole), state_bytes(dense, expert, hold, whole)
    assert b.weights - a.weights == pytest.approx(2 * dense)


def test_one_gather_and_one_reduce_scatter_per_step():
    model, cl = make_model(layers=4), make_cluster()
    plain = TrainingSpec(seq_len=32, fsdp=True)
    hold = replace(plain, fsdp_hold_unsharded=True)
    costs = layer_costs(model, cl, plain, PAR, "flat", "torchtitan")
    c = costs[1]
    params = (c.params_dense, c.params_expert)
    work = c.work
    gather, reduce, _ = fsdp_gather_s(cl, plain, PAR, params)
    _, _, total_plain = fsdp_exposed_s(cl, plain, PAR, work, params)
    level, shown, total = fsdp_exposed_s(cl, hold, PAR, work, params)
    assert total_plain == pytest.approx(2 * gather + reduce)  # per micro-batch
    assert total == pytest.approx((gather + reduce) / PAR.num_microbatches) and level
    fwd = sum(w.forward_s for w in work)
    bwd = sum(w.time_s for w in work) - fwd
    m = PAR.num_microbatches
    assert shown == pytest.approx(max(0.0, gather / m - fwd) + max(0.0, reduce / m - bwd))
    # the held layout has no gathered working set: its units are in the state
    held_costs = layer_costs(model, cl, hold, PAR, "flat", "torchtitan")
    assert dict(costs[1].workspace).get("fsdp_gathered", 0.0) > 0
    assert "fsdp_gathered" not in dict(held_costs[1].workspace)
