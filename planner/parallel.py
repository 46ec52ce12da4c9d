"""Parallel layouts: ParallelConfig and the rules that make one valid.

Megatron-Core's parallel folding: attention runs on world = tp * cp * dp * pp ranks, the
experts on etp * ep * edp * pp with etp * ep * edp = tp * cp * dp, so the expert-parallel
group may be larger than dp * tp (ep folds over the tensor, context and data ranks). Experts
are sharded over ep ranks, each split over etp, and replicated over edp. Interleaved 1F1B
gives each pipeline rank vp model chunks. Piper's own layouts are usually tp = cp = etp = 1
and dp = ep * edp (attention replicated over the expert group).

Shape letters: none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from planner.specs import ModelSpec, Recompute, SpecError, TrainingSpec

# Megatron-Core's `--recompute-modules` (selective recompute by module), and "op":
# torchtitan's per-op selective activation checkpointing of every layer (SelectiveAC,
# planner.resources.op_sac), the one selective set that engine runs.
NamedModule = Literal[
    "core_attn", "layernorm", "moe_act", "mla_up_proj", "mlp", "moe", "shared_experts", "op"
]
RECOMPUTE_MODULES: tuple[NamedModule, ...] = get_args(NamedModule)
# torchtitan's memory-budget AC (planner.resources.memory_budget) as the module "budget:<b>",
# alone: b in [0, 1] in steps of 1 / BUDGET_STEPS (the 0.05 steps torchtitan's
# visualize_memory_budget_pareto samples), so plan.json's module list stays a closed set.
BUDGET_PREFIX = "budget:"
BUDGET_STEPS = 20
BUDGET_MODULES: tuple[str, ...] = tuple(
    f"{BUDGET_PREFIX}{i / BUDGET_STEPS:g}" for i in range(BUDGET_STEPS + 1)
)
RecomputeModule = Literal[NamedModule, Literal[BUDGET_MODULES]]  # type: ignore[valid-type]


@dataclass(frozen=True)
class ParallelConfig:
    """One layout. `micro_batch` is in sequences; num_microbatches per data-parallel rank.

    vp: virtual pipeline stages (model chunks) per pipeline rank, interleaved 1F1B when > 1.
    cp: context-parallel ranks; each holds 2 of the sequence's 2 * cp load-balanced chunks.
    etp: expert tensor parallel: each routed expert's FFN width is split over etp ranks.
    recompute_modules: with recompute "selective", the modules recomputed (Megatron-Core's
        names); () means core attention only, the default of `--recompute-granularity
        selective`.
    """

    pp: int
    dp: int
    tp: int = 1
    ep: int = 1
    micro_batch: int = 1
    num_microbatches: int = 1
    recompute: Recompute = "none"
    vp: int = 1
    cp: int = 1
    etp: int = 1
    recompute_modules: tuple[RecomputeModule, ...] = ()

    def __post_init__(self) -> None:
        sizes = ("pp", "dp", "tp", "ep", "micro_batch", "num_microbatches", "vp", "cp", "etp")
        for name in sizes:
            if getattr(self, name) < 1:
                raise SpecError(f"parallel: {name} must be >= 1, got {getattr(self, name)}")
        dense = self.tp * self.cp * self.dp
        if dense % (self.etp * self.ep):
            raise SpecError(
                f"parallel: etp*ep={self.etp * self.ep} must divide tp*cp*dp={dense} (the "
                "expert mesh etp x ep x edp folds over the attention ranks); pick ep from the "
                "divisors of tp*cp*dp/etp"
            )
        if self.vp > 1 and self.pp == 1:
            raise SpecError(f"parallel: vp={self.vp} needs pp > 1; use vp=1 without pipelining")
        if self.vp > 1 and self.num_microbatches % self.pp:
            raise SpecError(
                f"parallel: interleaved 1F1B (vp={self.vp}) runs micro-batches in groups of "
                f"pp={self.pp}; num_microbatches={self.num_microbatches} must be a multiple"
            )
        self._check_modules()

    def _check_modules(self) -> None:
        mods = self.recompute_modules
        unknown = [m for m in mods if m not in RECOMPUTE_MODULES and m not in BUDGET_MODULES]
        if unknown:
            raise SpecError(
                f"parallel: recompute module(s) {', '.join(map(str, unknown))} unknown; "
                f"choose from {', '.join(RECOMPUTE_MODULES)} or {BUDGET_PREFIX}<b> (b in "
                f"[0, 1] in steps of {1 / BUDGET_STEPS:g})"
            )
        if len(mods) > 1 and any(m in BUDGET_MODULES for m in mods):
            raise SpecError(
                f"parallel: recompute modules {','.join(mods)}: a memory budget covers the "
                "whole layer; give it alone"
            )
        if len(set(self.recompute_modules)) != len(self.recompute_modules):
            raise SpecError("parallel: recompute_modules lists a module twice; list each once")
        if self.recompute_modules and self.recompute != "selective":
            raise SpecError(
                f"parallel: recompute_modules need recompute='selective', not "
                f"'{self.recompute}'; drop the modules or recompute selectively"
            )

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp * self.cp

    @property
    def edp(self) -> int:
        """Expert data-parallel degree: replicas of each expert shard."""
        return self.tp * self.cp * self.dp // (self.etp * self.ep)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step implied by this layout."""
        return self.dp * self.micro_batch * self.num_microbatches

    @property
    def selective_modules(self) -> tuple[RecomputeModule, ...]:
        """The modules selective recompute reruns: core attention unless others are named."""
        if self.recompute != "selective":
            return ()
        return self.recompute_modules or ("core_attn",)


def budget_module(budget: float) -> str:
    """The recompute module of torchtitan's memory-budget AC at `budget` (`--memory-budget`);
    a budget outside [0, 1] or off the 1 / BUDGET_STEPS grid is one SpecError line."""
    steps = budget * BUDGET_STEPS
    if not 0.0 <= budget <= 1.0 or abs(steps - round(steps)) > 1e-9:
        raise SpecError(
            f"--memory-budget {budget:g}: give a budget in [0, 1] in steps of "
            f"{1 / BUDGET_STEPS:g} (e.g. 0.5)"
        )
    return f"{BUDGET_PREFIX}{round(steps) / BUDGET_STEPS:g}"


def memory_budget(modules: tuple[str, ...]) -> float | None:
    """The budget b of a layout whose recompute modules are ("budget:<b>",); None otherwise."""
    if len(modules) != 1 or modules[0] not in BUDGET_MODULES:
        return None
    return float(modules[0].removeprefix(BUDGET_PREFIX))


def check_layout(par: ParallelConfig, model: ModelSpec, training: TrainingSpec) -> None:
    """The rules that need the model and the sequence (ParallelConfig checks the rest).

    cp splits the sequence into 2 * cp load-balanced chunks (rank r holds chunks r and
    2cp-1-r, Megatron-Core's causal balancing); ep divides the routed experts; etp divides
    every routed expert's FFN width; pp*vp chunks need num_layers + 2 pipeline units.
    Raises SpecError naming the knob and the fix.
    """
    if par.cp > 1 and training.seq_len % (2 * par.cp):
        raise SpecError(
            f"parallel: cp={par.cp} splits the sequence into {2 * par.cp} balanced chunks; "
            f"seq_len={training.seq_len} must be a multiple of {2 * par.cp}"
        )
    experts = model.num_experts
    if par.ep > 1 and (not experts or experts % par.ep):
        raise SpecError(
            f"parallel: ep={par.ep} must divide the model's {experts} routed experts; "
            "pick ep from their divisors"
        )
    for i, layer in enumerate(model.layers):
        if layer.moe is not None and layer.moe.expert_ffn % par.etp:
            raise SpecError(
                f"parallel: etp={par.etp} must divide layer {i}'s expert FFN width "
                f"{layer.moe.expert_ffn}; pick etp from its divisors"
            )
    # Megatron-Core may count the embedding and the loss as one pipeline layer each
    # (--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split), so a
    # chunk can hold the embedding or the loss alone: pp*vp chunks need num_layers + 2 units.
    if par.vp > 1 and model.num_layers + 2 < par.pp * par.vp:
        raise SpecError(
            f"parallel: pp={par.pp} x vp={par.vp} model chunks need at least "
            f"{par.pp * par.vp - 2} layers (the embedding and the loss count as one each); "
            f"the model has {model.num_layers}"
        )


def virtual_chunks(layers: tuple[int, ...], vp: int) -> tuple[tuple[int, ...], ...]:
    """A pipeline rank's layers as vp contiguous chunks, as even as possible (earlier chunks
    take the extra layer); raises SpecError when the rank has fewer than vp layers."""
    if len(layers) < vp:
        raise SpecError(
            f"parallel: a pipeline rank holds {len(layers)} layers, fewer than vp={vp} chunks; "
            "use a smaller vp or fewer pipeline stages"
        )
    base, extra = divmod(len(layers), vp)
    out, start = [], 0
    for c in range(vp):
        size = base + (1 if c < extra else 0)
        out.append(tuple(layers[start : start + size]))
        start += size
    return tuple(out)


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
