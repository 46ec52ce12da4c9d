"""Rank IP: logical-rank convention, and straddling groups vs brute force on tiny allocations."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from planner.inputs.allocation import Allocation, AllocNode, parse_allocation
from planner.ip import rank_ip
from planner.ip.rank_ip import KIND_WEIGHT, LEVEL_WEIGHT, solve_ranks
from planner.ip.solvers import SolverOptions
from planner.parallel import ParallelConfig
from planner.specs import ClusterSpec, DeviceSpec, LevelSpec, SpecError

CPSAT = SolverOptions(backend="cpsat", time_limit_s=10)
CBC = SolverOptions(backend="cbc", time_limit_s=10)


def cluster(
    gpus_per_node: int, nodes_per_switch: int = 4, switches_per_group: int = 2
) -> ClusterSpec:
    g = gpus_per_node
    levels = (
        LevelSpec("node", g, 100.0, 1.0),
        LevelSpec("switch", g * nodes_per_switch, 25.0, 2.0),
        LevelSpec("group", g * nodes_per_switch * switches_per_group, 25.0, 3.0),
        LevelSpec("system", g * 4096, 12.5, 4.0, 0.5),
    )
    dev = DeviceSpec("toy", 64.0, (("bf16", 100.0),), 1000.0)
    return ClusterSpec("toy", dev, g, 4096, 1, 25.0, levels)


def fragmented(sizes: list[int], groups: list[int] | None = None) -> Allocation:
    nodes, k = [], 0
    for s, n in enumerate(sizes):
        for _ in range(n):
            grp = str(groups[s]) if groups else "0"
            nodes.append(AllocNode(f"n{k:03d}", str(s), grp))
            k += 1
    return Allocation(tuple(nodes), "test")


def indices(par: ParallelConfig, r: int) -> dict[str, int]:
    """FORMULATION.md's convention: r = stage*B + j, B = tp*cp*dp,
    j = dp*(cp*tp) + cp*tp + tp; etp = j % etp, ep = (j // etp) % ep, edp = j // (etp*ep)."""
    block = par.tp * par.cp * par.dp
    stage, j = divmod(r, block)
    return {
        "stage": stage,
        "dp": j // (par.cp * par.tp),
        "cp": (j // par.tp) % par.cp,
        "tp": j % par.tp,
        "etp": j % par.etp,
        "ep": (j // par.etp) % par.ep,
        "edp": j // (par.etp * par.ep),
    }


SHARED = {  # a group's ranks share these indices
    "tp": ("stage", "dp", "cp"),
    "cp": ("stage", "dp", "tp"),
    "etp": ("stage", "ep", "edp"),
    "ep": ("stage", "etp", "edp"),
}


def group_members(par: ParallelConfig) -> list[tuple[str, list[int]]]:
    """TP, CP, expert-TP and EP groups and pipeline pairs, straight from the convention."""
    out = []
    for kind, size in (("tp", par.tp), ("cp", par.cp), ("etp", par.etp), ("ep", par.ep)):
        if size > 1:
            groups: dict[tuple, list[int]] = {}
            for r in range(par.world):
                idx = indices(par, r)
                groups.setdefault(tuple(idx[k] for k in SHARED[kind]), []).append(r)
            assert all(len(v) == size for v in groups.values())
            out += [(kind, v) for v in groups.values()]
    block = par.dp * par.tp * par.cp
    out += [("pp", [r, r + block]) for r in range(par.world - block)]
    return out


def placement_cost(par, alloc: Allocation, node_of_rank: list[int]) -> tuple[int, int]:
    """(weighted objective, TP/EP groups over >1 switch) of a rank -> node map."""
    cost, straddling, seen_pp = 0, 0, set()
    for kind, ranks in group_members(par):
        nodes = {node_of_rank[r] for r in ranks}
        sw = {(alloc.nodes[n].group, alloc.nodes[n].switch) for n in nodes}
        grp = {alloc.nodes[n].group for n in nodes}
        if kind == "pp":
            key = tuple(sorted(nodes))
            if key in seen_pp:  # one pair of nodes counts once
                continue
            seen_pp.add(key)
        else:
            cost += KIND_WEIGHT[kind] * LEVEL_WEIGHT["switch"] * (len(sw) > 1)
            straddling += len(sw) > 1
        cost += KIND_WEIGHT[kind] * LEVEL_WEIGHT["group"] * (len(grp) > 1)
    return cost, straddling


def brute_force(par, alloc: Allocation, g: int) -> int:
    """Min objective over every injective map of node-sized rank blocks to nodes."""
    chunks = math.ceil(par.world / g)
    best = math.inf
    for nodes in itertools.permutations(range(len(alloc)), chunks):
        node_of_rank = [nodes[r // g] for r in range(par.world)]
        best = min(best, placement_cost(par, alloc, node_of_rank)[0])
    return best


def check_rows(sol, par: ParallelConfig, g: int) -> None:
    assert [r.rank for r in sol.ranks] == list(range(par.world))
    slots = {(r.node, r.local_rank) for r in sol.ranks}
    assert len(slots) == par.world  # one rank per device
    for r in sol.ranks:
        want = indices(par, r.rank)
        assert (r.stage, r.dp, r.cp, r.tp, r.ep) == tuple(
            want[k] for k in ("stage", "dp", "cp", "tp", "ep")
        )
        assert r.local_rank == r.rank % g


def _random_case(rng: random.Random, folded: bool = False):
    """A tiny fragmented allocation and a layout; `folded`: cp or etp > 1 and often
    ep > dp*tp (the expert mesh folded over tp*cp*dp)."""
    g = rng.choice([1, 2, 4] if folded else [1, 2])
    sizes = [rng.randint(1, 3) for _ in range(rng.randint(2, 3))]
    groups = [rng.randint(0, 1) for _ in sizes]
    alloc = fragmented(sizes, groups)
    max_chunks = min(len(alloc), 5)
    for _ in range(200):
        pp, dp, tp = rng.randint(1, 3), rng.choice([1, 2, 4]), rng.choice([1, 2])
        cp, etp = (rng.choice([1, 2]), rng.choice([1, 2])) if folded else (1, 1)
        world = pp * dp * tp * cp
        if folded and cp == etp == 1 or (tp * cp * dp) % etp:
            continue
        if math.ceil(world / g) <= max_chunks and world > 1:
            eps = [e for e in (1, 2, 4, 8) if (tp * cp * dp) % (etp * e) == 0]
            ep = rng.choice(eps)
            return g, alloc, ParallelConfig(pp=pp, dp=dp, tp=tp, ep=ep, cp=cp, etp=etp)
    return g, alloc, ParallelConfig(pp=2, dp=1)


@pytest.mark.parametrize("folded", [False, True])
@pytest.mark.parametrize("force_ip", [False, True])
def test_rank_ip_equals_brute_force(force_ip, folded, monkeypatch):
    """40 tiny fragmented allocations: IP objective = enumeration; straddle counts add up.
    force_ip disables the greedy-meets-lower-bound shortcut so every case goes to CP-SAT;
    folded layouts have cp or etp = 2 and EP groups over several data-parallel ranks."""
    if force_ip:
        monkeypatch.setattr(rank_ip, "_lower_bound", lambda groups, switches: -1)
    rng = random.Random(21 + folded)
    for _ in range(40):
        g, alloc, par = _random_case(rng, folded)
        sol = solve_ranks(par, cluster(g), alloc, CPSAT)
        check_rows(sol, par, g)
        node_of_rank = [r.node for r in sol.ranks]
        cost, straddling = placement_cost(par, alloc, node_of_rank)
        assert sol.report.status == "OPTIMAL"
        assert cost == brute_force(par, alloc, g) == sol.report.objective
        assert sol.straddling_groups == straddling


def test_thirteen_nodes_three_switches():
    """13 nodes (5+5+3) of 8 GPUs, 6 EP groups of 16 ranks (2 nodes): switches hold 2+2+1
    whole groups, so exactly one group must straddle."""
    par = ParallelConfig(pp=1, dp=96, ep=16)
    for opts in (CPSAT, CBC):
        sol = solve_ranks(par, cluster(8, nodes_per_switch=5), fragmented([5, 5, 3]), opts)
        assert sol.straddling_groups == 1 and sol.groups_total == 6
        assert sol.report.status == "OPTIMAL"
        assert "1 of 6 TP/CP/EP groups straddle" in sol.note
        check_rows(sol, par, 8)


def test_contiguous_allocation_has_no_straddles():
    """64 nodes of 8, EP of 32 ranks (= one 4-node switch), pp=4: nothing straddles, and
    pipeline neighbours stay inside a dragonfly group of 8 switches."""
    par = ParallelConfig(pp=4, dp=128, ep=32)
    sol = solve_ranks(par, cluster(8, 4, 8), None, CPSAT)
    assert sol.straddling_groups == 0 and sol.report.status == "OPTIMAL"
    assert dict(((k, lv), n) for k, lv, n in sol.straddling_by_level)[("pp", "group")] == 0
    check_rows(sol, par, 8)


def test_too_few_nodes_is_a_spec_error():
    with pytest.raises(SpecError, match="allocate more nodes"):
        solve_ranks(ParallelConfig(pp=2, dp=8), cluster(8), fragmented([1]), CPSAT)


def test_allocation_file_round_trip(tmp_path):
    alloc = parse_allocation([{"hostname": "a", "switch": 1}, {"hostname": "b", "switch": 2}])
    sol = solve_ranks(ParallelConfig(pp=2, dp=2), cluster(2), alloc, CPSAT)
    assert sol.hostnames == ("a", "b")
    assert {r.node for r in sol.ranks} == {0, 1}


def test_same_placement_for_any_threads_and_backend():
    par = ParallelConfig(pp=1, dp=96, ep=16)
    alloc = fragmented([5, 5, 3])
    runs = [SolverOptions(threads=1), SolverOptions(threads=2, seed=9), CBC]
    sols = [solve_ranks(par, cluster(8, nodes_per_switch=5), alloc, o) for o in runs]
    assert len({s.ranks for s in sols}) == 1


def test_pipeline_neighbours_share_a_switch_when_they_can():
    """pp=4 stages of one node each on 4-node switches: the whole pipeline on one switch."""
    par = ParallelConfig(pp=4, dp=8, ep=8)
    sol = solve_ranks(par, cluster(8, 4, 2), fragmented([3, 4, 4]), CPSAT)
    counts = {(k, lv): n for k, lv, n in sol.straddling_by_level}
    assert counts[("pp", "switch")] == 0 and counts[("pp", "node")] == 3
    assert len({r.node for r in sol.ranks}) == 4


def test_folded_ep_group_over_cp_and_dp_stays_in_its_node():
    """tp=2 cp=2 dp=2: ep=8 > dp*tp folds over the context-parallel ranks; each stage block
    of 8 ranks is one node of 8, so no TP, CP or EP group leaves its node."""
    par = ParallelConfig(pp=2, dp=2, tp=2, cp=2, ep=8)
    assert par.ep > par.dp * par.tp and par.edp == 1
    sol = solve_ranks(par, cluster(8, 4, 2), None, CPSAT)
    check_rows(sol, par, 8)
    counts = {(k, lv): n for k, lv, n in sol.straddling_by_level}
    assert counts[("ep", "node")] == counts[("cp", "node")] == counts[("tp", "node")] == 0
    assert sol.groups_total == 8 + 8 + 2  # 16 ranks: tp groups of 2, cp groups of 2, ep of 8
    assert {r.cp for r in sol.ranks} == {0, 1}


def test_two_node_ep_groups_take_the_switches_that_hold_them_whole():
    """EP groups of 16 ranks (ep=16 over tp=2, cp=2, dp=4) span 2 nodes of 8; on switches of
    2, 1 and 2 nodes each group sits on a 2-node switch: nothing straddles, as brute force."""
    par = ParallelConfig(pp=2, dp=4, tp=2, cp=2, ep=16)
    alloc = fragmented([2, 1, 2])
    for opts in (CPSAT, CBC):
        sol = solve_ranks(par, cluster(8, nodes_per_switch=2), alloc, opts)
        check_rows(sol, par, 8)
        counts = {(k, lv): n for k, lv, n in sol.straddling_by_level}
        assert counts[("ep", "switch")] == 0 and counts[("ep", "node")] == 2
        assert sol.report.objective == brute_force(par, alloc, 8)
        ep_switches = [
            {alloc.nodes[sol.ranks[r].node].switch for r in ranks}
            for kind, ranks in group_members(par)
            if kind == "ep"
        ]
        assert all(len(s) == 1 for s in ep_switches)
