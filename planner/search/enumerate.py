"""Enumerate the candidate layouts (pp, dp, tp, ep, micro-batch, micro-batches, recompute).

Validity rules (ARCHITECTURE section 2, PAPER "Valid layouts"):
- world: pp * dp * tp == gpus;
- tp divides the attention heads and stays inside one node (tp <= gpus_per_node);
- ep divides dp * tp (Megatron's MoE folding) and the number of routed experts;
- pp <= number of transformer layers (every stage holds at least one layer);
- global batch = dp * micro_batch * num_microbatches, so dp divides the global batch;
- optional: ep <= max_ep (EP kept inside a fast domain).

Any size may be fixed by the user; a fixed size that breaks a rule is a SpecError naming the
flag and the fix. The order of the returned list is deterministic (sizes ascending).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from planner.parallel import ParallelConfig, divisors
from planner.specs import ClusterSpec, ModelSpec, Recompute, SpecError, TrainingSpec

FIXABLE = ("pp", "dp", "tp", "ep", "micro_batch")
RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("none", "full")


@dataclass(frozen=True)
class SearchSpace:
    """What the search may vary. `fixed` maps a size name (FIXABLE) to the user's value."""

    gpus: int
    fixed: tuple[tuple[str, int], ...] = ()
    recompute: tuple[Recompute, ...] = RECOMPUTE_CHOICES
    max_ep: int | None = None  # None = no fast-domain limit on the EP group

    def value(self, name: str) -> int | None:
        return dict(self.fixed).get(name)


def make_space(
    gpus: int,
    fixed: Mapping[str, int | None] | None = None,
    recompute: Sequence[Recompute] | None = None,
    max_ep: int | None = None,
) -> SearchSpace:
    """Build a SearchSpace, dropping unset (None) fixed sizes and checking names and values."""
    items = []
    for name, value in sorted((fixed or {}).items()):
        if value is None:
            continue
        if name not in FIXABLE:
            raise SpecError(f"plan: cannot fix '{name}'; fixable sizes are {', '.join(FIXABLE)}")
        if int(value) < 1:
            raise SpecError(f"plan: --{name.replace('_', '-')} must be >= 1, got {value}")
        items.append((name, int(value)))
    if gpus < 1:
        raise SpecError(f"plan: --gpus must be >= 1, got {gpus}")
    choices = tuple(recompute) if recompute else RECOMPUTE_CHOICES
    return SearchSpace(gpus=gpus, fixed=tuple(items), recompute=choices, max_ep=max_ep)


def _tp_choices(model: ModelSpec, cluster: ClusterSpec, space: SearchSpace) -> list[int]:
    heads = model.layers[0].attention.num_heads
    fixed = space.value("tp")
    if fixed is not None:
        if space.gpus % fixed or heads % fixed:
            raise SpecError(
                f"plan: --tp {fixed} must divide --gpus {space.gpus} and the {heads} attention "
                f"heads of {model.name}; pick one of {_common(space.gpus, heads)}"
            )
        return [fixed]
    return [t for t in _common(space.gpus, heads) if t <= cluster.gpus_per_node]


def _common(a: int, b: int) -> list[int]:
    return [d for d in divisors(a) if b % d == 0]


def _pp_choices(model: ModelSpec, space: SearchSpace) -> list[int]:
    fixed = space.value("pp")
    if fixed is not None:
        if space.gpus % fixed or fixed > model.num_layers:
            raise SpecError(
                f"plan: --pp {fixed} must divide --gpus {space.gpus} and be <= the "
                f"{model.num_layers} layers of {model.name}"
            )
        return [fixed]
    return [p for p in divisors(space.gpus) if p <= model.num_layers]


def _ep_choices(model: ModelSpec, dp: int, tp: int, space: SearchSpace) -> list[int]:
    experts = max(model.num_experts, 1)
    choices = [e for e in divisors(dp * tp) if experts % e == 0]
    if space.max_ep is not None:
        choices = [e for e in choices if e <= space.max_ep]
    fixed = space.value("ep")
    if fixed is not None:
        return [fixed] if fixed in choices else []
    return choices


def _micro_batches(per_dp: int, space: SearchSpace) -> list[int]:
    fixed = space.value("micro_batch")
    if fixed is not None:
        return [fixed] if per_dp % fixed == 0 else []
    return divisors(per_dp)


def enumerate_layouts(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, space: SearchSpace
) -> list[ParallelConfig]:
    """All valid layouts of `space.gpus` GPUs, sizes ascending (pp, tp, dp, ep, mb, recompute).

    Raises SpecError when the fixed sizes leave no valid layout, naming the rule.
    """
    _check_fixed_ep(model, space)
    out = []
    for pp in _pp_choices(model, space):
        for tp in _tp_choices(model, cluster, space):
            if space.gpus % (pp * tp):
                continue
            dp = space.gpus // (pp * tp)
            fixed_dp = space.value("dp")
            if (fixed_dp is not None and dp != fixed_dp) or training.global_batch % dp:
                continue
            per_dp = training.global_batch // dp
            for ep in _ep_choices(model, dp, tp, space):
                for mb in _micro_batches(per_dp, space):
                    for rc in space.recompute:
                        out.append(ParallelConfig(pp, dp, tp, ep, mb, per_dp // mb, rc))
    if not out:
        raise SpecError(_no_layout_message(model, cluster, training, space))
    return out


def _check_fixed_ep(model: ModelSpec, space: SearchSpace) -> None:
    ep = space.value("ep")
    experts = max(model.num_experts, 1)
    if ep is not None and experts % ep:
        raise SpecError(
            f"plan: --ep {ep} must divide the {experts} experts of {model.name}; "
            f"pick one of {divisors(experts)}"
        )


def _no_layout_message(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, space: SearchSpace
) -> str:
    fixed = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in space.fixed) or "no fixed sizes"
    return (
        f"plan: no valid layout of {space.gpus} GPUs for {model.name} with {fixed} and global "
        f"batch {training.global_batch}: need pp*dp*tp = GPUs, dp*micro_batch | global batch, "
        f"ep | dp*tp and ep | {max(model.num_experts, 1)} experts; change --gpus, "
        "--global-batch or the fixed sizes"
    )
