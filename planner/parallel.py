"""Parallel layouts: ParallelConfig and the rules that make one valid.

Megatron's MoE folding: world = pp * dp * tp; ep divides dp * tp; experts are sharded
over ep ranks and replicated over edp = dp * tp / ep. Piper's own layouts are usually
tp = 1 and dp = ep * edp (attention replicated over the expert group).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.specs import Recompute, SpecError


@dataclass(frozen=True)
class ParallelConfig:
    """One layout. `micro_batch` is in sequences; num_microbatches per data-parallel rank."""

    pp: int
    dp: int
    tp: int = 1
    ep: int = 1
    micro_batch: int = 1
    num_microbatches: int = 1
    recompute: Recompute = "none"

    def __post_init__(self) -> None:
        for name in ("pp", "dp", "tp", "ep", "micro_batch", "num_microbatches"):
            if getattr(self, name) < 1:
                raise SpecError(f"parallel: {name} must be >= 1, got {getattr(self, name)}")
        if (self.dp * self.tp) % self.ep:
            raise SpecError(
                f"parallel: ep={self.ep} must divide dp*tp={self.dp * self.tp}; "
                "pick ep from the divisors of dp*tp"
            )

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: replicas of each expert shard."""
        return self.dp * self.tp // self.ep

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step implied by this layout."""
        return self.dp * self.micro_batch * self.num_microbatches


def default_placement(num_experts: int, ep: int) -> tuple[int, ...]:
    """Expert e on EP rank e // (E / ep): contiguous blocks, Megatron-Core's default order.

    The placement of a plan without an `experts` entry for a layer, the start of every
    migration replay and the layout an export assumes unless the plan says otherwise.
    """
    if ep < 1 or num_experts % ep:
        raise SpecError(f"parallel: ep={ep} must divide the {num_experts} experts")
    return tuple(e // (num_experts // ep) for e in range(num_experts))


def divisors(n: int) -> list[int]:
    """All positive divisors of n, ascending."""
    small = [d for d in range(1, int(n**0.5) + 1) if n % d == 0]
    return sorted(set(small + [n // d for d in small]))
