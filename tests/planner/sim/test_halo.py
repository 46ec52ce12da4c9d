"""Flow-level all-to-all simulator: hand-computed tiny networks, a per-flow oracle, invariants."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest

from planner.sim.a2a import flow_classes, phase_timings
from planner.sim.fluid import fluid_finish_times, max_min_rates
from planner.sim.halo import simulate_all_to_all
from planner.sim.network import build_network
from planner.sim.routing import dedup_ratio, domain_hit_probability
from planner.specs import ClusterSpec, DeviceSpec, LevelSpec, SpecError

DEV = DeviceSpec("test-gpu", 80.0, (("bf16", 100.0),), 1000.0)


def small_cluster(**kw) -> ClusterSpec:
    """4 devices per node (pairs at 100 GB/s, node at 50), 2 NICs of 10 GB/s, switches of 2
    nodes, a tapered system level."""
    levels = (
        LevelSpec("pair", 2, 100.0, 1.0, kind="infinity-fabric"),
        LevelSpec("node", 4, 50.0, 1.0),
        LevelSpec("switch", 8, 5.0, 2.0, kind="nic"),
        LevelSpec("system", 64, 5.0, 3.0, taper=0.5, kind="dragonfly-global"),
    )
    base = dict(
        name="small",
        device=DEV,
        gpus_per_node=4,
        num_nodes=16,
        nics_per_node=2,
        nic_gbps=10.0,
        levels=levels,
    )
    base.update(kw)
    return ClusterSpec(**base)


def two_by_two() -> ClusterSpec:
    """2 GPUs per node at 100 GB/s, one 10 GB/s NIC per node, a flat network."""
    levels = (LevelSpec("node", 2, 100.0, 0.0), LevelSpec("net", 1024, 10.0, 0.0, kind="nic"))
    return ClusterSpec("2x2", DEV, 2, 512, 1, 10.0, levels)


# ---- the fluid model on networks solved by hand -------------------------------------------


def test_one_link_two_flows_share_it_equally():
    assert max_min_rates(np.array([10.0]), np.array([[1, 1]])).tolist() == [5.0, 5.0]
    # sizes 10 and 30: both at 5 until t=2, then the second alone at 10 for its last 20
    finish = fluid_finish_times(np.array([10.0]), np.array([[1, 1]]), np.array([10.0, 30.0]))
    assert finish == pytest.approx([2.0, 4.0])


def test_star_bottleneck_leaves_the_rest_to_others():
    # hub with links a_up (10), b_down (4), c_down (10); flows a->b and a->c
    cap = np.array([10.0, 4.0, 10.0])
    use = np.array([[1, 1], [1, 0], [0, 1]])
    assert max_min_rates(cap, use) == pytest.approx([4.0, 6.0])


def test_two_level_tree():
    # racks {h0,h1} {h2,h3}, host links 10, rack uplink/downlink 5.
    # f0: h0->h2, f1: h1->h3, f2: h0->h1.  links: h0_out h1_out up0 down1 h1_in h2_in h3_in
    cap = np.array([10, 10, 5, 5, 10, 10, 10.0])
    use = np.array([[1, 0, 1], [0, 1, 0], [1, 1, 0], [1, 1, 0], [0, 0, 1], [1, 0, 0], [0, 1, 0]])
    assert max_min_rates(cap, use) == pytest.approx([2.5, 2.5, 7.5])
    # all 10 bytes: f2 ends at 10/7.5; the uplink keeps f0, f1 at 2.5 -> 4.0
    assert fluid_finish_times(cap, use, np.full(3, 10.0)) == pytest.approx([4.0, 4.0, 4 / 3])


def test_flow_on_no_link_is_unlimited():
    rates = max_min_rates(np.array([1.0]), np.array([[1, 0]]))
    assert rates[0] == 1.0 and np.isinf(rates[1])


# ---- all-to-all on a cluster computed by hand ----------------------------------------------


def test_flat_and_halo_bandwidth_bound_by_hand():
    # 2 nodes x 2 GPUs, B = 4 MB: each rank sends 1 MB to each of the 4 ranks.
    # flat: the NIC carries 2 ranks x 2 remote MB = 4 MB at 10 GB/s -> 400 us
    # HALO: Phase II the same 4 MB on the NIC (400 us), then Phase III 1 MB at 100 GB/s (10 us)
    c = two_by_two()
    flat = simulate_all_to_all(c, 2, 4e6, "flat", overhead_us=0.0)
    halo = simulate_all_to_all(c, 2, 4e6, "halo", overhead_us=0.0)
    assert flat.time_s == pytest.approx(400e-6)
    assert halo.time_s == pytest.approx(410e-6)
    assert flat.bottleneck == "nic_out"
    assert flat.messages_per_rank == 3 and halo.messages_per_rank == 3


def test_overhead_counts_messages():
    # tiny messages: flat posts P-1 = 1023 messages, HALO 1 + 511 + 1
    c = two_by_two()
    flat = simulate_all_to_all(c, 512, 1024, "flat", overhead_us=1.0)
    halo = simulate_all_to_all(c, 512, 1024, "halo", overhead_us=1.0)
    assert flat.messages_per_rank == 1023 and halo.messages_per_rank == 513
    assert flat.time_s == pytest.approx(1023e-6, rel=0.01)
    assert halo.time_s > 512e-6 and flat.time_s / halo.time_s > 1.9


def test_flat_equals_halo_on_one_node():
    c = small_cluster()
    for nbytes in (1e3, 1e6, 1e8):
        flat = simulate_all_to_all(c, 1, nbytes, "flat")
        for algo in ("halo", "halo-dedup"):
            assert simulate_all_to_all(c, 1, nbytes, algo).time_s == pytest.approx(flat.time_s)


@pytest.mark.parametrize("algo", ["flat", "halo", "halo-dedup"])
@pytest.mark.parametrize("nodes", [1, 2, 4, 16])
def test_more_bytes_is_never_faster(algo, nodes):
    c = small_cluster()
    times = [simulate_all_to_all(c, nodes, b, algo).time_s for b in np.geomspace(1e3, 1e9, 13)]
    assert all(b >= a for a, b in itertools.pairwise(times))


def test_more_nodes_of_the_same_per_rank_bytes_not_faster_flat():
    c = small_cluster()
    times = [simulate_all_to_all(c, n, 1e6, "flat").time_s for n in (1, 2, 4, 8, 16)]
    assert all(b >= a for a, b in itertools.pairwise(times))


# ---- the aggregated model against a per-flow oracle ---------------------------------------


def explicit_fluid_s(cluster: ClusterSpec, nodes: int, algo: str, nbytes: float, ratio: float):
    """Per-flow model: every link instance and every (src, dst) flow spelled out."""
    net = build_network(cluster, nodes)
    p, g = net.ranks, net.domain_ranks
    q = p // g
    share = nbytes / p

    def crossing(a: int, b: int) -> int:
        return next(v for v, lv in enumerate(net.levels) if a // lv.reach == b // lv.reach)

    def path(a: int, b: int) -> list[tuple]:
        v = crossing(a, b)
        if net.levels[v].scale_up:
            return [("out", v, a), ("in", v, b)]
        gpn, k = cluster.gpus_per_node, cluster.nics_per_node
        links = [
            ("nic_out", a // gpn, (a % gpn) * k // gpn),
            ("nic_in", b // gpn, (b % gpn) * k // gpn),
        ]
        prev = 1
        for w, lw in enumerate(net.levels[: v + 1]):
            if lw.reach > prev and not lw.scale_up:
                links += [("up", w, a // prev), ("down", w, b // prev)]
            prev = max(prev, lw.reach)
        return links

    caps = {}
    for kind in net.link_kinds():
        caps[kind.name] = kind.capacity_bytes_s

    def cap_of(link: tuple) -> float:
        name = {"out": "egress", "in": "ingress"}.get(link[0], link[0])
        if name in ("egress", "ingress", "up", "down"):
            name = f"{name}:{net.levels[link[1]].name}"
        return caps[name]

    pairs = [(a, b) for a in range(p) for b in range(p) if a != b]
    same = [(a, b) for a, b in pairs if a // g == b // g]
    if algo == "flat":
        phases = {"a2a": [(a, b, share) for a, b in pairs]}
    else:
        rail = [(a, b, g * share * ratio) for a, b in pairs if a // g != b // g and a % g == b % g]
        phases = {
            "I+II": [(a, b, share) for a, b in same] + rail,
            "III": [(a, b, (q - 1) * share) for a, b in same] if q > 1 else [],
        }
    out = {}
    for name, flows in phases.items():
        if not flows:
            out[name] = (0.0, 0.0)
            continue
        links = sorted({lk for a, b, _ in flows for lk in path(a, b)})
        idx = {lk: i for i, lk in enumerate(links)}
        use = np.zeros((len(links), len(flows)))
        for f, (a, b, _) in enumerate(flows):
            for lk in path(a, b):
                use[idx[lk], f] = 1
        finish = fluid_finish_times(
            np.array([cap_of(lk) for lk in links]), use, np.array([s for *_, s in flows])
        )
        rail_f = [f for f, (a, b, _) in enumerate(flows) if a // g != b // g]
        intra_f = [f for f, (a, b, _) in enumerate(flows) if a // g == b // g]
        out[name] = (
            max((finish[f] for f in intra_f), default=0.0),
            max((finish[f] for f in rail_f), default=0.0),
        )
    return out


@pytest.mark.parametrize("nodes", [1, 2, 4])
@pytest.mark.parametrize("algo", ["flat", "halo", "halo-dedup"])
def test_aggregated_model_matches_per_flow_oracle(nodes, algo):
    c = small_cluster()
    nbytes = 3e6
    net = build_network(c, nodes)
    ratio = dedup_ratio(net.ranks, net.domains, 2) if algo == "halo-dedup" else 1.0
    _, phases = phase_timings(net, algo, nbytes, 0.0, ratio)
    oracle = explicit_fluid_s(c, nodes, algo, nbytes, ratio)
    fluid = {ph.name: ph.fluid_s for ph in phases}
    if algo == "flat":
        assert fluid["a2a"] == pytest.approx(max(oracle["a2a"]), rel=1e-9)
    else:
        assert fluid["I"] == pytest.approx(oracle["I+II"][0], rel=1e-9)
        assert fluid["II"] == pytest.approx(oracle["I+II"][1], rel=1e-9)
        assert fluid["III"] == pytest.approx(oracle["III"][0], rel=1e-9)


def test_halo_moves_fewer_network_messages_same_bytes():
    c = small_cluster()
    flat = simulate_all_to_all(c, 8, 1e6, "flat")
    halo = simulate_all_to_all(c, 8, 1e6, "halo")
    nic = {r.algo: next(lv.bytes for lv in r.levels if lv.level == "nic") for r in (flat, halo)}
    assert nic["flat"] == pytest.approx(nic["halo"])
    # 32 ranks: flat 31 messages; HALO 3 (I) + 7 (II) + 3 (III)
    assert flat.messages_per_rank == 31 and halo.messages_per_rank == 13
    net = build_network(c, 8)
    classes = flow_classes(net, "halo", 1e6)
    assert sum(fc.flows_per_device for fc in classes if fc.phase == "II") == 7


# ---- routing model for dedup ---------------------------------------------------------------


@pytest.mark.parametrize("experts,domains,k", [(8, 4, 2), (8, 2, 3), (12, 3, 4), (6, 6, 1)])
def test_domain_hit_probability_by_enumeration(experts, domains, k):
    per = experts // domains
    subsets = list(itertools.combinations(range(experts), k))
    hit = sum(any(e // per == 0 for e in s) for s in subsets) / len(subsets)
    assert domain_hit_probability(experts, domains, k) == pytest.approx(hit)
    distinct = np.mean([len({e // per for e in s}) for s in subsets])
    remote_copies = k * (domains - 1) / domains
    want = (distinct - hit) / remote_copies if domains > 1 else 1.0  # remote distinct / copies
    assert dedup_ratio(experts, domains, k) == pytest.approx(want)


def test_dedup_reduces_network_bytes_and_time_when_bandwidth_bound():
    c = small_cluster()
    halo = simulate_all_to_all(c, 4, 1e8, "halo", topk=8)
    dedup = simulate_all_to_all(c, 4, 1e8, "halo-dedup", topk=8)
    assert 0 < dedup.dedup_ratio < 1
    nic = {r.algo: next(lv.bytes for lv in r.levels if lv.level == "nic") for r in (halo, dedup)}
    assert nic["halo-dedup"] == pytest.approx(nic["halo"] * dedup.dedup_ratio)
    assert dedup.time_s < halo.time_s


def test_bad_inputs_raise_spec_error():
    c = small_cluster()
    with pytest.raises(SpecError, match="--nodes"):
        simulate_all_to_all(c, 17, 1e6)
    with pytest.raises(SpecError, match="--algo"):
        simulate_all_to_all(c, 2, 1e6, "ring")
    with pytest.raises(SpecError, match="--topk"):
        simulate_all_to_all(c, 2, 1e6, "halo-dedup", topk=100, experts=16)
    with pytest.raises(SpecError, match="--topk 0: a token goes to at least 1 expert"):
        simulate_all_to_all(c, 2, 1e6, "halo-dedup", topk=0)
    with pytest.raises(SpecError, match="--experts"):
        simulate_all_to_all(c, 2, 1e6, "halo-dedup", topk=2, experts=7)


def test_result_is_json_serializable_and_deterministic():
    c = small_cluster()
    a = json.dumps(simulate_all_to_all(c, 4, 1e6, "halo").to_dict(), sort_keys=True)
    b = json.dumps(simulate_all_to_all(c, 4, 1e6, "halo").to_dict(), sort_keys=True)
    assert a == b and '"time_s"' in a


# ---- agreement with the planner's analytic model -------------------------------------------


@pytest.mark.parametrize(
    "algo,nodes", [("flat", 2), ("flat", 4), ("flat", 8), ("halo", 2), ("halo", 16), ("halo", 32)]
)
def test_analytic_model_agrees_when_bandwidth_bound(algo, nodes):
    """16 MiB per rank on Frontier: both models are link-bandwidth bound (within 25%)."""
    from planner.inputs.clusters import load_cluster
    from planner.resources.comm import all_to_all_time_s

    c = load_cluster("frontier")
    sim = simulate_all_to_all(c, nodes, 16 * 2**20, algo).time_s
    analytic = all_to_all_time_s(c, nodes * c.gpus_per_node, 16 * 2**20, algo)
    assert analytic == pytest.approx(sim, rel=0.25)


SWEEP_SIZES = (256, 4 * 2**10, 64 * 2**10, 2**20, 16 * 2**20)  # message-bound .. bandwidth-bound


@pytest.mark.parametrize(
    "cluster,nodes", [("frontier", (2, 8, 16, 64, 512)), ("h100", (2, 4, 32, 128))]
)
def test_analytic_model_agrees_with_the_simulator_across_a_sweep(cluster, nodes):
    """The analytic model is the simulator's per-message model in closed form: within 25%
    (planner/SIMULATOR.md) from message-bound to bandwidth-bound sizes, flat and HALO."""
    from planner.inputs.clusters import load_cluster
    from planner.resources.comm import all_to_all_time_s

    c = load_cluster(cluster)
    for n, size, algo in itertools.product(nodes, SWEEP_SIZES, ("flat", "halo")):
        sim = simulate_all_to_all(c, n, size, algo).time_s
        analytic = all_to_all_time_s(c, n * c.gpus_per_node, size, algo)
        assert analytic == pytest.approx(sim, rel=0.25), (n, size, algo)


def test_simulator_default_overhead_is_the_clusters_msg_overhead():
    import dataclasses

    from planner.sim.halo import DEFAULT_OVERHEAD_US

    c = dataclasses.replace(small_cluster(), msg_overhead_us=3.0)
    assert DEFAULT_OVERHEAD_US == small_cluster().msg_overhead_us == 1.0
    default = simulate_all_to_all(c, 8, 1024, "flat")
    assert default.overhead_us == 3.0
    assert default.time_s == simulate_all_to_all(c, 8, 1024, "flat", overhead_us=3.0).time_s
    assert simulate_all_to_all(c, 8, 1024, "flat", overhead_us=1.0).time_s < default.time_s


def test_emulated_network_model_by_hand():
    """4 nodes x 2 ranks at 1000 Mbit/s (125 MB/s per node), no overhead, fast loopback:
    flat sends 6/8 of each rank's bytes off-node; a node's link carries 2 ranks' share."""
    from planner.sim.emulated import predict_dispatch_combine_s

    point = dict(nodes=4, ranks_per_node=2, rate_mbit=1000, topk=8, tokens_per_rank=1024,
                 dim=256, algo="flat")  # fmt: skip
    nbytes = 1024 * 8 * 256 * 4
    want = 2 * (2 * nbytes * 6 / 8) / 125e6  # dispatch + combine
    got = predict_dispatch_combine_s(point, 0.0, loopback_gbps=1e6, latency_us=0.0)
    assert got == pytest.approx(want, rel=1e-6)


def test_host_profile_model_by_hand_and_alpha_recovered():
    """Link time of the headline point (4 x 2, 1000 Mbit/s, top-8, 2048 tokens) by hand, plus
    alpha x host time; fit_alpha recovers the alpha that generated the 'measurements'."""
    from planner.sim.emulated import fit_alpha, predict_with_host_profile

    point = dict(nodes=4, ranks_per_node=2, rate_mbit=1000, topk=8, tokens_per_rank=2048,
                 dim=256, algo="flat")  # fmt: skip
    nbytes = 2048 * 8 * 256 * 4
    link = 2 * (2 * nbytes * 6 / 8) / 125e6 + 2 * 50e-6  # + one 50 us latency per exchange
    assert predict_with_host_profile(point, 0.3, 0.5) == pytest.approx(link + 0.15, rel=1e-6)
    # a HALO point that took the direct path is simulated as the flat exchange
    direct = {**point, "algo": "halo", "path": "direct"}
    assert predict_with_host_profile(direct, 0.3, 0.5) == pytest.approx(link + 0.15, rel=1e-6)
    points = []
    for tokens, host in ((256, 0.04), (1024, 0.12), (2048, 0.27)):
        p = {**point, "tokens_per_rank": tokens}
        p["median_s"] = predict_with_host_profile(p, host, 0.62)
        points.append((p, host))
    assert fit_alpha(points) == pytest.approx(0.62)


def test_cli_json_has_time_and_breakdown(capsys):
    from planner.cli import main
    from planner.cli.a2a_sim import parse_bytes

    assert parse_bytes("64KiB") == 65536 and parse_bytes("1.5MiB") == 1.5 * 2**20
    assert parse_bytes("2000") == 2000 and parse_bytes("1MB") == 1e6
    args = ["a2a-sim", "--cluster", "frontier", "--nodes", "16", "--bytes-per-rank", "64KiB"]
    assert main([*args, "--algo", "halo", "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["algo"] == "halo" and one["time_s"] > 0 and one["messages_per_rank"] == 29
    assert {lv["level"] for lv in one["levels"]} >= {"package", "node", "switch", "nic"}
    assert main([*args, "--json"]) == 0
    allj = json.loads(capsys.readouterr().out)
    res = allj["results"]
    assert allj["ratios"]["flat_over_halo"] == pytest.approx(
        res["flat"]["time_s"] / res["halo"]["time_s"]
    )
    assert main(args) == 0
    assert "flat_over_halo_dedup:" in capsys.readouterr().out


def test_shared_host_link_is_crossed_by_every_flow():
    """An emulation on one machine: with a host link of H bytes/s every flow shares, a flat
    all-to-all of B per rank over P ranks takes P (P-1) B/P / H when the host is the bottleneck."""
    from planner.sim.a2a import phase_timings

    c = two_by_two()
    net = build_network(c, 2, host_bytes_s=1e6)  # 1 MB/s: far below every link
    _, phases = phase_timings(net, "flat", 4e6, 0.0)
    assert phases[0].fluid_s == pytest.approx(4 * 3 * 1e6 / 1e6)
    _, halo = phase_timings(net, "halo", 4e6, 0.0)
    # HALO moves more bytes in total (Phase III forwards), so on a CPU-bound host it is slower
    assert max(p.end_s for p in halo) > phases[0].end_s
