"""HALO-dedup in the resource model: Phase II's bytes x the dedup ratio, in three of the
layer's four all-to-alls (the runtime's directions: tests/runtime/dispatch/
test_halo_dedup_directions.py)."""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest

from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.parallel import ParallelConfig
from planner.resources import comm, traffic
from planner.resources.cost import estimate
from planner.resources.layer_comm import layer_comm
from planner.resources.layer_cost import layer_cost
from planner.sim.halo import simulate_all_to_all
from planner.sim.routing import dedup_ratio as routing_dedup_ratio
from planner.specs import TrainingSpec


def test_dedup_ratio_is_the_routing_models_for_the_domains_the_group_spans():
    frontier = load_cluster("frontier")  # local domain: a node of 8 GCDs
    for domains, experts, k in itertools.product((2, 4, 8, 16), (16, 64, 256), (1, 2, 6, 8)):
        want = routing_dedup_ratio(experts, domains, k)
        got = comm.dedup_ratio(frontier, 8 * domains, experts, k)
        assert got == pytest.approx(want, rel=1e-12), (domains, experts, k)
    assert comm.dedup_ratio(frontier, 8, 64, 8) == 1.0  # one node: nothing crosses
    # ep ranks etp = 2 apart: 4 members per node, so 16 members span 4 nodes
    assert comm.dedup_ratio(frontier, 16, 64, 6, 2) == pytest.approx(routing_dedup_ratio(64, 4, 6))


def _enumerated_ratio(members: int, per_domain: int, experts: int, k: int) -> float:
    """Brute force: every source member, every top-k draw of the experts (spread evenly over
    the members, in member order); unique remote domains hit over remote copies."""
    domain_of_expert = [(e * members // experts) // per_domain for e in range(experts)]
    unique = copies = 0
    for src in range(members):
        home = src // per_domain
        for draw in itertools.combinations(range(experts), k):
            remote = [domain_of_expert[e] for e in draw if domain_of_expert[e] != home]
            unique += len(set(remote))
            copies += len(remote)
    return unique / copies


def test_dedup_ratio_of_groups_that_leave_a_domain_part_full():
    """12 ranks on 8-GPU nodes are a node and a half: the ratio counts each domain's own
    experts (the routing model's equal domains cannot say)."""
    h100 = load_cluster("h100")  # local domain: a node of 8
    for members, experts, k in ((12, 12, 2), (12, 24, 3), (20, 20, 4), (10, 20, 2)):
        want = _enumerated_ratio(members, 8, experts, k)
        assert comm.dedup_ratio(h100, members, experts, k) == pytest.approx(want, rel=1e-12)
    assert comm.dedup_ratio(h100, 12, 60, 4) < 0.6  # dedup pays on the half-full node too


@pytest.mark.parametrize(("cluster", "nodes"), [("frontier", (2, 8, 64)), ("h100", (2, 16))])
def test_analytic_halo_dedup_agrees_with_the_simulator(cluster, nodes):
    """The closed form against the flow-level simulator's HALO-dedup (planner/sim/a2a.py:
    Phase II x the same ratio), message-bound to bandwidth-bound, within 10% (the flat and
    HALO forms keep 25%: tests/planner/sim/test_halo.py)."""
    c = load_cluster(cluster)
    for n, size in itertools.product(nodes, (4 * 2**10, 2**20, 16 * 2**20)):
        sim = simulate_all_to_all(c, n, size, "halo-dedup", topk=8)
        ratio = comm.dedup_ratio(c, n * c.gpus_per_node, sim.experts, 8)
        assert ratio == pytest.approx(sim.dedup_ratio)
        analytic = comm.all_to_all_time_s(c, n * c.gpus_per_node, size, "halo-dedup", 1, ratio)
        assert analytic == pytest.approx(sim.time_s, rel=0.10), (n, size)
    # bandwidth-bound across nodes: dedup moves fewer bytes than HALO, and is faster
    big = 64 * 2**20
    ratio = comm.dedup_ratio(c, 2 * c.gpus_per_node, 2 * c.gpus_per_node, 8)
    halo = comm.all_to_all_time_s(c, 2 * c.gpus_per_node, big, "halo")
    dedup = comm.all_to_all_time_s(c, 2 * c.gpus_per_node, big, "halo-dedup", 1, ratio)
    assert ratio < 1 and dedup < halo


def _setup(top_k: int = 6):
    model = load_model("deepseek-v2-lite")  # 64 experts, top-6
    moe_layer = next(i for i, ly in enumerate(model.layers) if ly.moe is not None)
    if top_k != model.layers[moe_layer].moe.top_k:
        layers = tuple(
            replace(ly, moe=replace(ly.moe, top_k=top_k)) if ly.moe else ly for ly in model.layers
        )
        model = replace(model, layers=layers)
    training = TrainingSpec(seq_len=4096, global_batch=64)
    parallel = ParallelConfig(pp=1, dp=32, ep=32, micro_batch=1, num_microbatches=2)
    return model, moe_layer, load_cluster("h100"), training, parallel


def test_a_layer_prices_three_deduplicated_all_to_alls_and_one_per_choice():
    model, i, cl, tr, par = _setup()
    layer = model.layers[i]
    nbytes = traffic.a2a_bytes(model, layer, tr, par)
    ratio = routing_dedup_ratio(64, 4, 6)  # 32 ranks = 4 nodes of 8
    t_dedup, level, _ = comm.a2a_time_s(cl, 32, nbytes, "halo-dedup", 1, ratio)
    t_halo, _, _ = comm.a2a_time_s(cl, 32, nbytes, "halo")
    assert t_dedup < t_halo
    work = layer_cost(model, i, cl, tr, par, "halo-dedup").work
    lc = layer_comm(model, layer, cl, tr, par, "halo-dedup", work)
    assert dict(lc.exposed)[f"a2a_{level}"] == pytest.approx(3 * t_dedup + t_halo)
    # recompute repeats the forward pair: dispatch and combine, both deduplicated
    assert lc.repeat_full_s == pytest.approx(2 * t_dedup)
    assert lc.repeat_moe_s == pytest.approx(2 * t_dedup)
    plain = layer_comm(model, layer, cl, tr, par, "halo", work)
    assert dict(plain.exposed)[f"a2a_{level}"] == pytest.approx(4 * t_halo)
    assert plain.repeat_full_s == pytest.approx(2 * t_halo)


def test_dedup_is_faster_across_nodes_and_equal_where_nothing_repeats():
    model, _, cl, tr, par = _setup()
    dedup = estimate(model, cl, tr, par, dispatcher="halo-dedup")
    halo = estimate(model, cl, tr, par, dispatcher="halo")
    assert dedup.step_time_s < halo.step_time_s
    assert dedup.memory_gib_per_stage == halo.memory_gib_per_stage
    top1 = _setup(top_k=1)
    one = estimate(top1[0], cl, tr, par, dispatcher="halo-dedup")
    assert one.step_time_s == pytest.approx(
        estimate(top1[0], cl, tr, par, dispatcher="halo").step_time_s
    )
    inside = replace(par, dp=8, ep=8, num_microbatches=8)  # one node: no Phase II
    assert estimate(model, cl, tr, inside, dispatcher="halo-dedup").step_time_s == pytest.approx(
        estimate(model, cl, tr, inside, dispatcher="halo").step_time_s
    )
