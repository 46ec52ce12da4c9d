"""What `piper plan` may vary: the search space, its knobs and the rules for their values.

A candidate is a layout (planner.parallel.ParallelConfig: pp, dp, tp, cp, ep, etp, vp,
micro-batch, recompute and its modules) plus the training knobs the search also chooses
(`Knobs`: optimizer sharding, the 1F1B all-to-all overlap, the MoE dispatcher). Anything the
user fixes is used as given; what is searched takes only values that can win
(planner/PLANNING.md, "The search space"):

- cp > 1 only for sequences of at least `CP_MIN_SEQ` tokens, keeping `CP_MIN_TOKENS` per
  rank, and not with MTP (Megatron-LM: "MTP does not support CP"); when nothing fits without
  it, `cp_fallback` lists the context-parallel sizes a second pass tries;
- vp in `VP_CHOICES` when pp > 1 and the micro-batches come in groups of pp;
- etp > 1 only when ep already equals the routed experts (each rank holds one expert, so
  only splitting an expert shrinks the expert weights further);
- the recompute module sets of `module_sets` (Megatron-Core's names);
- FSDP only without pipelining (every micro-batch re-gathers each weight, which the
  distributed optimizer pays once per step; the published FSDP runs all have pp = 1); the
  distributed optimizer everywhere; no sharding only when the user turns both off;
- the all-to-all overlap only where Megatron-LM allows it (`a2a_overlap_allowed`);
- HALO only for EP groups that leave a node (inside one it is the flat all-to-all).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from planner.parallel import BUDGET_MODULES, RECOMPUTE_MODULES, ParallelConfig, RecomputeModule
from planner.specs import ModelSpec, Recompute, SpecError, TrainingSpec

Sharding = Literal["none", "zero", "fsdp"]
DispatcherName = Literal["flat", "halo", "halo-dedup", "deepep"]
DISPATCHERS: tuple[DispatcherName, ...] = get_args(DispatcherName)
SHARDINGS: tuple[Sharding, ...] = get_args(Sharding)

FIXABLE = ("pp", "dp", "tp", "ep", "micro_batch", "vp", "cp", "etp")
RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("none", "full", "selective")
VP_CHOICES = (2, 4)  # interleaved chunks tried per pipeline rank
CP_MIN_SEQ = 16384  # published cp > 1 runs: 16k-32k tokens per sequence
CP_MIN_TOKENS = 8192  # tokens each context-parallel rank keeps (searched cp)
CP_FALLBACK_MIN_TOKENS = 1024  # the second pass, when nothing fits without cp


@dataclass(frozen=True)
class Knobs:
    """Training knobs searched beside the layout. sharding: "zero" is Megatron's distributed
    optimizer (optimizer state sharded), "fsdp" shards weights, gradients and optimizer
    state; dispatcher: the all-to-all priced for the MoE dispatch/combine."""

    sharding: Sharding = "none"
    a2a_overlap: bool = False
    dispatcher: DispatcherName = "flat"


@dataclass(frozen=True)
class Candidate:
    """One point of the search space."""

    parallel: ParallelConfig
    knobs: Knobs = Knobs()


@dataclass(frozen=True)
class SearchSpace:
    """What the search may vary. `fixed` maps a size name (FIXABLE) to the user's value;
    `recompute_modules` is the user's module list (None = searched); `a2a_overlap` None =
    searched; `cp_fallback` the context-parallel sizes of the second pass (() = none)."""

    gpus: int
    fixed: tuple[tuple[str, int], ...] = ()
    recompute: tuple[Recompute, ...] = RECOMPUTE_CHOICES
    recompute_modules: tuple[RecomputeModule, ...] | None = None
    sharding: tuple[Sharding, ...] = ("zero", "fsdp")
    a2a_overlap: bool | None = None
    dispatchers: tuple[DispatcherName, ...] = DISPATCHERS
    max_ep: int | None = None  # None = no fast-domain limit on the EP group
    cp_fallback: tuple[int, ...] = ()
    # the target engine's one selective module set (None = module_sets); its expert-TP rule
    module_set: tuple[RecomputeModule, ...] | None = None
    etp_rule: Literal["any", "one_or_tp"] = "any"
    budget_sets: tuple[tuple[RecomputeModule, ...], ...] = ()  # memory budgets searched

    def value(self, name: str) -> int | None:
        return dict(self.fixed).get(name)


def make_space(
    gpus: int,
    fixed: Mapping[str, int | None] | None = None,
    recompute: Sequence[Recompute] | None = None,
    max_ep: int | None = None,
    *,
    recompute_modules: Sequence[str] | None = None,
    sharding: Sequence[Sharding] | None = None,
    a2a_overlap: bool | None = None,
    dispatchers: Sequence[str] | None = None,
    module_set: Sequence[str] | None = None,
    etp_rule: Literal["any", "one_or_tp"] = "any",
    budget_sets: Sequence[tuple[str, ...]] = (),
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
    policies = tuple(recompute) if recompute else RECOMPUTE_CHOICES
    modules = _check_modules(recompute_modules, policies)
    if modules is not None:
        policies = ("selective",)
    for name in dispatchers or ():
        if name not in DISPATCHERS:
            raise SpecError(f"plan: --dispatcher {name} unknown; use {'|'.join(DISPATCHERS)}")
    return SearchSpace(
        gpus=gpus,
        fixed=tuple(items),
        recompute=policies,
        recompute_modules=modules,
        sharding=tuple(sharding) if sharding else ("zero", "fsdp"),
        a2a_overlap=a2a_overlap,
        dispatchers=tuple(dispatchers) if dispatchers else DISPATCHERS,  # type: ignore[arg-type]
        max_ep=max_ep,
        module_set=tuple(module_set) if module_set is not None else None,  # type: ignore[arg-type]
        etp_rule=etp_rule,
        budget_sets=tuple(budget_sets),  # type: ignore[arg-type]
    )


def _check_modules(
    modules: Sequence[str] | None, policies: tuple[Recompute, ...]
) -> tuple[RecomputeModule, ...] | None:
    if modules is None:
        return None
    if len(modules) == 1 and modules[0] in BUDGET_MODULES:
        return (modules[0],)  # type: ignore[return-value]
    unknown = [m for m in modules if m not in RECOMPUTE_MODULES]
    if unknown or not modules:
        raise SpecError(
            f"plan: --recompute-modules {','.join(modules)}: give a comma-separated list of "
            f"{', '.join(RECOMPUTE_MODULES)}"
        )
    if policies != RECOMPUTE_CHOICES and policies != ("selective",):
        raise SpecError(
            f"plan: --recompute-modules needs --recompute selective, not {policies[0]}; "
            "drop one of the two flags"
        )
    return tuple(m for m in RECOMPUTE_MODULES if m in modules)


def sharding_choices(zero: bool | None, fsdp: bool | None) -> tuple[Sharding, ...]:
    """The `--zero/--no-zero` and `--fsdp/--no-fsdp` flags (None = not given) as choices."""
    if zero and fsdp:
        raise SpecError(
            "plan: --zero (distributed optimizer) and --fsdp both shard the optimizer state; "
            "give one of them"
        )
    if zero:
        return ("zero",)
    if fsdp:
        return ("fsdp",)
    out: list[Sharding] = [] if zero is False else ["zero"]
    if fsdp is not False:
        out.append("fsdp")
    if zero is False:
        out.insert(0, "none")
    return tuple(out)


def module_sets(
    model: ModelSpec, training: TrainingSpec
) -> tuple[tuple[RecomputeModule, ...], ...]:
    """Selective-recompute module sets searched (Megatron-Core's names, in its order).

    One set that reruns only cheap parts, between no recompute and full recompute (which the
    stage IP also chooses per layer): the norm outputs and the experts' activation function
    (MoE models; the published Qwen3 and DeepSeek-V3 recipes), the MLA up-projections, the
    dense MLP of a model without experts, and core attention when flash attention is off (then
    the scores are large). Heavier sets (`moe`, which reruns the dispatch and combine too)
    are tried when given with --recompute-modules.
    """
    has_moe = any(layer.moe is not None for layer in model.layers)
    mla = any(layer.attention.kind == "mla" for layer in model.layers)
    light: set[str] = {"mla_up_proj"} if mla else set()
    if not training.flash_attention:
        light.add("core_attn")
    if has_moe:
        light |= {"layernorm", "moe_act"}
    else:
        light.add("mlp")
    return (tuple(m for m in RECOMPUTE_MODULES if m in light),)


def mtp_layers(model: ModelSpec, training: TrainingSpec) -> int:
    """Multi-token-prediction layers trained: the setting, else the model config's."""
    return model.num_mtp_layers if training.mtp_layers is None else training.mtp_layers


def a2a_overlap_allowed(
    par: ParallelConfig, dispatcher: DispatcherName, mtp: int
) -> tuple[bool, str]:
    """Megatron-LM's rules for `--overlap-moe-expert-parallel-comm`
    (megatron/core/transformer/transformer_config.py, __post_init__): expert parallelism,
    the alltoall or flex dispatcher, no full recompute and no `moe` module, interleaving when
    pipelined, at most one MTP layer and pp > 1 when MTP trains. Returns (allowed, the rule
    broken)."""
    if par.ep == 1:
        return False, "needs ep > 1"
    if dispatcher in ("halo", "halo-dedup"):
        return False, "runs with the flat (alltoall) or deepep (flex) dispatcher"
    if par.recompute == "full":
        return False, "is not allowed with full recompute"
    if "moe" in par.selective_modules:
        return False, "is not allowed with the moe recompute module"
    if par.pp > 1 and par.vp == 1:
        return False, "needs vp > 1 when pp > 1"
    if mtp > 1:
        return False, f"allows at most 1 MTP layer, the model trains {mtp}"
    if mtp and par.pp == 1:
        return False, "needs pp > 1 when an MTP layer trains"
    return True, ""


def cp_choices(
    space: SearchSpace, model: ModelSpec, training: TrainingSpec, tp: int, g: int
) -> list[int]:
    """Context-parallel sizes for one tp: the fixed one, or 1 and the long-sequence sizes."""
    fixed = space.value("cp")
    if fixed is not None:
        return [fixed]
    if space.cp_fallback:
        return [c for c in space.cp_fallback if tp * c <= g]
    s = training.seq_len
    if s < CP_MIN_SEQ or mtp_layers(model, training) > 0:
        return [1]
    return [1] + [c for c in _powers_of_two(s // CP_MIN_TOKENS) if c > 1 and s % (2 * c) == 0]


def cp_fallback(space: SearchSpace, model: ModelSpec, training: TrainingSpec, g: int) -> tuple:
    """Context-parallel sizes (> 1) for a second pass when no candidate fits; () when the user
    fixed cp. Each rank keeps CP_FALLBACK_MIN_TOKENS tokens; cp stays within a node."""
    if space.value("cp") is not None or space.cp_fallback:
        return ()
    s = training.seq_len
    searched = set(cp_choices(space, model, training, 1, g))
    more = [
        c
        for c in _powers_of_two(min(g, s // CP_FALLBACK_MIN_TOKENS))
        if c > 1 and s % (2 * c) == 0 and c not in searched
    ]
    return tuple(more)


def _powers_of_two(limit: int) -> list[int]:
    out, c = [], 1
    while c <= limit:
        out.append(c)
        c *= 2
    return out


def vp_choices(space: SearchSpace, pp: int, m: int, layers: int) -> list[int]:
    """Interleaved chunks per rank: the fixed vp, else 1 and VP_CHOICES where they apply
    (pp > 1, m a multiple of pp, at least vp layers per rank)."""
    fixed = space.value("vp")
    ok = [1] + [v for v in VP_CHOICES if pp > 1 and m % pp == 0 and pp * v <= layers]
    if fixed is not None:
        return [fixed] if fixed == 1 or (pp > 1 and m % pp == 0 and pp * fixed <= layers) else []
    return ok


def etp_ok(etp: int, ep: int, model: ModelSpec, searched: bool) -> bool:
    """etp divides every routed expert's FFN width; searched etp > 1 needs ep = experts."""
    widths = {layer.moe.expert_ffn for layer in model.layers if layer.moe is not None}
    if any(w % etp for w in widths):
        return False
    return not searched or etp == 1 or ep == max(model.num_experts, 1)


def dispatcher_choices(
    space: SearchSpace, ep: int, etp: int, g: int, top_k: int = 2
) -> list[DispatcherName]:
    """Dispatchers for an EP group: one (the first) without expert parallelism; no HALO for a
    group inside one node (its Phase I is the whole exchange); HALO-dedup is plain HALO under
    top-1 routing (nothing to deduplicate), so one of the two is searched there."""
    if ep == 1:
        return [space.dispatchers[0]]
    out = list(space.dispatchers)
    for name in ("halo", "halo-dedup"):
        if ep * etp <= g and len(out) > 1 and name in out:
            out.remove(name)
    if top_k <= 1 and "halo" in out and "halo-dedup" in out:
        out.remove("halo-dedup")
    return out


def policies(
    space: SearchSpace, model: ModelSpec, training: TrainingSpec
) -> list[tuple[Recompute, tuple[RecomputeModule, ...]]]:
    """(recompute, modules) pairs: none, full, then each selective module set."""
    out: list[tuple[Recompute, tuple[RecomputeModule, ...]]] = []
    for rc in space.recompute:
        if rc != "selective":
            out.append((rc, ()))
        elif space.recompute_modules is not None:
            out.append(("selective", space.recompute_modules))
        elif space.module_set is not None:
            out.append(("selective", space.module_set))
            out += [("selective", b) for b in space.budget_sets]
        else:
            out += [("selective", s) for s in module_sets(model, training)]
    return out
