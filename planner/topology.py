"""Rank <-> device <-> domain per topology level.

Devices are numbered node-major (device = node * gpus_per_node + local). A domain of level
l is a block of `levels[l].devices` consecutive devices. A group of devices "spans" the
innermost level one of whose domains holds them all; its traffic crosses that level's links.
"""

from __future__ import annotations

from collections.abc import Sequence

from planner.specs import ClusterSpec, LevelSpec, SpecError


def domain_of(cluster: ClusterSpec, device: int, level: int) -> int:
    """Index of the level-`level` domain that holds `device`."""
    return device // cluster.levels[level].devices


def span_level_index(cluster: ClusterSpec, devices: Sequence[int]) -> int:
    """Innermost level index whose single domain holds every device in `devices`.

    A single device spans level -1 (no communication link used).
    """
    if not devices:
        return -1
    lo, hi = min(devices), max(devices)
    if lo == hi:
        return -1
    # domains are blocks of consecutive devices, so one domain holds them all iff it holds
    # the lowest and the highest
    for idx in range(len(cluster.levels)):
        if domain_of(cluster, lo, idx) == domain_of(cluster, hi, idx):
            return idx
    return len(cluster.levels) - 1


def contiguous_span(cluster: ClusterSpec, group_size: int) -> LevelSpec | None:
    """The level a group of `group_size` consecutive, aligned devices spans (None if size 1)."""
    if group_size <= 1:
        return None
    idx = span_level_index(cluster, range(group_size))
    return cluster.levels[idx]


def check_fits(cluster: ClusterSpec, gpus: int) -> None:
    if gpus > cluster.total_gpus:
        raise SpecError(
            f"cluster {cluster.name}: {gpus} GPUs requested but it has {cluster.total_gpus} "
            f"({cluster.num_nodes} nodes x {cluster.gpus_per_node}); lower --gpus or resize "
            f"it with --nodes {-(-gpus // cluster.gpus_per_node)}"
        )
