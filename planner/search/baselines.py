"""The layouts Piper's plan is compared with, side by side in summary.md and the CLI output.

- uniform: the best layout of the same search space when layers are split evenly over the
  stages (the first L % pp stages get one more layer) and recompute is all-or-nothing;
- xmoe: an X-MoE-like layout: no pipeline (pp = 1), tp = 1, flat expert parallelism over
  all GPUs (the largest ep dividing both the GPU count and the experts), ZeRO turned on if
  that is what makes it fit;
- recipe: the layout published for the model (planner.search.recipes: Megatron-Bridge and
  Megatron-MoE-ModelZoo runs), dp scaled to the plan's GPUs, with its recompute, interleaving,
  dispatcher and all-to-all overlap where the plan's engine runs them;
- generic, for a model without a recipe that runs on the plan's GPUs: EP inside a node, the
  fewest pipeline stages that fit with an even split, micro-batch 1, recompute only if
  needed, the distributed optimizer unless the user turned it off.
Each is scored by the same resource model as Piper's plan with an even layer split; the
uniform, X-MoE-like and generic layouts with the flat all-to-all unless the user fixed the
dispatcher, no interleaving, context or expert tensor parallelism and no all-to-all overlap;
speedup = its step / Piper's step. The uniform split is taken among the
candidates the search costed and screened (a pruned family's other members are never costed).
A baseline's `outside_search` names its settings that the plan's search could not choose (a
size the user fixed, a recompute policy, sharding, dispatcher or overlap left out, an EP group
over --max-ep): the reason a baseline can beat Piper's plan.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from planner.parallel import ParallelConfig, divisors
from planner.resources.cost import even_split
from planner.resources.stage_inputs import StageCostInputs
from planner.search import bounds
from planner.search.branch_bound import SearchContext
from planner.search.costing import training_for
from planner.search.evaluator import EstimateView
from planner.search.recipes import Recipe, recipe_layout, recipes_for
from planner.search.space import Candidate, Knobs, SearchSpace


@dataclass(frozen=True)
class Baseline:
    name: str  # "uniform" | "xmoe" | "recipe" | "generic"
    title: str
    parallel: ParallelConfig | None
    zero: bool
    estimate: EstimateView | None
    note: str = ""  # why there is no estimate, or what was needed to make it fit
    knobs: Knobs = Knobs()
    outside_search: tuple[str, ...] = ()  # "pp=1 (--pp 2 given)": settings the search excluded

    def speedup(self, piper_step_s: float) -> float:
        """How many times faster Piper's step is (nan when the baseline does not fit)."""
        if self.estimate is None or not self.estimate.fits:
            return math.nan
        return self.estimate.step_time_s / piper_step_s


@dataclass(frozen=True)
class _Scored:
    step_s: float
    order: int
    cand: Candidate


TITLES = {
    "uniform": "best uniform split",
    "xmoe": "X-MoE-like (flat EP, pp=1)",
    "generic": "EP in a node, fewest stages that fit",
}


def _even_score(inputs: StageCostInputs, par: ParallelConfig) -> float | None:
    """Step of an even split with all-or-nothing recompute; None if it does not fit."""
    split = even_split(len(inputs.units), par.pp)
    mem, time = bounds.split_cost(inputs, split, par.recompute != "none")
    if max(mem) > inputs.usable_memory_bytes:
        return None
    return inputs.pipeline_slots * max(time)


def _finish(
    ctx: SearchContext,
    name: str,
    best: _Scored | None,
    note: str,
    fit_note: str = "",
    est: Any = None,
) -> Baseline:
    """The baseline of `best` with its even-split estimate (`est` when already made)."""
    if best is None:
        return Baseline(name, TITLES[name], None, False, None, note)
    par, knobs = best.cand.parallel, best.cand.knobs
    est = est if est is not None else _even_estimate(ctx, best.cand)
    outside = outside_search(ctx.space, par, knobs)
    return Baseline(
        name, TITLES[name], par, knobs.sharding == "zero", est, fit_note, knobs, outside
    )


def outside_search(space: SearchSpace, par: ParallelConfig, knobs: Knobs) -> tuple[str, ...]:
    """The settings of `par` and `knobs` that `space` excludes, each with the flag or limit
    that excluded it, e.g. "pp=1 (--pp 2 given)"; () when the search could have chosen them."""
    out = [
        f"{name}={getattr(par, name)} (--{name.replace('_', '-')} {value} given)"
        for name, value in space.fixed
        if getattr(par, name) != value
    ]
    if par.recompute not in space.recompute:
        out.append(f"recompute={par.recompute} (--recompute {'|'.join(space.recompute)} given)")
    # Without sharding is never faster than the distributed optimizer, which only shards the
    # optimizer state (planner/resources/memory.py:100-112), so it is no reason to list.
    plain_for_zero = knobs.sharding == "none" and "zero" in space.sharding
    if knobs.sharding not in space.sharding and not plain_for_zero:
        out.append(f"sharding {knobs.sharding} (the plan allows {'|'.join(space.sharding)})")
    if knobs.dispatcher not in space.dispatchers:
        given = "|".join(space.dispatchers)
        out.append(f"dispatcher={knobs.dispatcher} (--dispatcher {given} given)")
    if space.a2a_overlap is not None and knobs.a2a_overlap != space.a2a_overlap:
        state = "on" if knobs.a2a_overlap else "off"
        out.append(
            f"all-to-all overlap {state} (the plan fixed it {'off' if state == 'on' else 'on'})"
        )
    if space.max_ep is not None and par.ep > space.max_ep:
        out.append(f"ep={par.ep} (--max-ep {space.max_ep} given)")
    return tuple(out)


def _dispatcher(ctx: SearchContext) -> str:
    """The user's fixed dispatcher, else the flat all-to-all."""
    d = ctx.space.dispatchers
    return d[0] if len(d) == 1 else "flat"


UNIFORM_FINALISTS = 16  # even splits within UNIFORM_WITHIN of the best score, re-ranked
UNIFORM_WITHIN = 1.05


def uniform(ctx: SearchContext, inputs: Mapping[Candidate, StageCostInputs]) -> Baseline:
    """The best even-split candidate among the search's memory-screened candidates: ranked by
    the pipelined stage time (pipeline slots x the slowest stage), then the closest
    (up to UNIFORM_FINALISTS within UNIFORM_WITHIN of the best) by the whole step, which adds
    what the stage time leaves out and sets sharding variants apart (gradient reductions,
    FSDP gathers, the optimizer step)."""
    scored = []
    for order, (cand, inp) in enumerate(inputs.items()):
        step = _even_score(inp, cand.parallel)
        if step is not None:
            scored.append(_Scored(step, order, cand))
    if not scored:
        return _finish(ctx, "uniform", None, "no layout fits with an even split")
    scored.sort(key=lambda s: (s.step_s, s.order))
    finalists = [s for s in scored if s.step_s <= scored[0].step_s * UNIFORM_WITHIN]
    ests = [(_even_estimate(ctx, s.cand), s) for s in finalists[:UNIFORM_FINALISTS]]
    est, best = min(ests, key=lambda e: (e[0].step_time_s, e[1].order))
    return _finish(ctx, "uniform", best, "no layout fits with an even split", est=est)


def _even_estimate(ctx: SearchContext, cand: Candidate):
    """The resource model's estimate of `cand` with an even split and all-or-nothing
    recompute."""
    par = cand.parallel
    layers = even_split(len(ctx.model.layers), par.pp)
    rc = layers if par.recompute != "none" else tuple(() for _ in layers)
    return ctx.evaluator.estimate(
        ctx.model, ctx.cluster, training_for(ctx.training, cand), par, layers, rc,
        cand.knobs.dispatcher,
    )  # fmt: skip


def _best_of(ctx: SearchContext, layouts: Iterable[tuple[ParallelConfig, bool]]) -> _Scored | None:
    best = None
    for order, (par, zero) in enumerate(layouts):
        cand = Candidate(par, Knobs("zero" if zero else "none", False, _dispatcher(ctx)))
        training = training_for(ctx.training, cand)
        inp = ctx.evaluator.cost_inputs(
            ctx.model, ctx.cluster, training, par, cand.knobs.dispatcher
        )
        step = _even_score(inp, par)
        if step is not None and (best is None or (step, order) < (best.step_s, best.order)):
            best = _Scored(step, order, cand)
    return best


def xmoe(ctx: SearchContext) -> Baseline:
    """pp=1, tp=1, dp=GPUs, flat EP; best micro-batch and recompute; ZeRO when needed."""
    gpus, batch = ctx.space.gpus, ctx.training.global_batch
    if batch % gpus:
        return Baseline("xmoe", TITLES["xmoe"], None, False, None, "GPUs do not divide the batch")
    ep = max(d for d in divisors(gpus) if max(ctx.model.num_experts, 1) % d == 0)
    per_dp = batch // gpus
    layouts = [
        ParallelConfig(1, gpus, 1, ep, mb, per_dp // mb, rc)
        for rc in ("none", "full")
        for mb in divisors(per_dp)
    ]
    plain = _best_of(ctx, [(par, False) for par in layouts])
    if plain is not None:
        return _finish(ctx, "xmoe", plain, "")
    best = _best_of(ctx, [(par, True) for par in layouts])
    return _finish(
        ctx, "xmoe", best, "does not fit even with ZeRO and full recompute", "needs ZeRO to fit"
    )


def generic(ctx: SearchContext) -> Baseline:
    """The layout for a model without a published recipe: EP inside a node (the largest
    divisor of the experts that fits one), the fewest pipeline stages that fit with an even
    split (tp grown inside the node before pp), micro-batch 1, no recompute when that fits,
    the distributed optimizer when the search may use it."""
    g, gpus = ctx.cluster.gpus_per_node, ctx.space.gpus
    experts = max(ctx.model.num_experts, 1)
    heads = ctx.model.layers[0].attention.num_heads
    ep = max(d for d in divisors(experts) if d <= g and gpus % d == 0)
    tps = [t for t in divisors(heads) if t <= g and gpus % t == 0]
    for rc in ("none", "full"):
        for pp in divisors(gpus):
            for tp in tps:
                if gpus % (pp * tp) or pp > ctx.model.num_layers:
                    continue
                dp = gpus // (pp * tp)
                if ctx.training.global_batch % dp or (dp * tp) % ep:
                    continue
                par = ParallelConfig(pp, dp, tp, ep, 1, ctx.training.global_batch // dp, rc)
                best = _best_of(ctx, [(par, "zero" in ctx.space.sharding)])
                if best is not None:
                    return _finish(ctx, "generic", best, "")
    return _finish(ctx, "generic", None, "no pipeline depth fits with an even split")


RECIPES_PRICED = 4  # recipes that run on the plan's GPUs, priced to find one that fits


def recipe(ctx: SearchContext) -> Baseline | None:
    """The model's published layout (planner.search.recipes): of the closest RECIPES_PRICED
    recipes that run on the plan's GPUs and batch (dp filling the GPUs), the first that fits,
    else the first; its dispatcher and all-to-all overlap where the plan's engine runs them
    (else the flat all-to-all, no overlap), the distributed optimizer. None when the model
    has no recipe that runs here."""
    found = []
    for r in recipes_for(ctx.model.name, ctx.cluster.device.name, ctx.training.dtype):
        par = recipe_layout(r, ctx.space.gpus, ctx.training.global_batch)
        if par is None or par.pp > ctx.model.num_layers:
            continue
        found.append(_recipe_baseline(ctx, r, par))
        if found[-1].estimate.fits or len(found) == RECIPES_PRICED:  # type: ignore[union-attr]
            break
    fitting = [b for b in found if b.estimate is not None and b.estimate.fits]
    return (fitting or found or [None])[0]


def _recipe_baseline(ctx: SearchContext, r: Recipe, par: ParallelConfig) -> Baseline:
    space = ctx.space
    dispatcher = r.dispatcher if r.dispatcher in space.dispatchers else _dispatcher(ctx)
    overlap = r.a2a_overlap and space.a2a_overlap is not False and par.pp > 1
    cand = Candidate(par, Knobs("zero", overlap, dispatcher))  # type: ignore[arg-type]
    scaled = "" if r.gpus == space.gpus else f"published on {r.gpus} GPUs, dp scaled"
    title = f"{r.source} recipe ({r.gpus} {r.hardware}, {r.dtype})"
    outside = outside_search(space, par, cand.knobs)
    return Baseline(
        "recipe", title, par, True, _even_estimate(ctx, cand), scaled, cand.knobs, outside
    )


def all_baselines(
    ctx: SearchContext, inputs: Mapping[Candidate, StageCostInputs]
) -> tuple[Baseline, ...]:
    """The uniform split, the X-MoE-like layout, and the model's published recipe (or, for a
    model without one, the generic layout)."""
    return (uniform(ctx, inputs), xmoe(ctx), recipe(ctx) or generic(ctx))
