"""Live expert migration: ask the planner for a new placement, move and copy experts with
their state.

Every K steps (one interval) the stage's per-expert token counts of its past intervals (in
rows of one or a few steps, summed over the stage's data-parallel ranks;
runtime.train.close_interval) feed the planner's migration policy
(`planner.migration.next_placement`), priced from the plan's cluster; the stage leader asks
and broadcasts, so every EP group of the stage (all expert-DP replicas) applies the same
placement. A placement is a slot table per MoE layer
(planner.run.spec.ExpertSlots): which expert each slot of each EP rank holds. A new
placement may move an expert, add a copy of it in a free slot or a slot it takes over
(a replica), or drop a copy (the slot is zeroed and stays free); every rank keeps its number
of slots. A new copy receives the expert's weights, gradients and Adam moments from a current
holder: one on the receiver's node if there is one, else the lowest EP rank. An expert that
stays on a rank keeps its slot (`arrange`). So the math of training is unchanged.

Two phases: (1) every new copy is packed (weights, grads, moments) and sent point-to-point
inside the EP group into staging buffers, with a float64 checksum; each receiver verifies
checksum and finiteness; the whole stage agrees (all-reduce MIN of an ok flag). (2) Only when
all agree are the staged slots copied in place and the slot tables swapped; otherwise
nothing changes, so a failure mid-move leaves the old placement intact.

Shape letters: L = MoE layers of the stage, E = experts, T = rows of the load history (steps
or groups of steps of the past intervals), R = EP ranks. The policy sees plan EP indices
(ep_idx); MoELayer tables hold EP *group* ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from planner.migration import MigrationDecision, MigrationOptions, MoveCosts, next_placement
from planner.plan import load_plan
from planner.run.migration import run_move_costs
from planner.run.spec import EMPTY, ExpertSlots, RunSpec, check_slots
from runtime.metrics import ByteCounter
from runtime.model.moe import MoELayer
from runtime.parallel.mesh import Mesh

log = logging.getLogger(__name__)

# next_placement's signature: (current, load_history_TLE, costs, options) -> decision
Policy = Callable[..., MigrationDecision]


@dataclass(frozen=True, eq=False)
class MigrationPolicy:
    """How every stage of a run picks its next placement.

    costs_by_stage: the planner's prices of each stage's MoE layers (run_move_costs; None for
        a stage without MoE layers); () = next_placement's uniform prices, for a RunSpec
        made without a plan's cluster.
    options: the policy's knobs; None = the planner's defaults.
    choose: a function with next_placement's signature: the planner's policy, or one a
        test passes in. A stage whose tables hold one copy of each expert and no free slot
        passes rank_of_expert_LE and reads `placement_LE`; a stage with replicas or free
        slots passes each layer's slot rows (per EP rank the experts of its slots, EMPTY =
        -1 free) and reads `slots_LRS`: per layer and EP rank the experts it holds next
        (ragged, padded or not; entries below 0 hold nothing). The runtime arranges them
        (`arrange`).
    """

    costs_by_stage: tuple[MoveCosts | None, ...] = ()
    options: MigrationOptions | None = None
    choose: Policy = next_placement


def plan_migration(plan_path: str, spec: RunSpec) -> MigrationPolicy:
    """The planner's policy for a run of the plan at `plan_path`, priced once at start-up."""
    if spec.migrate_every <= 0:
        return MigrationPolicy()
    return MigrationPolicy(run_move_costs(load_plan(plan_path), spec, plan_path))


def _plain(table: ExpertSlots) -> bool:
    held = [e for row in table.slots_RS for e in row]
    return EMPTY not in held and len(set(held)) == len(held)


def arrange(old: ExpertSlots, held_R: Sequence[Sequence[int]]) -> ExpertSlots:
    """The table in which EP rank r holds the experts held_R[r] (entries below 0 hold
    nothing): an expert that stays keeps its slot, new ones fill the freed and free slots
    in ascending id, the rest are EMPTY; every rank keeps its number of slots."""
    rows = []
    for r, (old_row, held) in enumerate(zip(old.slots_RS, held_R, strict=True)):
        want = [int(e) for e in held if e >= 0]
        if len(set(want)) < len(want) or len(want) > len(old_row):
            raise ValueError(f"EP rank {r} gets {want} for {len(old_row)} slots")
        incoming = sorted(set(want) - set(old_row))
        row = [e if e in want else EMPTY for e in old_row]
        for s in [s for s, e in enumerate(row) if e == EMPTY][: len(incoming)]:
            row[s] = incoming.pop(0)
        rows.append(row)
    return ExpertSlots.even(rows)


def ask_policy(
    migration: MigrationPolicy, costs, current: Sequence[ExpertSlots], history_TLE
) -> tuple[ExpertSlots, ...]:
    """The policy's tables for the next interval (plan EP indices); the current ones when it
    fails or returns a table that overfills a rank or loses an expert."""
    num_e = [1 + max(e for row in t.slots_RS for e in row) for t in current]
    ranks = len(current[0].slots_RS)
    try:
        if all(_plain(t) for t in current):
            rank_of = [t.rank_of_expert(n) for t, n in zip(current, num_e, strict=True)]
            decision = migration.choose(rank_of, history_TLE, costs, migration.options)
            held_LR = [
                [[e for e, r in enumerate(row) if r == rank] for rank in range(ranks)]
                for row in decision.placement_LE
            ]
        else:
            slots = [[list(row) for row in t.slots_RS] for t in current]
            held_LR = migration.choose(slots, history_TLE, costs, migration.options).slots_LRS
        new = [arrange(old, held) for old, held in zip(current, held_LR, strict=True)]
        for layer, (table, n) in enumerate(zip(new, num_e, strict=True)):
            check_slots(table, n, ranks, layer)
    except Exception as exc:  # noqa: BLE001 - the other ranks wait for this broadcast
        log.warning("migration policy failed (%s); keeping the current placement", exc)
        return tuple(current)
    return tuple(new)


def decide(
    mesh: Mesh, migration: MigrationPolicy, current: Sequence[ExpertSlots], history_TLE
) -> tuple[ExpertSlots, ...]:
    """The stage leader asks the policy; every rank of the stage gets the same tables.

    Args:
        current: the slot table of each MoE layer of the stage, in plan EP indices.
        history_TLE: tokens per expert of the stage's MoE layers, per row of the past
            intervals (runtime.train.close_interval; migration.options.rows_per_interval
            rows make one interval).
    """
    box = [None]
    if mesh.me.physical == mesh.stage_ranks[0]:
        stages = migration.costs_by_stage
        costs = stages[mesh.me.stage] if stages else None
        box[0] = ask_policy(migration, costs, current, history_TLE)
    if len(mesh.stage_ranks) > 1:
        dist.broadcast_object_list(box, src=mesh.stage_ranks[0], group=mesh.stage_group)
    return box[0]


def copy_plan(
    old: ExpertSlots, new: ExpertSlots, node_of_rank: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(expert, src, dst) of every copy the new table adds, experts then dst ascending: src
    is an old holder on dst's node if there is one, else the lowest old holder."""
    out = []
    for e in sorted({e for row in new.slots_RS for e in row if e != EMPTY}):
        had = [r for r, _ in old.holders(e)]
        for dst in sorted({r for r, _ in new.holders(e)} - set(had)):
            near = [r for r in had if node_of_rank[r] == node_of_rank[dst]]
            out.append((e, (near or had)[0], dst))
    return out


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


def _node_of_group_rank(mesh: Mesh, ranks: int) -> list[int]:
    return [mesh.node_of(dist.get_global_rank(mesh.ep_group, r)) for r in range(ranks)]


def _stage_layer(moe: MoELayer, new: ExpertSlots, mesh: Mesh, optimizer, counter: ByteCounter):
    """Phase 1 for one layer: exchange new copies into staging buffers; returns (ok, staged)."""
    me, old = dist.get_rank(mesh.ep_group), moe.slots
    size = pack_views(slot_state_views(moe, optimizer, 0)).numel()
    staged, ops, checks = {}, [], []
    for e, src, dst in copy_plan(old, new, _node_of_group_rank(mesh, len(old.slots_RS))):
        if me not in (src, dst):
            continue
        peer = dist.get_global_rank(mesh.ep_group, dst if src == me else src)
        if src == me:
            buf = pack_views(slot_state_views(moe, optimizer, old.slots_RS[me].index(e)))
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


def _commit_layer(moe: MoELayer, new: ExpertSlots, staged: dict, optimizer, me: int) -> None:
    """Phase 2 for one layer: rebuild the local slots in the new table's order, then swap."""
    old_row = moe.slots.slots_RS[me]
    bufs = [
        None
        if e == EMPTY
        else staged[e]
        if e in staged
        else pack_views(slot_state_views(moe, optimizer, old_row.index(e)))
        for e in new.slots_RS[me]
    ]
    for slot, buf in enumerate(bufs):
        offset = 0
        for view in slot_state_views(moe, optimizer, slot):
            n = view.numel()
            if buf is None:  # a dropped copy: the free slot holds zeros
                view.zero_()
            else:
                view.copy_(buf[offset : offset + n].view_as(view))
            offset += n
    moe.set_slots(new)


def apply_migration(
    moes: dict[int, MoELayer],
    tables: dict[int, ExpertSlots],
    mesh: Mesh,
    optimizer,
    counter: ByteCounter,
    fail: bool = False,
) -> bool:
    """Switch every layer to its table in `tables` (EP group ranks); True when switched.

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


def migrate_stage(
    moes: dict[int, MoELayer],
    mesh: Mesh,
    migration: MigrationPolicy,
    history_TLE,
    optimizer,
    counter: ByteCounter,
    fail: bool = False,
) -> int:
    """Ask for the stage's next tables and switch to them; returns the expert copies made
    (a moved expert counts one; 0 when nothing changes or the switch is aborted)."""
    ep = len(mesh.ep_ranks)
    to_plan = [mesh.ep_group_rank(i) for i in range(ep)]
    to_group = [mesh.ep_idx_of_group_rank(g) for g in range(ep)]
    current = [moe.slots.reorder(to_plan) for moe in moes.values()]
    new = decide(mesh, migration, current, history_TLE)
    tables = {layer: t.reorder(to_group) for layer, t in zip(moes, new, strict=True)}
    if all(tables[layer] == moe.slots for layer, moe in moes.items()):
        return 0
    nodes = _node_of_group_rank(mesh, ep)
    copies = sum(len(copy_plan(moes[layer].slots, t, nodes)) for layer, t in tables.items())
    ok = apply_migration(moes, tables, mesh, optimizer, counter, fail)
    return copies if ok else 0
