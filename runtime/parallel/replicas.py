"""Expert replicas over the EP group: the run's slot tables on every MoE layer, and the sum of
the gradients of a replicated expert's copies.

`install_slots` gives each MoE layer of this rank's stage the run's slot table
(RunSpec.slots_of, plan EP indices, translated to EP group ranks) and rebuilds its experts
from their seeded initial weights, so every copy of an expert starts equal.

`sum_replica_gradients`: after the backward, a copy holds the gradient of the rows routed to
it; summed over the copies of its EP group (and, by pipeline.sync_gradients, over the
expert-DP group) it is the expert's whole gradient, and every copy gets that sum, so copies
stay equal and the update is the single-copy model's. The lowest holder receives the other
copies' gradients (one batch of p2p for all layers), adds them in holder order and sends the
sum back (a second batch): per replicated expert with c copies of P gradient bytes, the
lowest holder sends (c - 1) P and every other holder P, counted as `grad_replica`
(intra or inter node by the peer). Shape letters: E experts, G EP group ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from planner.run.spec import ExpertSlots, RunSpec
from runtime.metrics import ByteCounter
from runtime.model.transformer import StageModule
from runtime.parallel.mesh import Mesh


def install_slots(module: StageModule, spec: RunSpec, mesh: Mesh) -> None:
    """Every MoE layer of `module` with slots in `spec` gets its table (before the optimizer)."""
    group_rows = [mesh.ep_idx_of_group_rank(g) for g in range(spec.ep)]
    for layer, moe in module.moe_layers().items():
        if layer in dict(spec.slots):
            moe.init_slots(spec.slots_of(layer).reorder(group_rows))


def replicated(table: ExpertSlots, num_experts: int) -> list[tuple[int, tuple[tuple[int, int]]]]:
    """(expert, its (rank, slot) holders ascending) for every expert with several copies."""
    held = [(e, table.holders(e)) for e in range(num_experts)]
    return [(e, h) for e, h in held if len(h) > 1]


@dataclass
class _Copy:
    """This rank's copy of one replicated expert: its gradient views and flat buffer."""

    tag: int
    views: list[torch.Tensor]
    flat: torch.Tensor  # my gradient; after the sum, the expert's
    peers: list[int]  # lowest holder: the other holders; else: the lowest holder
    lowest: bool
    parts: list[torch.Tensor] = field(default_factory=list)


def _my_copies(module: StageModule, mesh: Mesh) -> list[_Copy]:
    me, out = dist.get_rank(mesh.ep_group), []
    for li, moe in enumerate(module.moe_layers().values()):
        num_e = moe.spec.num_experts
        for e, holders in replicated(moe.slots, num_e):
            slot = [s for r, s in holders if r == me]
            if not slot:
                continue
            views = []
            for p in moe.experts.slot_params():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                views.append(p.grad[slot[0]])
            lowest = holders[0][0] == me
            ranks = [r for r, _ in holders[1:]] if lowest else [holders[0][0]]
            peers = [dist.get_global_rank(mesh.ep_group, r) for r in ranks]
            flat = torch.cat([v.reshape(-1) for v in views])
            out.append(_Copy(li * num_e + e, views, flat, peers, lowest))
    return out


def _run(ops: list) -> None:
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()


def sum_replica_gradients(module: StageModule, mesh: Mesh, counter: ByteCounter) -> None:
    """Every copy of each replicated expert gets the sum of its copies' gradients."""
    copies, group = _my_copies(module, mesh), mesh.ep_group
    ops = []
    for c in copies:  # round 1: the other holders send to the lowest
        if c.lowest:
            c.parts = [torch.empty_like(c.flat) for _ in c.peers]
            pairs = zip(c.parts, c.peers, strict=True)
            ops += [dist.P2POp(dist.irecv, b, p, group, c.tag) for b, p in pairs]
        else:
            ops.append(dist.P2POp(dist.isend, c.flat, c.peers[0], group, c.tag))
            counter.add("grad_replica", c.flat.numel() * c.flat.element_size(), c.peers[0])
    _run(ops)
    ops = []
    for c in copies:  # round 2: the lowest holder adds in holder order and sends the sum back
        if c.lowest:
            for part in c.parts:
                c.flat += part
            ops += [dist.P2POp(dist.isend, c.flat, p, group, c.tag) for p in c.peers]
            for p in c.peers:
                counter.add("grad_replica", c.flat.numel() * c.flat.element_size(), p)
        else:
            ops.append(dist.P2POp(dist.irecv, c.flat, c.peers[0], group, c.tag))
    _run(ops)
    for c in copies:
        offset = 0
        for view in c.views:
            view.copy_(c.flat[offset : offset + view.numel()].view_as(view))
            offset += view.numel()
