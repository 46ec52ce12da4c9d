"""From a plan and RunOptions to a RunSpec: what one training run executes, on every rank.

Pure Python (no torch): `piper run` checks a plan with it before it launches processes, and
every process of the run builds its RunSpec with it. `--scale F` shrinks the model through
planner.run.scale; here the sequence, micro-batches and vocabulary follow it too.

Shape letters: L = layers, E = routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from planner.parallel import default_placement
from planner.plan import ClusterEntry, Plan, load_plan
from planner.run.options import Dispatcher, RunOptions
from planner.run.scale import keep_layers, scale_layer, scale_width
from planner.specs import ModelSpec, SpecError

BYTE_VOCAB = 256


@dataclass(frozen=True)
class RunSpec:
    """Everything one training run needs; identical on every rank.

    stage_layers: run-model layer indices per pipeline stage. placements: (run layer,
    rank_of_expert_E) per MoE layer. source_layers: plan layer index of each run layer.
    logical_of_physical: logical rank (plan convention) run by process RANK p.
    """

    model: ModelSpec
    pp: int
    dp: int
    ep: int
    micro_batch: int
    num_microbatches: int
    seq_len: int
    stage_layers: tuple[tuple[int, ...], ...]
    placements: tuple[tuple[int, tuple[int, ...]], ...]
    source_layers: tuple[int, ...]
    logical_of_physical: tuple[int, ...]
    ranks_per_node: int
    tp: int = 1
    recompute: str = "none"  # the plan's policy: none | selective | full
    recompute_layers: tuple[int, ...] = ()  # run-model layers it applies to
    steps: int = 30
    seed: int = 0
    lr: float = 3e-3
    dispatcher: Dispatcher = "halo"
    migrate_every: int = 0
    trace_every: int = 1  # steps summed into one trace.csv interval
    router_bias_rate: float = 0.0  # aux-loss-free bias update per step (0 = off)
    halo_direct_below_bytes: int = -1  # HALO's direct-send threshold; -1 = its default
    # HaloCost from the plan's cluster: (message s, intra-node GB/s, node link GB/s); () = none
    halo_cost: tuple[float, ...] = ()

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def edp(self) -> int:
        return self.dp * self.tp // self.ep

    @property
    def tokens_per_step(self) -> int:
        return self.dp * self.micro_batch * self.num_microbatches * self.seq_len

    def placement_of(self, layer: int) -> tuple[int, ...] | None:
        return dict(self.placements).get(layer)


def _plan_stages(plan: Plan, model: ModelSpec, scale: float) -> list[tuple[int, ...]]:
    """The plan's stage layers, after checking what the runtime can execute."""
    par = plan.parallel
    if not 0.0 < scale <= 1.0:
        raise SpecError(f"--scale must be in (0, 1], got {scale}")
    if par.cp > 1:
        raise SpecError(
            f"plan: cp={par.cp} (context parallel) does not run on this runtime; train it "
            "with Megatron-LM: 'piper export PLAN --to megatron'"
        )
    for knob in ("vp", "etp"):
        if getattr(par, knob) > 1:
            raise SpecError(
                f"plan: {knob}={getattr(par, knob)} does not run on this runtime yet; train it "
                "with Megatron-LM: 'piper export PLAN --to megatron'"
            )
    if len(plan.stages) != par.pp:
        raise SpecError(
            f"plan: {len(plan.stages)} stages but parallel.pp={par.pp}; "
            "regenerate it with 'piper plan'"
        )
    stages = [tuple(s.layers) for s in sorted(plan.stages, key=lambda s: s.stage)]
    if [i for s in stages for i in s] != list(range(model.num_layers)):
        raise SpecError(f"plan: stages must cover layers 0..{model.num_layers - 1} in order")
    return stages


def _placements(plan: Plan, model: ModelSpec, source: list[int]):
    """(run layer, rank_of_expert_E) for every kept MoE layer, checked."""
    placement_of = {e.layer: tuple(e.rank_of_expert) for e in plan.experts}
    out = []
    for run_i, plan_i in enumerate(source):
        moe = model.layers[plan_i].moe
        if moe is None:
            continue
        table = placement_of.get(plan_i) or default_placement(moe.num_experts, plan.parallel.ep)
        check_placement(table, moe.num_experts, plan.parallel.ep, plan_i)
        out.append((run_i, table))
    return tuple(out)


def run_spec_from_plan(
    plan: Plan, model: ModelSpec, scale: float = 1.0, ranks_per_node: int | None = None, **options
) -> RunSpec:
    """Build the RunSpec for `plan` (model = the plan's ModelSpec), shrunk by `scale`.

    options: steps, seed, lr, dispatcher, migrate_every, ... (RunSpec fields).
    Raises SpecError for plans the runtime cannot execute (bad stages, widths that tp does
    not divide).
    """
    par = plan.parallel
    kept = keep_layers(_plan_stages(plan, model, scale), model, scale)
    source = [i for s in kept for i in s]
    vocab = BYTE_VOCAB if scale < 1.0 else model.vocab_size
    if vocab < BYTE_VOCAB:
        raise SpecError(f"model {model.name}: vocab_size {vocab} < 256 byte ids")
    run_model = replace(
        model,
        layers=tuple(scale_layer(model.layers[i], scale, par.tp) for i in source),
        vocab_size=vocab,
        hidden_size=scale_width(model.hidden_size, scale),
        num_mtp_layers=0,
    )
    starts = [sum(len(s) for s in kept[:i]) for i in range(par.pp + 1)]
    seq_len = int(plan.training.get("seq_len", 4096))
    num_mb = par.num_microbatches
    if scale < 1.0:
        seq_len = max(16, int(round(seq_len * scale)))
        num_mb = max(par.pp, int(round(num_mb * scale)))
    _check_tp(run_model, par.tp)
    recomputed = {i for s in plan.stages for i in s.recompute_layers}
    recompute = par.recompute if recomputed and par.recompute != "none" else "none"
    world = par.pp * par.dp * par.tp
    return RunSpec(
        model=run_model,
        pp=par.pp,
        dp=par.dp,
        ep=par.ep,
        micro_batch=par.micro_batch,
        num_microbatches=num_mb,
        seq_len=seq_len,
        stage_layers=tuple(tuple(range(starts[i], starts[i + 1])) for i in range(par.pp)),
        placements=_placements(plan, model, source),
        source_layers=tuple(source),
        logical_of_physical=physical_order(plan),
        ranks_per_node=ranks_per_node or min(world, plan.cluster.gpus_per_node or world),
        tp=par.tp,
        recompute=recompute,
        recompute_layers=tuple(i for i, src in enumerate(source) if src in recomputed)
        if recompute != "none"
        else (),
        **{"halo_cost": halo_cost_of(plan.cluster), **options},
    )


def _check_tp(model: ModelSpec, tp: int) -> None:
    """Tensor parallelism splits heads and dense widths evenly: refuse what tp does not divide."""
    if tp == 1:
        return
    for i, layer in enumerate(model.layers):
        att = layer.attention
        widths = {"num_kv_heads": att.num_kv_heads, "num_heads": att.num_heads}
        if layer.dense_ffn:
            widths["dense ffn"] = layer.dense_ffn
        if layer.moe is not None and layer.moe.num_shared_experts and layer.moe.shared_ffn:
            widths["shared experts' ffn"] = layer.moe.num_shared_experts * layer.moe.shared_ffn
        for name, n in widths.items():
            if n % tp:
                raise SpecError(
                    f"plan: parallel.tp={tp} does not divide layer {i}'s {name} ({n}); "
                    "re-plan with a tp that divides it (--tp 1 always works)"
                )


def halo_cost_of(cluster: ClusterEntry) -> tuple[float, ...]:
    """HALO's path-choice costs from a plan's cluster: the per-message overhead, the slowest
    level inside a node (per device) and the node's NICs together; () when fields are missing."""
    gpus, profile = cluster.gpus_per_node, cluster.profile
    if gpus is None:
        return ()
    try:
        inside = [lv for lv in profile["levels"] if int(lv["devices"]) <= gpus]
        intra = min(float(lv["bw_gbps"]) * float(lv.get("taper", 1.0)) for lv in inside)
        link = int(profile["nics_per_node"]) * float(profile["nic_gbps"])
        message_s = float(profile.get("msg_overhead_us", 1.0)) * 1e-6
    except (KeyError, TypeError, ValueError):
        return ()
    return (message_s, intra, link)


def check_placement(table, num_experts: int, ep: int, layer: int) -> None:
    if len(table) != num_experts or any(not 0 <= r < ep for r in table):
        raise SpecError(
            f"plan: experts[layer={layer}].rank_of_expert must list {num_experts} "
            f"EP ranks in 0..{ep - 1}"
        )
    if num_experts % ep or any(table.count(r) != num_experts // ep for r in range(ep)):
        raise SpecError(
            f"plan: experts[layer={layer}] must give every EP rank "
            f"{num_experts // max(1, ep)} experts"
        )


def physical_order(plan: Plan) -> tuple[int, ...]:
    """Logical rank run by each process: the plan's ranks sorted by (node, local_rank)."""
    world = plan.parallel.pp * plan.parallel.dp * plan.parallel.tp
    if not plan.ranks:
        return tuple(range(world))
    rows = sorted(plan.ranks, key=lambda r: (r.node, r.local_rank, r.rank))
    order = tuple(r.rank for r in rows)
    if sorted(order) != list(range(world)):
        raise SpecError(f"plan: ranks must list logical ranks 0..{world - 1} once each")
    return order


def spec_from_options(options: RunOptions) -> RunSpec:
    """Load options.plan and its model and build the run's (scaled) RunSpec.

    Every RunOptions field that is also a RunSpec field (steps, seed, lr, dispatcher, ...)
    is passed through; raises SpecError as run_spec_from_plan does.
    """
    plan = load_plan(options.plan)
    passed = {f.name for f in fields(RunSpec)} - {"ranks_per_node"}
    return run_spec_from_plan(
        plan,
        plan.model_spec(options.plan),
        options.scale,
        options.ranks_per_node,
        **{f.name: getattr(options, f.name) for f in fields(options) if f.name in passed},
    )


def checked_spec(options: RunOptions) -> RunSpec:
    """The RunSpec `piper run` launches, after the checks it makes before starting processes
    (the plan, --scale, --nproc, --ranks-per-node); any failure is one SpecError line that
    starts with the plan's path."""
    try:
        spec = spec_from_options(options)
        if options.nproc is not None and options.nproc != spec.world:
            raise SpecError(
                f"--nproc {options.nproc} != the plan's pp*dp*tp = {spec.world}; "
                f"use --nproc {spec.world}"
            )
        if spec.world % spec.ranks_per_node:
            raise SpecError(
                f"--ranks-per-node {spec.ranks_per_node} must divide the {spec.world} ranks"
            )
    except (SpecError, KeyError, TypeError) as exc:
        raise SpecError(f"{options.plan}: {exc}") from None
    return spec
