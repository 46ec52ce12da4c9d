"""What `piper plan` says when no layout fits: the closest candidate and the fixes that work.

Every concrete fix it names (a flag, a GPU count) has been tried: the search runs again on
the space that flag gives, and the fix is named only when that search finds a layout that
fits. A fix the search already covers is not named (the micro-batch, recompute and sharding
choices it searched), nor one that fits nothing (--fsdp where every layout has dp = 1
shards nothing).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

from planner.inputs.clusters import with_nodes
from planner.resources.cost import usable_memory_bytes
from planner.resources.memory import (
    device_optimizer_bytes,
    grad_bytes_per_param,
    weight_bytes_per_param,
)
from planner.resources.params import count_params
from planner.search.branch_bound import SearchContext, search_layouts
from planner.search.rows import CandidateRow, describe
from planner.search.space import SearchSpace
from planner.specs import GIB, ClusterSpec, ModelSpec, TrainingSpec


@dataclass(frozen=True)
class Fix:
    """A suggestion and the search space it gives (None: not checkable, named as is)."""

    text: str
    space: SearchSpace | None = None
    gpus_per_node: int = 0  # > 0: the fix needs the cluster resized to this many GPUs
    training: TrainingSpec | None = None  # the training the fix gives (None: unchanged)


def shortfall(row: CandidateRow) -> tuple[float, float, int]:
    """How far a candidate is from fitting: memory needed over usable (inf when nothing is
    usable), then the need."""
    usable = row.usable_memory_gib
    ratio = row.memory_need_gib / usable if usable > 0 else math.inf
    return (ratio, row.memory_need_gib, row.order)


def memory_floor_message(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, gpus: int
) -> str:
    """'' when the model's weights, gradients and optimizer state fit `gpus` devices fully
    sharded (the least any layout holds: every byte of them on some device, none twice, no
    activations); else the one-line refusal, naming the fewest GPUs that could hold them and
    `--gpus` at the first power-of-two multiple of `gpus` past that (with `--nodes` when the
    cluster is smaller). `training` carries the target's conventions (bytes per parameter);
    the memory margin is not counted (a smaller margin is a fix the search names)."""
    params = count_params(model).total
    per_param = (
        weight_bytes_per_param(training)
        + grad_bytes_per_param(training)
        + device_optimizer_bytes(1.0, training)
    )
    usable = usable_memory_bytes(cluster)
    need = params * per_param
    if usable <= 0 or need / gpus <= usable:
        return ""
    least = math.ceil(need / usable)
    more = gpus * 2 ** math.ceil(math.log2(least / gpus))
    g = cluster.gpus_per_node
    nodes = f" --nodes {-(-more // g)}" if more > cluster.total_gpus else ""
    return (
        f"plan: {model.name} cannot fit on {gpus} GPUs of {cluster.name}: its weights, "
        f"gradients and optimizer state ({params / 1e9:.1f}B parameters x {per_param:g} B) "
        f"need {need / gpus / GIB:.1f} GiB per GPU even fully sharded, over the "
        f"{usable / GIB:.1f} GiB usable; at least {least} GPUs hold them; try more GPUs "
        f"(--gpus {more}{nodes})"
    )


def no_fit_message(ctx: SearchContext, rows: Sequence[CandidateRow]) -> str:
    """One line: the closest candidate, how far it is from fitting, and the fixes that make
    some layout fit (each checked by a search)."""
    need = [r for r in rows if not math.isnan(r.memory_need_gib)]
    closest = min(need, key=shortfall) if need else None
    fixes = [f for f in _fixes(ctx, closest, rows) if f.space is None or _fits(ctx, f)]
    if closest is None:
        closest_text = "no candidate"
    else:
        closest_text = (
            f"closest is {describe(closest.parallel, closest.knobs)} needing "
            f"{closest.memory_need_gib:.1f} GiB > {closest.usable_memory_gib:.1f} GiB usable"
        )
    if not any(f.space is not None for f in fixes):
        fixes.append(Fix(_fallback(ctx, closest)))
    return (
        f"plan: no layout of {ctx.model.name} on {ctx.space.gpus} GPUs of {ctx.cluster.name} "
        f"fits in memory; {closest_text}; try {', '.join(f.text for f in fixes)}"
    )


def _fixes(
    ctx: SearchContext, closest: CandidateRow | None, rows: Sequence[CandidateRow]
) -> list[Fix]:
    """The candidate fixes, cheapest first, each with the space its flags give."""
    space = ctx.space
    out = []
    margin = ctx.training.memory_margin_gib
    if margin > 0:
        out.append(Fix(f"a smaller --memory-margin (now {margin:.1f} GiB kept free)", space,
                       training=replace(ctx.training, memory_margin_gib=0.0)))  # fmt: skip
    if "full" not in space.recompute:
        out.append(Fix("--recompute full", replace(space, recompute=("full",),
                                                    recompute_modules=None)))  # fmt: skip
    if "zero" not in space.sharding and "fsdp" not in space.sharding:
        out.append(Fix("--zero", replace(space, sharding=("zero",))))
    elif "fsdp" in space.sharding and len(space.sharding) > 1:  # searched only at pp = 1
        out.append(Fix("--fsdp (FSDP with pipelining too)", replace(space, sharding=("fsdp",))))
    if space.fixed:
        names = ", ".join(f"--{k.replace('_', '-')}" for k, _ in space.fixed)
        out.append(Fix(f"fewer fixed sizes (drop {names})", replace(space, fixed=())))
    if closest is not None and math.isfinite(shortfall(closest)[0]):
        more = space.gpus * max(2, 2 ** math.ceil(math.log2(max(shortfall(closest)[0], 1.0))))
        g = ctx.cluster.gpus_per_node
        nodes = f" --nodes {-(-more // g)}" if more > ctx.cluster.total_gpus else ""
        out.append(Fix(f"more GPUs (--gpus {more}{nodes})", replace(space, gpus=more), g))
    if any(r.solver_status == "NOT_SOLVED" for r in rows):
        out.append(Fix("a larger --time-limit-s (some stage IPs found no split in time)"))
    return out


def _fits(ctx: SearchContext, fix: Fix) -> bool:
    """Whether the search on the fix's space (and cluster) finds a layout that fits."""
    assert fix.space is not None
    cluster = ctx.cluster
    if fix.space.gpus > cluster.total_gpus:
        cluster = with_nodes(cluster, -(-fix.space.gpus // cluster.gpus_per_node))
    training = fix.training or ctx.training
    found = search_layouts(replace(ctx, space=fix.space, cluster=cluster, training=training))
    if found.interrupted:
        raise KeyboardInterrupt
    return found.best is not None


def _fallback(ctx: SearchContext, closest: CandidateRow | None) -> str:
    """What remains when no checked fix fits."""
    if closest is not None and not math.isfinite(shortfall(closest)[0]):
        return "a device with more memory or a smaller framework_overhead_gib"
    return "more GPUs or a device with more memory"
