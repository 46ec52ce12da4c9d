"""Live expert migration: decide a new placement, move experts with their state, swap tables.

Every K steps the stage's per-expert token counts (summed over its data-parallel ranks)
feed the planner's migration policy; the stage leader decides and broadcasts, so every EP
group of the stage (all expert-DP replicas) applies the same placement. An expert moves with
its weights, gradients and Adam moments, so the math of training is unchanged.

Two phases: (1) every moved expert is packed (weights, grads, moments) and sent point-to-point
inside the EP group into staging buffers, with a float64 checksum; each receiver verifies
checksum and finiteness; the whole stage agrees (all-reduce MIN of an ok flag). (2) Only when
all agree are the staged slots copied in place and the routing tables swapped; otherwise
nothing changes, so a failure mid-move leaves the old placement intact.

Shape letters: L = MoE layers of the stage, E = experts, T = intervals (steps).
Placements here are in plan EP indices (ep_idx); MoELayer tables hold EP *group* ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from runtime.metrics import ByteCounter
from runtime.model.moe import MoELayer
from runtime.parallel.mesh import Mesh

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigrationDecision:
    """New placement per layer (ep_idx per expert) and the (layer, expert, src, dst) moves."""

    placement_LE: tuple[tuple[int, ...], ...]
    moves: tuple[tuple[int, int, int, int], ...]


def greedy_next_placement(current_LE, load_history_TLE, costs=None, options=None):
    """Stand-in policy: swap the hottest rank's hottest expert with the coldest rank's
    coldest expert while that lowers the hottest rank's load (the paper's greedy swap).

    Args: current_LE: ep_idx per expert per layer. load_history_TLE: tokens [T][L][E].
    Returns a MigrationDecision (moves use layer positions 0..L-1).
    """
    placement, moves = [], []
    for li, current in enumerate(current_LE):
        load_E = [sum(step[li][e] for step in load_history_TLE) for e in range(len(current))]
        table = list(current)
        for _ in range(len(table)):
            ranks = sorted(set(table))
            rank_load = {
                r: sum(load_E[e] for e in range(len(table)) if table[e] == r) for r in ranks
            }
            hot, cold = max(ranks, key=lambda r: (rank_load[r], -r)), min(ranks, key=rank_load.get)
            e_hot = max((e for e in range(len(table)) if table[e] == hot), key=load_E.__getitem__)
            e_cold = min((e for e in range(len(table)) if table[e] == cold), key=load_E.__getitem__)
            delta = load_E[e_hot] - load_E[e_cold]
            if hot == cold or delta <= 0 or rank_load[cold] + delta >= rank_load[hot]:
                break
            table[e_hot], table[e_cold] = cold, hot
        placement.append(tuple(table))
        moves += [
            (li, e, a, b) for e, (a, b) in enumerate(zip(current, table, strict=True)) if a != b
        ]
    return MigrationDecision(tuple(placement), tuple(moves))


def rotate_placement(current_LE, load_history_TLE=None, costs=None, options=None):
    """Test policy: every expert moves to the next EP rank (ep_idx + 1 mod ep)."""
    placement, moves = [], []
    for li, current in enumerate(current_LE):
        ep = max(current) + 1
        table = tuple((r + 1) % ep for r in current)
        placement.append(table)
        moves += [
            (li, e, a, b) for e, (a, b) in enumerate(zip(current, table, strict=True)) if a != b
        ]
    return MigrationDecision(tuple(placement), tuple(moves))


def resolve_policy(name: str) -> Callable:
    """'planner' = planner.migration.api.next_placement (uniform move prices: the runtime
    does not carry the cluster), else the greedy stand-in; 'greedy'; 'rotate' (tests)."""
    if name == "rotate":
        return rotate_placement
    if name == "greedy":
        return greedy_next_placement
    try:
        from planner.migration.api import next_placement
    except ImportError:
        return greedy_next_placement
    return lambda cur, hist, costs=None, opts=None: _adapt(next_placement(cur, hist, costs, opts))


def _adapt(decision) -> MigrationDecision:
    """Accept the planner's decision type (placement_LE, moves of objects or tuples)."""
    placement = tuple(tuple(int(r) for r in row) for row in decision.placement_LE)
    moves = []
    for m in getattr(decision, "moves", ()):
        if isinstance(m, tuple):
            moves.append(tuple(int(v) for v in m[:4]))
        else:
            moves.append((int(m.layer), int(m.expert), int(m.src_rank), int(m.dst_rank)))
    return MigrationDecision(placement, tuple(moves))


def decide(mesh: Mesh, policy: Callable, current_LE, history_TLE) -> MigrationDecision:
    """The stage leader runs the policy; every rank of the stage gets the same decision."""
    box = [None]
    if mesh.me.physical == mesh.stage_ranks[0]:
        try:
            box[0] = policy(current_LE, history_TLE, None, None)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait for this broadcast
            log.warning("migration policy failed (%s); using the greedy swap", exc)
            box[0] = greedy_next_placement(current_LE, history_TLE)
    if len(mesh.stage_ranks) > 1:
        dist.broadcast_object_list(box, src=mesh.stage_ranks[0], group=mesh.stage_group)
    return box[0]


def slot_state_views(moe: MoELayer, optimizer, slot: int) -> list[torch.Tensor]:
    """Views of everything that belongs to one local slot: weights, grads, Adam moments."""
    out = []
    for p in moe.experts.slot_params():
        out.append(p.data[slot])
        out.append(p.grad[slot] if p.grad is not None else torch.zeros_like(p.data[slot]))
        state = optimizer.state.get(p, {}) if optimizer is not None else {}
        out += [state[k][slot] for k in ("exp_avg", "exp_avg_sq") if k in state]
    return out


def pack_views(pieces: list[torch.Tensor]) -> torch.Tensor:
    """One flat fp32 copy of the views (the wire format of a moved expert)."""
    return torch.cat([t.reshape(-1).float() for t in pieces])


def _stage_layer(moe: MoELayer, new_table, mesh: Mesh, optimizer, counter: ByteCounter):
    """Phase 1 for one layer: exchange moved experts into staging buffers; returns (ok, staged)."""
    me = dist.get_rank(mesh.ep_group)
    old, new = moe.rank_of_expert_E.tolist(), list(new_table)
    old_local = [e for e, r in enumerate(old) if r == me]
    size = pack_views(slot_state_views(moe, optimizer, 0)).numel() if old_local else 0
    staged, ops, checks = {}, [], []
    for e in range(len(old)):
        src, dst = old[e], new[e]
        if src == dst or me not in (src, dst):
            continue
        peer = dist.get_global_rank(mesh.ep_group, dst if src == me else src)
        if src == me:
            buf = pack_views(slot_state_views(moe, optimizer, old_local.index(e)))
            csum = buf.double().sum().reshape(1)
            ops += [
                dist.P2POp(dist.isend, buf, peer, mesh.ep_group, 2 * e),
                dist.P2POp(dist.isend, csum, peer, mesh.ep_group, 2 * e + 1),
            ]
            counter.add("migrate", buf.numel() * 4 + 8, peer)
        else:
            dev = moe.experts.w_in.device  # NCCL needs device buffers
            buf = torch.empty(size, device=dev)
            csum = torch.empty(1, dtype=torch.float64, device=dev)
            ops += [
                dist.P2POp(dist.irecv, buf, peer, mesh.ep_group, 2 * e),
                dist.P2POp(dist.irecv, csum, peer, mesh.ep_group, 2 * e + 1),
            ]
            staged[e] = buf
            checks.append((buf, csum))
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    ok = all(
        bool(torch.isfinite(b).all())
        and torch.isclose(b.double().sum(), c[0], rtol=1e-9, atol=1e-6)
        for b, c in checks
    )
    return ok, staged


def _commit_layer(moe: MoELayer, new_table, staged: dict, optimizer, me: int) -> None:
    """Phase 2 for one layer: rebuild the local slots in ascending id order, then swap."""
    old = moe.rank_of_expert_E.tolist()
    old_local = [e for e, r in enumerate(old) if r == me]
    new_local = [e for e, r in enumerate(new_table) if r == me]
    bufs = [
        staged[e]
        if e in staged
        else pack_views(slot_state_views(moe, optimizer, old_local.index(e)))
        for e in new_local
    ]
    for slot, buf in enumerate(bufs):
        offset = 0
        for view in slot_state_views(moe, optimizer, slot):
            n = view.numel()
            view.copy_(buf[offset : offset + n].view_as(view))
            offset += n
    moe.set_placement(new_table)


def apply_migration(
    moes: dict[int, MoELayer],
    tables: dict[int, tuple[int, ...]],
    mesh: Mesh,
    optimizer,
    counter: ByteCounter,
    fail: bool = False,
) -> bool:
    """Move experts to `tables` (layer -> EP group rank per expert); True when switched.

    `fail` injects a verification failure on this rank (tests of the two-phase rule).
    """
    for moe in moes.values():
        for p in moe.experts.slot_params():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
    staged, ok = {}, not fail
    for layer, moe in moes.items():
        try:
            layer_ok, staged[layer] = _stage_layer(moe, tables[layer], mesh, optimizer, counter)
        except (RuntimeError, ValueError) as exc:  # a failed copy: vote no, keep the old slots
            log.warning("migration copy failed on layer %d: %s", layer, exc)
            layer_ok = False
        ok = ok and layer_ok
    device = next(iter(moes.values())).experts.w_in.device
    flag = torch.tensor([1 if ok else 0], device=device)
    if len(mesh.stage_ranks) > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=mesh.stage_group)
    if int(flag) == 0:
        log.warning("migration aborted on stage %d: old placement kept", mesh.me.stage)
        return False
    me = dist.get_rank(mesh.ep_group)
    for layer, moe in moes.items():
        _commit_layer(moe, tables[layer], staged[layer], optimizer, me)
    return True
