"""`--target` and `--memory-margin`, shared by `piper plan` and `piper estimate` so both take
the same defaults for the same target (planner.targets)."""

from __future__ import annotations

import argparse

from planner.specs import ClusterSpec
from planner.targets import (
    DEFAULT_MEMORY_MARGIN,
    TARGET_NAMES,
    Target,
    default_target,
    get_target,
    memory_margin_gib,
)


def add_target_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--target",
        choices=TARGET_NAMES,
        default=None,
        help="the engine that runs the plan: what the search offers and how it is priced "
        "(default: piper on an emulated CPU cluster, megatron elsewhere; planner/EXPORT.md)",
    )
    p.add_argument(
        "--memory-margin",
        default=None,
        metavar="GIB|PCT%",
        help="memory kept free on every stage, GiB or a share of device memory (default "
        f"{DEFAULT_MEMORY_MARGIN.replace('%', '%%')}; planner/PLANNING.md, 'Memory headroom')",
    )


def resolve(args: argparse.Namespace, cluster: ClusterSpec) -> tuple[Target, float]:
    """(the target, the margin in GiB) from the flags and the cluster."""
    target = get_target(args.target or default_target(cluster))
    margin = args.memory_margin if args.memory_margin is not None else DEFAULT_MEMORY_MARGIN
    return target, memory_margin_gib(
        margin, cluster.device.memory_gib, cluster.framework_overhead_gib
    )
