"""From a plan to a RunSpec: what one training run executes, optionally shrunk by `--scale F`.

Pure Python (no torch), so `piper run` can validate a plan before it launches processes.

What `--scale F` (0 < F < 1) changes, and what it keeps:
- kept: pp, dp, tp, ep, edp, the number of experts (so experts per rank), top-k, gating,
  shared experts, the expert placement of every kept MoE layer, the rank -> node layout.
- widths: hidden size, head dim, every FFN width (dense, routed, shared) are multiplied by F
  and rounded to a multiple of 8 (at least 8); key/value heads by F (at least 1) with the
  query/kv head ratio kept; MLA becomes GQA of the same (scaled) head count.
- depth: stage s keeps max(1, round(n_s * F)) of its n_s layers, evenly spaced from its first
  layer, and at least one MoE layer if it had one, so stage boundaries stay in proportion.
- sequence length: max(16, round(seq_len * F)); micro-batches per step: max(pp, round(m * F));
  the micro-batch size is kept. Vocabulary becomes 256 (the data is bytes).
F = 1 runs the plan as is (the vocabulary must then hold 256 byte ids).

Shape letters: L = layers, E = routed experts.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Literal

from planner.parallel import default_placement
from planner.plan.schema import ClusterEntry, ModelEntry, Plan
from planner.specs import AttentionSpec, LayerSpec, ModelSpec, SpecError

Dispatcher = Literal["halo", "halo-dedup", "flat"]
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
    migrate_policy: Literal["planner", "greedy", "rotate"] = "planner"
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


def _width(x: int, factor: float) -> int:
    if x <= 0 or factor >= 1.0:
        return x
    return max(8, int(round(x * factor / 8.0)) * 8)


def scale_attention(att: AttentionSpec, factor: float, tp: int = 1) -> AttentionSpec:
    """Shrink one attention block; MLA becomes GQA with the same head count (see module doc).
    Shrunk key/value heads stay a multiple of tp, so tensor parallelism can split them."""
    head_dim = att.head_dim or (att.qk_nope_head_dim + att.qk_rope_head_dim)
    kv = att.num_kv_heads if att.kind != "mla" else att.num_heads
    group = max(1, att.num_heads // max(1, kv))
    if factor < 1.0:
        head_dim = max(8, 2 * int(round(head_dim * factor / 2.0)))
        kv = tp * max(1, int(round(kv * factor / tp)))
    kind = "gqa" if att.kind == "mla" else att.kind
    return AttentionSpec(
        kind=kind,
        num_heads=kv * group,
        num_kv_heads=kv,
        head_dim=head_dim,
        bias=att.bias,
        o_bias=att.o_bias,
        qk_norm=att.qk_norm,
    )


def scale_layer(layer: LayerSpec, factor: float, tp: int = 1) -> LayerSpec:
    moe = layer.moe
    if moe is not None:
        moe = replace(
            moe,
            expert_ffn=_width(moe.expert_ffn, factor),
            shared_ffn=_width(moe.shared_ffn, factor),
        )
    return replace(
        layer,
        attention=scale_attention(layer.attention, factor, tp),
        dense_ffn=_width(layer.dense_ffn, factor),
        moe=moe,
    )


def keep_layers(stage_layers: list[tuple[int, ...]], model: ModelSpec, factor: float):
    """Plan layer indices kept per stage: evenly spaced, at least one MoE layer if any."""
    kept = []
    for layers in stage_layers:
        n = len(layers)
        n_new = n if factor >= 1.0 else max(1, int(round(n * factor)))
        pick = [layers[(i * n) // n_new] for i in range(n_new)]
        moe = [i for i in layers if model.layers[i].kind == "moe"]
        if moe and not any(model.layers[i].kind == "moe" for i in pick):
            pick[-1] = moe[-1]
        kept.append(tuple(pick))
    return kept


def _plan_stages(plan: Plan, model: ModelSpec, scale: float) -> list[tuple[int, ...]]:
    """The plan's stage layers, after checking what the runtime can execute."""
    par = plan.parallel
    if not 0.0 < scale <= 1.0:
        raise SpecError(f"--scale must be in (0, 1], got {scale}")
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

    options: steps, seed, lr, dispatcher, migrate_every, migrate_policy (RunSpec fields).
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
        hidden_size=_width(model.hidden_size, scale),
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


def hand_plan(
    model: ModelSpec,
    pp: int,
    dp: int,
    ep: int,
    micro_batch: int = 1,
    num_microbatches: int = 2,
    seq_len: int = 64,
    gpus_per_node: int = 8,
    model_entry: ModelEntry | None = None,
    tp: int = 1,
) -> Plan:
    """A plan written by hand (no solver): even stages, contiguous expert blocks, ranks in
    order. For tests and quick runs; `model_entry` is plan.model (name, source, config)."""
    from planner.plan.schema import (
        ExpertPlacement,
        ParallelPlan,
        Predicted,
        RankPlan,
        SolveReport,
        StagePlan,
    )

    n = model.num_layers
    bounds = [round(s * n / pp) for s in range(pp + 1)]
    stages = tuple(StagePlan(s, tuple(range(bounds[s], bounds[s + 1]))) for s in range(pp))
    experts = tuple(
        ExpertPlacement(i, default_placement(model.layers[i].moe.num_experts, ep))
        for i in model.moe_layers
    )
    block = dp * tp
    ranks = tuple(
        RankPlan(
            r, r // gpus_per_node, r % gpus_per_node, r // block, r % block // tp, r % tp,
            r % block % ep,
        )
        for r in range(pp * block)
    )  # fmt: skip
    return Plan(
        model=model_entry or ModelEntry(model.name, model.source),
        cluster=ClusterEntry(
            "hand", gpus_per_node=gpus_per_node, nodes=-(-pp * block // gpus_per_node)
        ),
        training={"seq_len": seq_len, "global_batch": dp * micro_batch * num_microbatches},
        parallel=ParallelPlan(pp, dp, tp, ep, block // ep, micro_batch, num_microbatches, "none"),
        stages=stages,
        experts=experts,
        ranks=ranks,
        predicted=Predicted(0.0, 0.0, 0.0, 0.0, 0.0, tuple(0.0 for _ in range(pp)), 0.0),
        solver=SolveReport("none", "NOT_SOLVED", 0.0, 0.0, 0.0),
    )


def check_main(argv: list[str] | None = None) -> int:
    """`python -m runtime.scale PLAN --scale F [--ranks-per-node G] [--nproc N]`: validate a
    plan for the runtime without importing torch; prints the run's shape as one JSON line,
    or one error line and exit code 2."""
    import argparse
    import json
    import sys

    from planner.plan import load_plan

    p = argparse.ArgumentParser(prog="python -m runtime.scale")
    p.add_argument("plan")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--ranks-per-node", type=int, default=None)
    p.add_argument("--nproc", type=int, default=None)
    args = p.parse_args(argv)
    try:
        plan = load_plan(args.plan)
        model = plan.model_spec(args.plan)
        spec = run_spec_from_plan(plan, model, args.scale, args.ranks_per_node)
        if args.nproc is not None and args.nproc != spec.world:
            raise SpecError(
                f"--nproc {args.nproc} != the plan's pp*dp*tp = {spec.world}; "
                f"use --nproc {spec.world}"
            )
        if spec.world % spec.ranks_per_node:
            raise SpecError(
                f"--ranks-per-node {spec.ranks_per_node} must divide the {spec.world} ranks"
            )
    except (SpecError, KeyError, TypeError) as exc:
        print(f"{exc}", file=sys.stderr)
        return 2
    shape = {
        "world": spec.world,
        "pp": spec.pp,
        "dp": spec.dp,
        "tp": spec.tp,
        "ep": spec.ep,
        "edp": spec.edp,
        "layers": spec.model.num_layers,
        "hidden_size": spec.model.hidden_size,
        "seq_len": spec.seq_len,
        "micro_batch": spec.micro_batch,
        "num_microbatches": spec.num_microbatches,
        "ranks_per_node": spec.ranks_per_node,
        "source_layers": list(spec.source_layers),
    }
    print(json.dumps(shape, sort_keys=True))
    return 0


if __name__ == "__main__":
    raise SystemExit(check_main())
