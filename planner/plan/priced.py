"""An export carries every priced setting or refuses: the plan against the engine's table.

`check_priced(plan, engine)` compares what the plan was priced with (plan.json's training,
layout, stages, dispatcher and expert placement) with what the engine runs
(planner.targets.Target) and raises one SpecError line naming the first setting the engine
would run differently, with the fix: re-plan with `--target ENGINE`, whose search offers only
what that engine runs and prices it with its conventions. A control character in a value the
line quotes (a plan built in code skips plan.json's checks) is escaped, so the error stays
one line.
"""

from __future__ import annotations

from collections.abc import Iterator

from planner.plan.check import one_line
from planner.plan.schema import Plan
from planner.specs import SpecError
from planner.targets import Target, etp_allowed, get_target


def check_priced(plan: Plan, engine: str, where: str = "plan.json") -> Target:
    """Raise SpecError on the first priced setting `engine` cannot run as priced; return the
    engine's Target when every setting carries."""
    target = get_target(engine)
    for problem in _differences(plan, target):
        head = f"{where}: " if where else ""
        raise SpecError(
            one_line(
                f"{head}{problem}, which {target.engine} {target.version} does not run as "
                f"priced; re-plan with --target {engine} (the plan was made for --target "
                f"{plan.extra.get('target', 'piper')})"
            )
        )
    return target


def _differences(plan: Plan, t: Target) -> Iterator[str]:
    """Each priced setting that `t` runs differently, as a phrase."""
    tr, par = plan.training, plan.parallel
    # fp32 training keeps 4 + 4 + 8 B whatever the accounting (resources.memory)
    if tr.get("bytes_per_param", 16) != t.bytes_per_param and tr.get("dtype") != "fp32":
        yield (
            f"it is priced with {tr.get('bytes_per_param', 16)} B of training state per "
            f"parameter where the engine keeps {t.bytes_per_param}"
        )
    if bool(tr.get("gate_in_activation", False)) != t.gate_in_activation:
        where = "inside the expert activation" if t.gate_in_activation else "at the combine"
        yield f"it is priced with the router weights applied elsewhere than {where}"
    yield from _knobs(plan, t)
    yield from _recompute(plan, t)
    if par.vp > 1 and not t.vp:
        yield f"it interleaves vp={par.vp} chunks per pipeline rank"
    if par.cp > 1 and not t.cp:
        yield f"it uses context parallelism cp={par.cp}"
    if not etp_allowed(t.etp_rule, par.etp, par.tp, par.ep):
        yield (f"it splits experts over etp={par.etp} with tp={par.tp} and ep={par.ep} (the "
               "engine runs etp = tp without expert parallelism, 1 with it)")  # fmt: skip
    if not t.expert_placement:
        yield from _placement(plan)


def _knobs(plan: Plan, t: Target) -> Iterator[str]:
    tr = plan.training
    dispatcher = plan.extra.get("dispatcher", "flat")
    if dispatcher not in t.dispatchers:
        yield f"it is priced with the {dispatcher} dispatcher"
    sharding = "fsdp" if tr.get("fsdp") else "zero" if tr.get("zero") else "none"
    if sharding not in t.sharding:
        names = {"zero": "the distributed optimizer", "fsdp": "FSDP", "none": "no sharding"}
        yield f"it is priced with {names[sharding]}"
    if tr.get("a2a_overlap") and not t.a2a_overlap:
        yield "it is priced with the 1F1B all-to-all overlap"
    graphs = tr.get("cuda_graphs")
    if graphs not in (None, "none") and graphs not in t.cuda_graphs:
        yield f"it is priced with CUDA graphs ({graphs})"
    if tr.get("dtype", "bf16") not in t.dtypes:
        yield f"it is priced in {tr.get('dtype')}"
    if tr.get("optimizer_dtype", "fp32") not in t.optimizer_dtypes:
        yield f"it is priced with {tr.get('optimizer_dtype')} Adam moments"
    if not tr.get("master_weights", True):
        yield "it is priced without fp32 master weights"
    if tr.get("fsdp") and tr.get("fsdp_reduce_dtype") != t.fsdp_reduce_dtype:
        priced = tr.get("fsdp_reduce_dtype") or "the gradient dtype"
        yield f"it is priced with FSDP reduce-scattering gradients in {priced}"
    if tr.get("mtp_layers") and not t.mtp:
        yield f"it trains {tr.get('mtp_layers')} MTP layers"
    if t.name != "megatron":
        if tr.get("optimizer_offload_fraction"):
            yield f"it offloads {tr.get('optimizer_offload_fraction')} of the optimizer state"
        if tr.get("precision_aware_optimizer"):
            yield "it is priced with Megatron's precision-aware optimizer"
        if tr.get("grad_dtype"):
            yield f"it is priced with a {tr.get('grad_dtype')} gradient buffer"
        if tr.get("activation_offload_modules"):
            yield f"it offloads the activations of {tr.get('activation_offload_modules')}"


def _recompute(plan: Plan, t: Target) -> Iterator[str]:
    par = plan.parallel
    if par.recompute == "none":
        return
    if par.recompute not in t.recompute:
        yield f"it recomputes with the {par.recompute} policy"
        return
    modules = set(par.recompute_modules)
    if t.recompute_modules is not None and par.recompute == "selective":
        if not modules <= set(t.recompute_modules):
            yield f"it recomputes the modules {sorted(modules - set(t.recompute_modules))}"
    if not t.per_layer_recompute:
        layers = sum(len(s.layers) for s in plan.stages)
        chosen = [len(s.recompute_layers) for s in sorted(plan.stages, key=lambda s: s.stage)]
        if sum(chosen) < layers:
            yield (
                f"it recomputes {sum(chosen)} of {layers} layers (per stage {chosen}) where "
                "the engine applies the policy to every layer"
            )


def noncontiguous_expert_layers(plan: Plan) -> int:
    """MoE layers whose placement is not the default 'expert e on EP rank e // (E/ep)'."""
    permuted = 0
    for placement in plan.experts:
        n = len(placement.rank_of_expert)
        per_rank = max(1, n // plan.parallel.ep)
        if list(placement.rank_of_expert) != [e // per_rank for e in range(n)]:
            permuted += 1
    return permuted


def _placement(plan: Plan) -> Iterator[str]:
    permuted = noncontiguous_expert_layers(plan)
    if permuted:
        yield (
            f"it places experts off the engine's default (expert e on EP rank e // (E/ep)) "
            f"on {permuted} of {len(plan.experts)} MoE layers"
        )
    if any(p.slots for p in plan.experts):
        yield "it keeps redundant expert replicas"
