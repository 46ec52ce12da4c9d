"""What `piper plan` warns about after planning: layouts that run, but not as a user expects.

- partial nodes: `--gpus` that is not a multiple of the GPUs per node (beyond one node) leaves
  the last node partly idle; the plan is made (Slurm and torchrun run a partial last node:
  the job asks for whole nodes, --ntasks-per-node caps each) and the warning names the
  whole-node counts on either side;
- a fixed `--tp` or `--ep` larger than a node: that group's collectives (TP's all-reduces,
  EP's all-to-alls) cross the network every layer, where a layout with the group inside a
  node exists (the search chooses one when the flag is dropped).
"""

from __future__ import annotations

import argparse
import math

GROUPS = {"tp": ("TP", "all-reduces"), "ep": ("EP", "all-to-alls")}


def plan_warnings(args: argparse.Namespace, gpus_per_node: int | None) -> list[str]:
    """The warning lines (without a prefix) for the flags of a plan made on nodes of
    `gpus_per_node` GPUs (none when it is not known)."""
    g = gpus_per_node or 0
    if g < 1:
        return []
    out = []
    full, extra = divmod(args.gpus, g)
    if full and extra:
        out.append(
            f"--gpus {args.gpus} fills {full} nodes of {g} GPUs and {extra} of one more, whose "
            f"other {g - extra} GPUs stay idle; use --gpus {full * g} or {(full + 1) * g} for "
            "whole nodes"
        )
    for flag, (name, collectives) in GROUPS.items():
        size = getattr(args, flag, None)
        if size is not None and size > g:
            out.append(
                f"--{flag} {size}: each {name} group spans {math.ceil(size / g)} nodes of {g} "
                f"GPUs, so its {collectives} cross the network every layer; layouts with {name} "
                f"inside a node exist: drop --{flag} to let the search weigh them"
            )
    return out
