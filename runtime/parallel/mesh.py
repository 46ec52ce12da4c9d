"""Process groups from the plan: pipeline, data-parallel, tensor-parallel, stage, EP,
expert-TP, expert-DP, node, rail.

Logical ranks follow the rank IP's (Megatron's) convention (planner/FORMULATION.md, "Logical
rank convention"): logical r = stage * (dp * tp) + j with j = dp_idx * tp + tp_idx the rank's
place in its stage block; the expert mesh etp x ep x edp folds over the same block:
etp_idx = j % etp, ep_idx = (j // etp) % ep, edp_idx = j // (etp * ep). An EP group is ep
ranks etp apart (with etp = 1, ep consecutive ranks), so it may span several data-parallel
and tensor-parallel ranks; an expert-TP group is etp consecutive ranks holding the same
experts. Process RANK p runs logical rank `spec.logical_of_physical[p]` and sits on emulated
node p // ranks_per_node. Groups: pp (same j, every stage), dp (same stage and tp_idx: dense
gradients), tp (same stage and dp_idx), stage (the whole block: routing statistics, migration
decisions), ep (same stage, edp_idx and etp_idx), etp (same stage, edp_idx and ep_idx), edp
(same stage, ep_idx and etp_idx: expert gradients).

torch.distributed.new_group sorts its members, so a group's rank order can differ from the
plan's order whenever the rank IP permuted devices; `Mesh` therefore keeps each group's
members in plan order (`pp_ranks[stage]`, `ep_ranks[ep_idx]`) and callers translate
(`ep_group_rank`). Plain new_group is used instead of DeviceMesh for that reason: a
DeviceMesh dimension is a sorted group as well, and the pipeline needs stage -> peer maps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

from planner.run.spec import RunSpec


@dataclass(frozen=True)
class RankCoord:
    """Where one process sits in the plan and on the (emulated) machine."""

    physical: int
    logical: int
    stage: int
    dp_idx: int
    tp_idx: int
    ep_idx: int
    edp_idx: int
    node: int
    local_rank: int
    etp_idx: int = 0


def rank_coords(spec: RunSpec) -> tuple[RankCoord, ...]:
    """Coordinates of every process, indexed by physical rank (pure; no process group)."""
    coords = []
    g, ep, etp = spec.ranks_per_node, spec.ep, spec.etp
    for p, logical in enumerate(spec.logical_of_physical):
        stage, j = divmod(logical, spec.dp * spec.tp)
        dp_idx, tp_idx = divmod(j, spec.tp)
        ep_idx, edp_idx = (j // etp) % ep, j // (etp * ep)
        coords.append(
            RankCoord(p, logical, stage, dp_idx, tp_idx, ep_idx, edp_idx, p // g, p % g, j % etp)
        )
    return tuple(coords)


@dataclass
class Mesh:
    """This process's groups; member lists are physical ranks in plan order."""

    me: RankCoord
    coords: tuple[RankCoord, ...]
    pp_group: object
    pp_ranks: list[int]  # by stage
    dp_group: object
    dp_ranks: list[int]  # by dp_idx
    tp_group: object
    tp_ranks: list[int]  # by tp_idx
    stage_group: object
    stage_ranks: list[int]  # by place in the stage block (dp_idx * tp + tp_idx)
    ep_group: object
    ep_ranks: list[int]  # by ep_idx
    edp_group: object
    edp_ranks: list[int]  # by edp_idx
    node_group: object
    rail_group: object
    etp_group: object  # None when etp = 1
    etp_ranks: list[int]  # by etp_idx

    def node_of(self, physical: int) -> int:
        return self.coords[physical].node

    def ep_group_rank(self, ep_idx: int) -> int:
        """Group rank (sorted physical order) of the member with plan index ep_idx."""
        return sorted(self.ep_ranks).index(self.ep_ranks[ep_idx])

    def ep_idx_of_group_rank(self, group_rank: int) -> int:
        return self.ep_ranks.index(sorted(self.ep_ranks)[group_rank])


def group_members(spec: RunSpec) -> dict[str, list[list[int]]]:
    """Every group of the run by kind, members as physical ranks in plan order (pure).

    Kinds: pp, dp, tp, stage, ep, edp, node, rail and, with etp > 1, etp."""
    phys = {c.logical: c.physical for c in rank_coords(spec)}
    pp, dp, tp, ep, etp = spec.pp, spec.dp, spec.tp, spec.ep, spec.etp
    block, mesh = dp * tp, etp * ep  # ranks per stage; per expert-mesh replica
    replicas, stages = range(block // mesh), range(pp)

    def expert(s: int, q: int, i: int, t: int) -> int:  # stage, edp_idx, ep_idx, etp_idx
        return phys[s * block + q * mesh + i * etp + t]

    g, world = spec.ranks_per_node, spec.world
    nodes = range((world + g - 1) // g)
    cube = [(s, q, i, t) for s in stages for q in replicas for i in range(ep) for t in range(etp)]
    out = {
        "pp": [[phys[s * block + j] for s in stages] for j in range(block)],
        "dp": [
            [phys[s * block + d * tp + t] for d in range(dp)] for s in stages for t in range(tp)
        ],
        "tp": [
            [phys[s * block + d * tp + t] for t in range(tp)] for s in stages for d in range(dp)
        ],
        "stage": [[phys[s * block + j] for j in range(block)] for s in stages],
        "ep": [[expert(s, q, i, t) for i in range(ep)] for s, q, i, t in cube if i == 0],
        "edp": [[expert(s, q, i, t) for q in replicas] for s, q, i, t in cube if q == 0],
        "node": [list(range(n * g, min(world, (n + 1) * g))) for n in nodes],
        "rail": [[n * g + j for n in nodes if n * g + j < world] for j in range(g)],
    }
    if etp > 1:
        out["etp"] = [[expert(s, q, i, t) for t in range(etp)] for s, q, i, t in cube if t == 0]
    return out


def build_mesh(spec: RunSpec, rank: int) -> Mesh:
    """Create every group (all processes call this in the same order) and return mine."""
    coords = rank_coords(spec)
    mine: dict[str, tuple[object, list[int]]] = {"etp": (None, [rank])}  # etp = 1: no group
    for kind, groups in group_members(spec).items():
        for members in groups:
            whole = len(members) == dist.get_world_size()
            group = dist.group.WORLD if whole else dist.new_group(members)
            if rank in members:
                mine[kind] = (group, members)
    return Mesh(
        coords[rank],
        coords,
        *mine["pp"],
        *mine["dp"],
        *mine["tp"],
        *mine["stage"],
        *mine["ep"],
        *mine["edp"],
        mine["node"][0],
        mine["rail"][0],
        *mine["etp"],
    )
