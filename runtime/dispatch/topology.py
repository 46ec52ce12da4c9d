"""Node / local-rank layout of a process group, for hierarchical (HALO) communication.

A member of a group with global rank G lives on node G // ranks_per_node. Nodes are numbered
compactly (0..N-1) in the order of their global node id; a member's local index is its position
among the group's members on that node, in group-rank order. Groups need not be node-aligned:
nodes may hold different numbers of members.

Phase II of HALO sends the rows a member has for a remote node to one "gateway" member of
that node: the rail peer (same local index) when the node has one, otherwise local index
`j % members_on_node`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupTopology:
    """Where each member of a process group lives.

    Attributes:
      global_ranks: global rank of each group rank.
      ranks_per_node: ranks per physical (or emulated) node.
      node_of: compact node index (0..num_nodes-1) of each group rank.
      local_of: index of each group rank among the members on its node.
      members_of_node: group ranks on each node, ascending.
    """

    global_ranks: tuple[int, ...]
    ranks_per_node: int
    node_of: tuple[int, ...]
    local_of: tuple[int, ...]
    members_of_node: tuple[tuple[int, ...], ...]

    @property
    def size(self) -> int:
        """Number of members of the group."""
        return len(self.global_ranks)

    @property
    def num_nodes(self) -> int:
        """Number of nodes the group spans."""
        return len(self.members_of_node)

    @property
    def node_aligned(self) -> bool:
        """True when every node holds the same number of members (rail pairing is exact)."""
        return len({len(m) for m in self.members_of_node}) == 1

    def same_node(self, a: int, b: int) -> bool:
        """Whether group ranks a and b share a node."""
        return self.node_of[a] == self.node_of[b]

    def gateway(self, src: int, dst_node: int) -> int:
        """Group rank on `dst_node` that receives `src`'s Phase II rows for that node."""
        members = self.members_of_node[dst_node]
        return members[self.local_of[src] % len(members)]


def group_topology(global_ranks: list[int] | tuple[int, ...], ranks_per_node: int) -> GroupTopology:
    """Computes the node layout of a group from its members' global ranks.

    Args:
      global_ranks: global rank of each group rank (group rank order).
      ranks_per_node: ranks per node (> 0).

    Returns:
      The GroupTopology.

    Raises:
      ValueError: ranks_per_node < 1 or repeated global ranks.
    """
    if ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be >= 1, got {ranks_per_node}")
    if len(set(global_ranks)) != len(global_ranks):
        raise ValueError(f"global ranks of a group must be distinct, got {list(global_ranks)}")
    physical = [g // ranks_per_node for g in global_ranks]
    compact = {n: i for i, n in enumerate(sorted(set(physical)))}
    node_of = tuple(compact[n] for n in physical)
    members: list[list[int]] = [[] for _ in compact]
    for rank, node in enumerate(node_of):
        members[node].append(rank)
    local_of = tuple(members[node].index(rank) for rank, node in enumerate(node_of))
    return GroupTopology(
        global_ranks=tuple(global_ranks),
        ranks_per_node=ranks_per_node,
        node_of=node_of,
        local_of=local_of,
        members_of_node=tuple(tuple(m) for m in members),
    )


def topology_of_group(group, ranks_per_node: int) -> GroupTopology:
    """GroupTopology of a torch.distributed process group (None = the default group)."""
    import torch.distributed as dist

    size = dist.get_world_size(group)
    if group is None or group is dist.group.WORLD:
        ranks = list(range(size))
    else:
        ranks = [dist.get_global_rank(group, i) for i in range(size)]
    return group_topology(ranks, ranks_per_node)
