"""Communication model: hand-computed collectives, HALO vs flat, the paper's a2a lower bound."""

from __future__ import annotations

import dataclasses

import pytest

from planner.inputs.clusters import load_cluster
from planner.parallel import ParallelConfig
from planner.resources import comm
from planner.resources.layer_cost import layer_cost
from planner.specs import EfficiencyTable, SpecError, TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model


def test_crossings_and_flat_all_to_all_by_hand():
    cl = make_cluster(gpus_per_node=4, nodes=4)  # node 100 GB/s 1 us; NIC 25 GB/s 10 us
    assert cl.msg_overhead_us == 1.0  # the default per-message posting cost o
    parts = comm.crossings(cl, 8)
    assert [(c.level.name, c.fraction, c.peers) for c in parts] == [
        ("node", 3 / 8, 3),
        ("system", 4 / 8, 4),
    ]
    B = 1e6
    node = B * 3 / 8 / 100e9  # 3.75 us on the node links, in parallel with
    nic = B * 4 / 8 / 25e9  # 20 us through the NIC share
    # latency of the slowest level crossed + max(m o, o + t_bw) with m = 7 messages
    want = 10e-6 + max(7 * 1e-6, 1e-6 + max(node, nic))
    assert comm.all_to_all_time_s(cl, 8, B, "flat") == pytest.approx(want)
    assert want == pytest.approx(31e-6)


def test_latency_bound_all_to_all_by_hand():
    """16 ranks on 4 nodes, tiny messages: posting binds, T = latency + m o."""
    cl = make_cluster(gpus_per_node=4, nodes=4)
    B = 16.0
    # flat: 15 messages of 1 us each, then the 10 us network latency
    assert comm.all_to_all_time_s(cl, 16, B, "flat") == pytest.approx(10e-6 + 15e-6)
    # HALO: Phase II posts 3 messages (ends at 10 + 3 us), Phase I 3 more (ends at 1 + 6 us);
    # Phase III starts at max(13, 6) us and posts 3 messages inside the node (1 us latency)
    assert comm.all_to_all_time_s(cl, 16, B, "halo") == pytest.approx(13e-6 + 1e-6 + 3e-6)
    # the overhead is the cluster's msg_overhead_us: without it only the latency is left
    free = dataclasses.replace(cl, msg_overhead_us=0.0)
    assert comm.all_to_all_time_s(free, 16, B, "flat") == pytest.approx(10e-6, rel=1e-3)


def test_halo_by_hand_and_equal_to_flat_inside_a_node():
    cl = make_cluster(gpus_per_node=4, nodes=4)
    B = 1e6
    assert comm.all_to_all_time_s(cl, 4, B, "halo") == comm.all_to_all_time_s(cl, 4, B, "flat")
    # 16 ranks on 4 nodes: Phase II = 3/4 of the bytes over the NIC in 3 packed messages,
    # posted first; Phase I = intra-node a2a of 1/4 of the bytes, its 3 messages posted after
    # Phase II's; Phase III = redistribute the received 3/4 in the node once Phase II arrived.
    o = 1e-6
    t2 = 10e-6 + max(3 * o, o + B * 12 / 16 / 25e9)  # 41 us
    t1 = 1e-6 + max(6 * o, o + B / 4 * 3 / 4 / 100e9)  # 7 us
    t3 = max(t2, 6 * o) + 1e-6 + max(3 * o, o + B * 3 / 4 * 3 / 4 / 100e9)
    assert comm.all_to_all_time_s(cl, 16, B, "halo") == pytest.approx(max(t1, t3))
    assert max(t1, t3) == pytest.approx(48.625e-6)
    # small messages: HALO sends 3 instead of 12 messages per rank over the network
    assert comm.all_to_all_time_s(cl, 16, 1e4, "halo") < comm.all_to_all_time_s(cl, 16, 1e4, "flat")


def test_nic_levels_share_the_nic_and_taper_thins_global_links():
    fr = load_cluster("frontier")
    B = 1e9  # large: bandwidth-bound
    inside_group = comm.all_to_all_time_s(fr, 1024, B, "flat")
    # 1016 of 1024 peers are off-node; all their bytes leave through the 12.5 GB/s NIC share;
    # the farthest level crossed is the group (4 us); the 1023 posts (1 ms) hide behind it
    assert inside_group == pytest.approx(4e-6 + 1e-6 + B * 1016 / 1024 / 12.5e9)
    eight_groups = comm.all_to_all_time_s(fr, 8192, B, "flat")
    # 7/8 of the bytes cross the global links at 0.57 x 12.5 GB/s, which binds before the NIC
    # (0.875 / 0.57 > 1); the system level's 4.5 us latency
    assert eight_groups == pytest.approx(4.5e-6 + 1e-6 + B * 7 / 8 / (0.57 * 12.5e9))


def test_unknown_algorithm_is_a_spec_error():
    with pytest.raises(SpecError, match="flat, halo"):
        comm.all_to_all_time_s(make_cluster(), 8, 1e6, "ring")


def test_a2a_lower_bound_by_hand_and_respected_by_the_model():
    # 4 b s k d / (EP B_NIC) with b the EP group's sequences, d elements x 2 bytes (bf16)
    b_group, s, k, d, ep, nic = 64, 4096, 2, 4096, 64, 50.0
    bound = comm.a2a_lower_bound_s(b_group, s, k, d, ep, nic)
    assert bound == pytest.approx(4 * 64 * 4096 * 2 * 4096 * 2 / (64 * 50e9))
    h100 = load_cluster("h100")  # 50 GB/s NIC per GPU, nodes of 8
    model = make_model(layers=1, d=d, heads=32, experts=64, top_k=k, ffn=1024)
    par = ParallelConfig(pp=1, dp=ep, ep=ep, micro_batch=b_group // ep)
    cost = layer_cost(model, 0, h100, TrainingSpec(seq_len=s), par)
    a2a = dict(cost.comm_s)["a2a_leaf"]
    # only the bytes for other nodes must cross the NIC: (1 - 8/64) of them; each of the four
    # all-to-alls adds the leaf latency (3 us) and one 1 us posting overhead (its 63 posts
    # hide behind the transfer), at the preset's fitted share of the NIC rate
    floor = bound * (1 - 8 / ep)
    eff = h100.scale_out_efficiency
    assert a2a == pytest.approx(floor / eff + 4 * (3e-6 + 1e-6))
    assert a2a >= floor


def test_measured_a2a_and_p2p_tables_are_used():
    tables = (
        EfficiencyTable("a2a_system", (1e3, 1e9), (5.0, 5.0)),
        EfficiencyTable("p2p_system", (1e3, 1e9), (8.0, 8.0)),
    )
    cl = make_cluster(tables=tables)
    t, level, used = comm.a2a_time_s(cl, 8, 1e6, "flat")
    assert (t, level, used) == (pytest.approx(1e6 / 5e9), "system", ("a2a_system",))
    assert comm.a2a_time_s(cl, 8, 1e6, "halo")[2] == ()  # profiler measures the flat one
    t, level, used = comm.p2p_time_s(cl, (0, 4), 2e6)
    assert (t, level, used) == (pytest.approx(2e6 / 8e9), "system", ("p2p_system",))


def test_p2p_and_ring_by_hand():
    cl = make_cluster(gpus_per_node=4, nodes=4)
    assert comm.p2p_time_s(cl, (0, 1), 1e6)[0] == pytest.approx(1e-6 + 1e6 / 100e9)
    assert comm.p2p_time_s(cl, (0, 4), 1e6)[0] == pytest.approx(10e-6 + 1e6 / 25e9)
    t, level = comm.ring_allreduce_s(cl, 4, 4, 1e8)  # ranks 0, 4, 8, 12: across nodes
    assert level == "system"
    assert t == pytest.approx(2 * 3 / 4 * 1e8 / 25e9 + 6 * 10e-6)
    assert comm.ring_allreduce_s(cl, 1, 1, 1e8) == (0.0, "")


def test_tp_collectives_per_layer_count_the_sharded_blocks():
    """Two all-reduce equivalents of b s d (forward + backward) for attention and for each
    TP-sharded MLP; routed experts are not split by TP (sequence parallelism splits their
    tokens), so an MoE layer without shared experts pays for attention only."""
    cl = make_cluster(gpus_per_node=4, nodes=4)
    base = make_model(layers=3, first_dense=1)
    moe = base.layers[1].moe
    shared = dataclasses.replace(moe, num_shared_experts=1, shared_ffn=64)
    layers = (*base.layers[:2], dataclasses.replace(base.layers[2], moe=shared))
    model = dataclasses.replace(base, layers=layers)
    training = TrainingSpec(seq_len=128)
    par = ParallelConfig(pp=1, dp=2, tp=2, ep=4, micro_batch=2)
    one, level = comm.ring_allreduce_s(cl, 2, 1, 2 * 2 * 128 * 64)  # bf16 b s d
    tp_s = [dict(layer_cost(model, i, cl, training, par).comm_s)[f"tp_{level}"] for i in range(3)]
    assert tp_s == [pytest.approx(4 * one), pytest.approx(2 * one), pytest.approx(4 * one)]
