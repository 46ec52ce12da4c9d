"""Process groups from the plan: pipeline, data-parallel, tensor-parallel, stage, EP,
expert-DP, node, rail.

Logical ranks follow the rank IP's (Megatron's) convention: logical r = stage * (dp * tp)
+ j with j = dp_idx * tp + tp_idx the rank's place in its stage block; ep_idx = j % ep and
edp_idx = j // ep (EP groups are ep consecutive ranks of the block). Process RANK p runs
logical rank `spec.logical_of_physical[p]` and sits on emulated node p // ranks_per_node.
Groups: pp (same j, every stage), dp (same stage and tp_idx: dense gradients), tp (same
stage and dp_idx), stage (the whole block: routing statistics, migration decisions), ep, edp.

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


def rank_coords(spec: RunSpec) -> tuple[RankCoord, ...]:
    """Coordinates of every process, indexed by physical rank (pure; no process group)."""
    coords = []
    g, ep = spec.ranks_per_node, spec.ep
    for p, logical in enumerate(spec.logical_of_physical):
        stage, j = divmod(logical, spec.dp * spec.tp)
        dp_idx, tp_idx = divmod(j, spec.tp)
        coords.append(RankCoord(p, logical, stage, dp_idx, tp_idx, j % ep, j // ep, p // g, p % g))
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

    def node_of(self, physical: int) -> int:
        return self.coords[physical].node

    def ep_group_rank(self, ep_idx: int) -> int:
        """Group rank (sorted physical order) of the member with plan index ep_idx."""
        return sorted(self.ep_ranks).index(self.ep_ranks[ep_idx])

    def ep_idx_of_group_rank(self, group_rank: int) -> int:
        return self.ep_ranks.index(sorted(self.ep_ranks)[group_rank])


def build_mesh(spec: RunSpec, rank: int) -> Mesh:
    """Create every group (all processes call this in the same order) and return mine."""
    coords = rank_coords(spec)
    phys = {c.logical: c.physical for c in coords}
    me = coords[rank]
    mine: dict[str, tuple[object, list[int]]] = {}

    def make(kind: str, members: list[int]) -> None:
        group = dist.new_group(members) if len(members) < dist.get_world_size() else None
        group = group if group is not None else dist.group.WORLD
        if rank in members:
            mine[kind] = (group, members)

    pp, dp, tp, ep = spec.pp, spec.dp, spec.tp, spec.ep
    block = dp * tp
    for j in range(block):
        make("pp", [phys[s * block + j] for s in range(pp)])
    for s in range(pp):
        for t in range(tp):
            make("dp", [phys[s * block + d * tp + t] for d in range(dp)])
    for s in range(pp):
        for d in range(dp):
            make("tp", [phys[s * block + d * tp + t] for t in range(tp)])
    for s in range(pp):
        make("stage", [phys[s * block + j] for j in range(block)])
    for s in range(pp):
        for q in range(block // ep):
            make("ep", [phys[s * block + q * ep + i] for i in range(ep)])
    for s in range(pp):
        for i in range(ep):
            make("edp", [phys[s * block + q * ep + i] for q in range(block // ep)])
    g, world = spec.ranks_per_node, len(coords)
    nodes = (world + g - 1) // g
    for n in range(nodes):
        make("node", list(range(n * g, min(world, (n + 1) * g))))
    for local in range(g):
        make("rail", [n * g + local for n in range(nodes) if n * g + local < world])
    return Mesh(
        me,
        coords,
        *mine["pp"],
        *mine["dp"],
        *mine["tp"],
        *mine["stage"],
        *mine["ep"],
        *mine["edp"],
        mine["node"][0],
        mine["rail"][0],
    )
