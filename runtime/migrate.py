"""Live expert migration: ask the planner for a new placement, move experts with their state.

Every K steps the stage's per-expert token counts (summed over its data-parallel ranks)
feed the planner's migration policy (`planner.migration.next_placement`), priced from the
plan's cluster; the stage leader asks and broadcasts, so every EP group of the stage (all
expert-DP replicas) applies the same placement. An expert moves with its weights, gradients
and Adam moments, so the math of training is unchanged.

Two phases: (1) every moved expert is packed (weights, grads, moments) and sent point-to-point
inside the EP group into staging buffers, with a float64 checksum; each receiver verifies
checksum and finiteness; the whole stage agrees (all-reduce MIN of an ok flag). (2) Only when
all agree are the staged slots copied in place and the routing tables swapped; otherwise
nothing changes, so a failure mid-move leaves the old placement intact.

Shape letters: L = MoE layers of the stage, E = experts, T = steps of the load history.
Placements here are in plan EP indices (ep_idx); MoELayer tables hold EP *group* ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from planner.migration import MigrationDecision, MigrationOptions, MoveCosts, next_placement
from planner.plan import load_plan
from planner.run.migration import run_move_costs
from planner.run.spec import RunSpec
from runtime.metrics import ByteCounter
from runtime.model.moe import MoELayer
from runtime.parallel.mesh import Mesh

log = logging.getLogger(__name__)

# next_placement's signature: (current_LE, load_history_TLE, costs, options) -> decision
Policy = Callable[..., MigrationDecision]


@dataclass(frozen=True, eq=False)
class MigrationPolicy:
    """How every stage of a run picks its next placement.

    costs_by_stage: the planner's prices of each stage's MoE layers (run_move_costs; None for
        a stage without MoE layers); () = next_placement's uniform prices, for a RunSpec
        made without a plan's cluster.
    options: the policy's knobs; None = the planner's defaults.
    choose: a function with next_placement's signature: the planner's policy, or one a
        test passes in.
    """

    costs_by_stage: tuple[MoveCosts | None, ...] = ()
    options: MigrationOptions | None = None
    choose: Policy = next_placement


def plan_migration(plan_path: str, spec: RunSpec) -> MigrationPolicy:
    """The planner's policy for a run of the plan at `plan_path`, priced once at start-up."""
    if spec.migrate_every <= 0:
        return MigrationPolicy()
    return MigrationPolicy(run_move_costs(load_plan(plan_path), spec, plan_path))


def decide(mesh: Mesh, migration: MigrationPolicy, current_LE, history_TLE) -> MigrationDecision:
    """The stage leader asks the policy; every rank of the stage gets the same decision.

    Args:
        current_LE: ep_idx of each expert, per MoE layer of the stage.
        history_TLE: tokens per expert of the stage's MoE layers, per past step.
    """
    box = [None]
    if mesh.me.physical == mesh.stage_ranks[0]:
        stages = migration.costs_by_stage
        costs = stages[mesh.me.stage] if stages else None
        try:
            box[0] = migration.choose(current_LE, history_TLE, costs, migration.options)
        except Exception as exc:  # noqa: BLE001 - the other ranks wait for this broadcast
            log.warning("migration policy failed (%s); keeping the current placement", exc)
            box[0] = MigrationDecision(np.asarray(current_LE, dtype=np.int64), (), 0.0)
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
