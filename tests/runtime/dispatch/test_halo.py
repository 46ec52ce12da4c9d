"""HALO and HALO-dedup equal the flat all-to-all exactly, forward and backward.

Every rank generates every rank's inputs from a seed, so each rank also computes a brute-force
oracle of what it must receive. One launch per world size runs many cases: node-aligned
groups (2 x 2, 2 x 4, 4 x 2), groups that are not node-aligned, subgroups of the world,
uneven splits, ranks with no tokens, ranks that receive nothing and ranks with no experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from runtime.dispatch.flat import FlatAllToAll
from runtime.dispatch.halo import Halo
from runtime.dispatch.halo_cost import HaloCost


@dataclass(frozen=True)
class Case:
    """One dispatch scenario on a group of the world."""

    name: str
    members: tuple[int, ...]  # global ranks of the EP group
    ranks_per_node: int
    tokens: tuple[int, ...]  # T per group rank
    topk: int
    rank_of_expert: tuple[int, ...]
    dim: int = 3
    seed: int = 0
    dtype: torch.dtype = torch.float64


def _inputs(case: Case, src: int):
    """Deterministic tokens and routing of group rank `src` (same on every process)."""
    gen = torch.Generator().manual_seed(1000 * case.seed + src)
    num_experts = len(case.rank_of_expert)
    x_TD = torch.randn(case.tokens[src], case.dim, generator=gen, dtype=case.dtype)
    scores = torch.rand(case.tokens[src], num_experts, generator=gen)
    allowed = torch.tensor([True] * num_experts)
    if case.name.endswith("cold-rank"):  # nobody routes to the last rank's experts
        allowed = torch.tensor([r != len(case.members) - 1 for r in case.rank_of_expert])
    scores[:, ~allowed] = -1.0
    expert_TK = scores.topk(case.topk, dim=1).indices
    return x_TD, expert_TK


def _oracle(case: Case, me: int):
    """Rows my local experts must receive, and the count per local expert (brute force)."""
    rows, counts = [], []
    for expert in range(len(case.rank_of_expert)):
        if case.rank_of_expert[expert] != me:
            continue
        count = 0
        for src in range(len(case.members)):
            x_TD, expert_TK = _inputs(case, src)
            for t in range(x_TD.shape[0]):
                for k in range(case.topk):
                    if int(expert_TK[t, k]) == expert:
                        rows.append(x_TD[t])
                        count += 1
        counts.append(count)
    out = torch.stack(rows) if rows else torch.zeros(0, case.dim, dtype=case.dtype)
    return out, torch.tensor(counts, dtype=torch.long)


def _run_one(dispatcher, case: Case, me: int, rank_of_expert_E: torch.Tensor):
    """dispatch -> per-expert scaling -> combine -> weighted loss -> backward."""
    x_TD, expert_TK = _inputs(case, me)
    x_TD = x_TD.clone().requires_grad_(True)
    out_ND, per_expert_L, handle = dispatcher.dispatch(x_TD, expert_TK, rank_of_expert_E)
    local_E = (rank_of_expert_E == me).nonzero().flatten()
    scale_N = torch.repeat_interleave(local_E.to(case.dtype) + 1.0, per_expert_L)
    y_TKD = dispatcher.combine(out_ND * scale_N[:, None], handle)
    weights_TKD = torch.linspace(-1.0, 2.0, y_TKD.numel(), dtype=case.dtype).reshape(y_TKD.shape)
    (y_TKD * weights_TKD).sum().backward()
    scale_TK1 = expert_TK[:, :, None].to(case.dtype) + 1.0
    expected_y = x_TD.detach()[:, None, :] * scale_TK1
    expected_grad = (weights_TKD * scale_TK1).sum(dim=1)
    return out_ND.detach(), per_expert_L, y_TKD.detach(), x_TD.grad, expected_y, expected_grad


def _gates(case: Case, me: int, shape) -> torch.Tensor:
    return torch.rand(shape, generator=torch.Generator().manual_seed(77 + me), dtype=case.dtype)


def _run_weighted(dispatcher, case: Case, me: int, rank_of_expert_E: torch.Tensor):
    """dispatch -> per-expert scaling -> gate-weighted combine -> loss -> grads of x and gates."""
    x_TD, expert_TK = _inputs(case, me)
    x_TD = x_TD.clone().requires_grad_(True)
    gate_TK = _gates(case, me, expert_TK.shape).requires_grad_(True)
    out_ND, per_expert_L, handle = dispatcher.dispatch(x_TD, expert_TK, rank_of_expert_E)
    local_E = (rank_of_expert_E == me).nonzero().flatten()
    scale_N = torch.repeat_interleave(local_E.to(case.dtype) + 1.0, per_expert_L)
    y_TD = dispatcher.combine(out_ND * scale_N[:, None], handle, gate_TK)
    (
        y_TD * torch.cos(torch.arange(y_TD.numel(), dtype=case.dtype)).reshape(y_TD.shape)
    ).sum().backward()
    return y_TD.detach(), x_TD.grad, gate_TK.grad


def _check_cases(rank: int, world_size: int, cases: list[Case]) -> int:
    checked = 0
    for case in cases:
        group = dist.new_group(list(case.members)) if len(case.members) < world_size else None
        if rank not in case.members:
            continue
        me = case.members.index(rank)
        rank_of_expert_E = torch.tensor(case.rank_of_expert)
        dispatchers = {
            "flat": FlatAllToAll(group, case.ranks_per_node),
            "halo": Halo(group, case.ranks_per_node, direct_below_bytes=0),
            "halo-dedup": Halo(group, case.ranks_per_node, dedup=True, direct_below_bytes=0),
            "halo-direct": Halo(group, case.ranks_per_node, direct_below_bytes=1 << 40),
            "halo-dedup-direct": Halo(group, case.ranks_per_node, True, 1 << 40),
        }
        results = {n: _run_one(d, case, me, rank_of_expert_E) for n, d in dispatchers.items()}
        out, per_expert, y, grad, expected_y, expected_grad = results["flat"]
        oracle_rows, oracle_counts = _oracle(case, me)
        assert torch.equal(out, oracle_rows), f"{case.name}: flat rows differ from oracle"
        assert torch.equal(per_expert, oracle_counts), f"{case.name}: counts"
        assert torch.equal(y, expected_y), f"{case.name}: flat combine"
        assert torch.allclose(grad, expected_grad), f"{case.name}: flat grad"
        for name in ("halo", "halo-dedup", "halo-direct", "halo-dedup-direct"):
            h_out, h_counts, h_y, h_grad, _, _ = results[name]
            assert torch.equal(h_out, out), f"{case.name}: {name} forward != flat"
            assert torch.equal(h_counts, per_expert), f"{case.name}: {name} counts"
            assert torch.equal(h_y, y), f"{case.name}: {name} combine != flat"
            assert torch.equal(h_grad, grad), f"{case.name}: {name} grad != flat"
        weighted = {n: _run_weighted(d, case, me, rank_of_expert_E) for n, d in dispatchers.items()}
        for name, (y_TD, grad_x, grad_gate) in weighted.items():
            flat_y, flat_grad_x, flat_grad_gate = weighted["flat"]
            # The dedup gateway pre-sums a node's rows: same math, another summation order.
            same = torch.allclose if name == "halo-dedup" else torch.equal
            assert same(y_TD, flat_y), f"{case.name}: {name} weighted combine"
            assert same(grad_x, flat_grad_x), f"{case.name}: {name} weighted grad x"
            assert same(grad_gate, flat_grad_gate), f"{case.name}: {name} gate grad"
        flat_y, flat_grad_x, flat_grad_gate = weighted["flat"]
        gate_TK = _gates(case, me, flat_grad_gate.shape)
        assert torch.allclose(flat_y, (expected_y * gate_TK[:, :, None]).sum(1)), case.name
        checked += 1
    return checked


def _cases_4() -> list[Case]:
    return [
        Case("2x2-uneven", (0, 1, 2, 3), 2, (5, 9, 2, 7), 2, (0, 0, 1, 2, 3, 3, 3, 1), seed=1),
        Case("2x2-empty-sender", (0, 1, 2, 3), 2, (6, 0, 4, 3), 2, (3, 2, 1, 0, 0, 1), seed=2),
        Case("2x2-cold-rank", (0, 1, 2, 3), 2, (4, 4, 4, 4), 2, (0, 1, 2, 3, 0, 1, 2, 3), seed=3),
        Case("2x2-expertless-rank", (0, 1, 2, 3), 2, (3, 5, 4, 2), 3, (0, 1, 0, 2, 1, 0), seed=4),
        Case(
            "2x2-top1-float32", (0, 1, 2, 3), 2, (7, 3, 5, 6), 1, (0, 1, 2, 3), 4, 5, torch.float32
        ),
        Case("one-node", (0, 1, 2, 3), 4, (3, 4, 5, 2), 2, (0, 1, 2, 3, 3, 2), seed=6),
        Case("one-rank-per-node", (0, 1, 2, 3), 1, (5, 2, 6, 4), 2, (1, 0, 3, 2, 0), seed=7),
        Case("subgroup-2-nodes", (1, 3), 2, (6, 5), 3, (0, 1, 1, 0, 1), seed=8),
    ]


def _cases_8() -> list[Case]:
    experts16 = tuple(r for r in range(8) for _ in range(2))
    return [
        Case("2x4-uneven", tuple(range(8)), 4, (9, 3, 0, 7, 5, 11, 2, 6), 4, experts16, seed=11),
        Case("4x2-top6", tuple(range(8)), 2, (6, 8, 4, 10, 3, 7, 9, 5), 6, experts16, seed=12),
        Case("2x4-cold-rank", tuple(range(8)), 4, (4,) * 8, 2, tuple(range(8)) * 2, seed=13),
        Case(
            "3-3-2-unaligned", tuple(range(8)), 3, (5, 6, 2, 8, 1, 7, 3, 4), 3, experts16, seed=14
        ),
        Case("subgroup-unaligned", (0, 1, 2, 5), 2, (6, 3, 7, 5), 2, (0, 1, 2, 3, 3, 2), seed=15),
        Case("subgroup-2x2", (4, 5, 6, 7), 2, (5, 4, 6, 3), 2, (2, 3, 0, 1, 1, 0), seed=16),
    ]


@pytest.mark.slow
def test_halo_equals_flat_on_4_ranks(run_distributed):
    checked = run_distributed(_check_cases, 4, _cases_4(), timeout_s=60)
    assert sum(checked) == sum(len(c.members) for c in _cases_4())


@pytest.mark.slow
def test_halo_equals_flat_on_8_ranks(run_distributed):
    checked = run_distributed(_check_cases, 8, _cases_8(), timeout_s=90)
    assert sum(checked) == sum(len(c.members) for c in _cases_8())


def _paths(rank: int, world_size: int) -> dict[str, bool]:
    """Which dispatchers take the direct path on 2 x 4, 4 x 2 and 8 x 1 nodes (large rows)."""
    x_TD = torch.randn(64, 8)
    expert_TK = torch.rand(64, 16).topk(4, dim=1).indices
    rank_of_expert_E = torch.arange(16) // 2
    out = {}
    for rpn in (4, 2, 1):
        for name, dispatcher in {
            "halo": Halo(None, rpn, direct_below_bytes=1),
            "dedup": Halo(None, rpn, dedup=True, direct_below_bytes=1),
            "halo-always": Halo(None, rpn, direct_below_bytes=0),
            "halo-small": Halo(None, rpn, direct_below_bytes=1 << 20),
            # messages dear: the relay's savings win; relays dear: one direct round wins
            "costed-msgs": Halo(None, rpn, direct_below_bytes=1, cost=HaloCost(1.0, 1e3, 1e3)),
            "costed-relay": Halo(None, rpn, direct_below_bytes=1, cost=HaloCost(0.0, 1e-3, 1e3)),
        }.items():
            _, _, handle = dispatcher.dispatch(x_TD, expert_TK, rank_of_expert_E)
            out[f"{name}@{world_size // rpn}x{rpn}"] = handle.exchange.direct
    return out


@pytest.mark.slow
def test_halo_takes_three_phases_only_where_the_relay_can_pay(run_distributed):
    paths = run_distributed(_paths, 8, timeout_s=60)
    assert all(p == paths[0] for p in paths)  # every rank decides the same
    direct = paths[0]
    # two nodes without dedup: same bytes across nodes, same messages -> direct
    assert direct["halo@2x4"] and not direct["dedup@2x4"]
    # four nodes of two: (Q - 2)(g - 1) = 2 messages fewer per rank -> three phases
    assert not direct["halo@4x2"] and not direct["dedup@4x2"]
    # one rank per node: nothing to relay through
    assert direct["halo@8x1"]
    # direct_below_bytes=0 forces the three phases; rows of 32 B stay below 1 MiB -> direct
    assert not any(direct[f"halo-always@{s}"] for s in ("2x4", "4x2", "8x1"))
    assert all(direct[f"halo-small@{s}"] for s in ("2x4", "4x2", "8x1"))
    # with a HaloCost the estimate decides: 4 x 2 saves 2 messages per rank, 2 x 4 none
    assert not direct["costed-msgs@4x2"] and direct["costed-msgs@2x4"]
    assert all(direct[f"costed-relay@{s}"] for s in ("2x4", "4x2", "8x1"))
