"""From a plan and RunOptions to a RunSpec: what one training run executes, on every rank.

Pure Python (no torch): `piper run` checks a plan with it before it launches processes, and
every process of the run builds its RunSpec with it. `--scale F` shrinks the model through
planner.run.scale; here the sequence, micro-batches and vocabulary follow it too.

Shape letters: L = layers, E = routed experts.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, fields, replace

from planner.inputs.numerics import ModelArch
from planner.migration.placement import EMPTY
from planner.parallel import default_placement
from planner.plan import ClusterEntry, Plan, load_plan
from planner.plan.priced import check_priced
from planner.resources.layer_comm import runtime_dispatcher
from planner.run.hf_checkpoint import check_hf_checkpoint
from planner.run.layout import (
    check_expert_tp,
    check_fsdp,
    rank_layers,
    refuse_context_parallel,
    virtual_stages,
)
from planner.run.numerics import DEFAULT_ARCH, check_arch, run_arch
from planner.run.options import Dispatcher, RunOptions
from planner.run.scale import keep_layers, scale_layer, scale_width
from planner.specs import ModelSpec, SpecError

BYTE_VOCAB = 256


@dataclass(frozen=True)
class ExpertSlots:
    """The expert slots of one MoE layer: which expert each slot of each EP rank holds.

    slots_RS[r][s]: the expert in slot s of EP rank r (EMPTY = -1: a free slot). A rank's
    number of slots is fixed for the run (plan.json's `experts[].slots`, E/ep without
    replicas; ranks may differ); an expert held by several ranks is replicated, never twice
    on one rank. share_RS[r][s]: the fraction of that expert's tokens the copy takes (the
    copies of one expert sum to 1; 0 for an empty slot). planner.migration.placement's
    slots_RS arrays are the same table padded with EMPTY.
    """

    slots_RS: tuple[tuple[int, ...], ...]
    share_RS: tuple[tuple[float, ...], ...]

    @classmethod
    def of_ranks(
        cls, rank_of_expert_E: Sequence[int], ranks: int, redundant_slots: int = 0
    ) -> ExpertSlots:
        """Each rank's experts ascending, then `redundant_slots` empty slots."""
        rows = [
            [e for e, r in enumerate(rank_of_expert_E) if r == rank] + [EMPTY] * redundant_slots
            for rank in range(ranks)
        ]
        return cls.even(rows)

    @classmethod
    def even(cls, slots_RS: Sequence[Sequence[int]]) -> ExpertSlots:
        """The table with every expert's tokens split evenly over its copies."""
        copies: dict[int, int] = {}
        for e in (e for row in slots_RS for e in row if e != EMPTY):
            copies[e] = copies.get(e, 0) + 1
        share = tuple(tuple(1.0 / copies[e] if e != EMPTY else 0.0 for e in r) for r in slots_RS)
        return cls(tuple(tuple(int(e) for e in row) for row in slots_RS), share)

    def holders(self, expert: int) -> tuple[tuple[int, int], ...]:
        """(rank, slot) of every copy of `expert`, ranks ascending."""
        return tuple(
            (r, s) for r, row in enumerate(self.slots_RS) for s, e in enumerate(row) if e == expert
        )

    def rank_of_expert(self, num_experts: int) -> tuple[int, ...]:
        """The lowest rank holding each expert."""
        return tuple(self.holders(e)[0][0] for e in range(num_experts))

    def reorder(self, rows: Sequence[int]) -> ExpertSlots:
        """The table whose row i is this table's row rows[i] (e.g. plan EP index -> group rank)."""
        return ExpertSlots(
            tuple(self.slots_RS[r] for r in rows), tuple(self.share_RS[r] for r in rows)
        )


@dataclass(frozen=True)
class RunSpec:
    """Everything one training run needs; identical on every rank.

    stage_layers: run-model layer indices per pipeline rank (all its chunks; `chunks`).
    placements: (run layer,
    rank_of_expert_E) per MoE layer (with replicas: the lowest EP rank holding each expert).
    slots: (run layer, ExpertSlots) for the layers with spare slots or replicas; a layer
    not listed holds its placement, E/ep experts per rank (`slots_of`).
    source_layers: plan layer index of each run layer.
    logical_of_physical: logical rank (plan convention) run by process RANK p.
    arch: the model's numerics (RoPE, norm epsilon, router, activation); arch_source says
    where they come from (planner.run.numerics.run_arch).
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
    vp: int = 1  # model chunks per pipeline rank (interleaved 1F1B when > 1)
    etp: int = 1  # expert tensor parallel: ranks splitting each routed expert's FFN width
    fsdp: bool = False  # weights, gradients and optimizer state sharded (fully_shard)
    chunk_layers: tuple[tuple[int, ...], ...] = ()  # per virtual stage k; () = stage_layers
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
    slots: tuple[tuple[int, ExpertSlots], ...] = ()
    arch: ModelArch = field(default_factory=ModelArch)
    arch_source: str = DEFAULT_ARCH

    @property
    def world(self) -> int:
        return self.pp * self.dp * self.tp

    @property
    def edp(self) -> int:
        return self.dp * self.tp // (self.etp * self.ep)

    @property
    def tokens_per_step(self) -> int:
        return self.dp * self.micro_batch * self.num_microbatches * self.seq_len

    def placement_of(self, layer: int) -> tuple[int, ...] | None:
        return dict(self.placements).get(layer)

    def chunks(self, stage: int) -> tuple[tuple[int, tuple[int, ...]], ...]:
        """(virtual stage k, run layers) of each model chunk pipeline rank `stage` runs;
        chunk c is virtual stage c * pp + stage (planner/run/layout.py)."""
        virtual = self.chunk_layers or self.stage_layers
        return tuple((k, virtual[k]) for k in range(stage, self.pp * self.vp, self.pp))

    def slots_of(self, layer: int) -> ExpertSlots | None:
        """The slot table of MoE layer `layer` in plan EP indices (None: not an MoE layer)."""
        table = dict(self.slots).get(layer)
        placement = self.placement_of(layer)
        if table is None and placement is not None:
            table = ExpertSlots.of_ranks(placement, self.ep)
        return table


def _plan_stages(plan: Plan, model: ModelSpec, scale: float) -> list[tuple[int, ...]]:
    """The plan's layers per virtual stage (pp * vp of them), after checking what the
    runtime can execute."""
    par = plan.parallel
    if not 0.0 < scale <= 1.0:
        raise SpecError(f"--scale must be in (0, 1], got {scale}")
    refuse_context_parallel(par.cp)
    if len(plan.stages) != par.pp:
        raise SpecError(
            f"plan: {len(plan.stages)} stages but parallel.pp={par.pp}; "
            "regenerate it with 'piper plan'"
        )
    stages = [tuple(s.layers) for s in sorted(plan.stages, key=lambda s: s.stage)]
    return virtual_stages(stages, par.vp, model.num_layers)


def _placements(plan: Plan, model: ModelSpec, source: list[int]):
    """RunSpec's placements and slots ((run layer, rank_of_expert_E) per kept MoE layer;
    (run layer, ExpertSlots) for those with plan.json `slots`, tokens split evenly), checked."""
    entry_of = {e.layer: e for e in plan.experts}
    ep, placements, slots = plan.parallel.ep, [], []
    for run_i, plan_i in enumerate(source):
        moe = model.layers[plan_i].moe
        if moe is None:
            continue
        entry = entry_of.get(plan_i)
        if entry is not None and entry.slots:
            table = ExpertSlots.even(entry.slots)
            check_slots(table, moe.num_experts, ep, plan_i)
            placements.append((run_i, table.rank_of_expert(moe.num_experts)))
            slots.append((run_i, table))
            continue
        ranks = tuple(entry.rank_of_expert) if entry else default_placement(moe.num_experts, ep)
        check_placement(ranks, moe.num_experts, ep, plan_i)
        placements.append((run_i, ranks))
    return tuple(placements), tuple(slots)


def _mtp_layers(plan: Plan, model: ModelSpec) -> int:
    """The MTP modules the plan priced: training.mtp_layers, else the model's."""
    mtp = plan.training.get("mtp_layers")
    return model.num_mtp_layers if mtp is None else int(mtp)


def run_spec_from_plan(
    plan: Plan,
    model: ModelSpec,
    scale: float = 1.0,
    ranks_per_node: int | None = None,
    hf_weights: str | None = None,
    **options,
) -> RunSpec:
    """Build the RunSpec for `plan` (model = the plan's ModelSpec), shrunk by `scale`.

    hf_weights: a Hugging Face checkpoint directory the run starts from; its config.json
    gives the numerics when the plan has none (run_arch).
    options: steps, seed, lr, dispatcher, migrate_every, ... (RunSpec fields).
    Raises SpecError for plans the runtime cannot execute (bad stages, widths that tp does
    not divide) and, at scale 1, for a plan priced with settings it runs differently
    (planner.plan.priced: made for another --target).
    """
    par = plan.parallel
    kept = keep_layers(_plan_stages(plan, model, scale), model, scale)
    if scale == 1.0:  # the priced run itself; a --scale'd run is a rehearsal on fewer cores
        check_priced(plan, "piper", where="")
    source = [i for s in kept for i in s]
    vocab = BYTE_VOCAB if scale < 1.0 else model.vocab_size
    if vocab < BYTE_VOCAB:
        raise SpecError(f"model {model.name}: vocab_size {vocab} < 256 byte ids")
    run_model = replace(
        model,
        layers=tuple(scale_layer(model.layers[i], scale, par.tp) for i in source),
        vocab_size=vocab,
        hidden_size=scale_width(model.hidden_size, scale),
        num_mtp_layers=_mtp_layers(plan, model),
    )
    starts = [sum(len(s) for s in kept[:i]) for i in range(len(kept) + 1)]
    virtual = tuple(tuple(range(starts[k], starts[k + 1])) for k in range(len(kept)))
    seq_len = int(plan.training.get("seq_len", 4096))
    num_mb = par.num_microbatches
    if scale < 1.0:
        seq_len = max(16, int(round(seq_len * scale)))
        num_mb = max(par.pp, int(round(num_mb * scale)))
        if par.vp > 1:  # interleaved 1F1B runs micro-batches in groups of pp
            num_mb = par.pp * max(1, int(round(par.num_microbatches * scale / par.pp)))
    _check_tp(run_model, par.tp)
    check_expert_tp(run_model, par.etp)
    fsdp = bool(plan.training.get("fsdp", False))
    placements, slots = _placements(plan, model, source)
    check_fsdp(fsdp, options.get("migrate_every", 0), bool(slots))
    recomputed = {i for s in plan.stages for i in s.recompute_layers}
    recompute = par.recompute if recomputed and par.recompute != "none" else "none"
    world = par.pp * par.dp * par.tp
    arch, arch_source = run_arch(plan, hf_weights)
    check_arch(arch, model, arch_source)
    return RunSpec(
        model=run_model,
        pp=par.pp,
        dp=par.dp,
        ep=par.ep,
        micro_batch=par.micro_batch,
        num_microbatches=num_mb,
        seq_len=seq_len,
        stage_layers=rank_layers(virtual, par.pp),
        placements=placements,
        slots=slots,
        source_layers=tuple(source),
        logical_of_physical=physical_order(plan),
        ranks_per_node=ranks_per_node or min(world, plan.cluster.gpus_per_node or world),
        tp=par.tp,
        vp=par.vp,
        etp=par.etp,
        fsdp=fsdp,
        chunk_layers=virtual if par.vp > 1 else (),
        recompute=recompute,
        recompute_layers=tuple(i for i, src in enumerate(source) if src in recomputed)
        if recompute != "none"
        else (),
        arch=arch,
        arch_source=arch_source,
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


def check_slots(table: ExpertSlots, num_experts: int, ep: int, layer: int) -> None:
    """Refuse a slot table the runtime cannot execute (one SpecError line naming the layer)."""
    where = f"plan: experts[layer={layer}]"
    rows, shares = table.slots_RS, table.share_RS
    if len(rows) != ep or [len(r) for r in rows] != [len(r) for r in shares]:
        raise SpecError(f"{where}: slots must list {ep} EP ranks, a share per slot")
    if any(not row for row in rows) or any(not EMPTY <= e < num_experts for r in rows for e in r):
        raise SpecError(
            f"{where}: every EP rank needs a slot; slots hold experts 0..{num_experts - 1} "
            "(-1 = empty)"
        )
    for e in range(num_experts):
        held = table.holders(e)
        total = sum(shares[r][s] for r, s in held)
        if not held or len({r for r, _ in held}) < len(held):
            raise SpecError(f"{where}: expert {e} must sit on at least one rank, once per rank")
        if abs(total - 1.0) > 1e-6 or any(shares[r][s] <= 0 for r, s in held):
            raise SpecError(f"{where}: the token shares of expert {e}'s copies must sum to 1")


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
    is passed through, the dispatcher defaulting to the plan's (priced_dispatcher), the
    numerics from the plan and --hf-weights (run_arch); raises
    SpecError as run_spec_from_plan does and, at full size, for a --dispatcher or
    --precision that differs from what the plan was priced with (check_run_flags).
    """
    plan = load_plan(options.plan)
    if options.scale == 1.0:  # the priced run itself; a --scale'd run is a rehearsal
        check_run_flags(plan, options)
    passed = {f.name for f in fields(RunSpec)} - {"ranks_per_node"}
    chosen = {f.name: getattr(options, f.name) for f in fields(options) if f.name in passed}
    chosen["dispatcher"] = options.dispatcher or priced_dispatcher(plan)
    model = plan.model_spec(options.plan)
    return run_spec_from_plan(
        plan, model, options.scale, options.ranks_per_node, options.hf_weights, **chosen
    )


def priced_dispatcher(plan: Plan) -> Dispatcher:
    """The runtime's dispatcher for the one the plan was priced with (plan.json
    extra.dispatcher): flat, halo or halo-dedup; a plan priced with DeepEP (made for another
    engine, which `piper run` refuses at full size) rehearses with flat, the exchange DeepEP
    also makes."""
    return runtime_dispatcher(plan.extra.get("dispatcher", "flat"))  # type: ignore[return-value]


def check_run_flags(plan: Plan, options: RunOptions) -> None:
    """Refuse (one SpecError line naming the flag and the fix) a --dispatcher or --precision
    given explicitly that runs other than the plan was priced: another dispatcher, or another
    compute dtype than `--precision plan` gives."""
    priced = priced_dispatcher(plan)
    chosen = options.dispatcher
    if chosen is not None and chosen != priced:
        raise SpecError(
            f"--dispatcher {chosen}: the plan was priced with the {priced} dispatcher; leave "
            f"the flag out to run {priced}, re-plan with --dispatcher {chosen}, or rehearse "
            "with --scale < 1"
        )
    want = replace(options, precision="plan").compute_dtype(plan.training)
    if options.precision != "plan" and options.precision != want:
        dtype = plan.training.get("dtype", "fp32")
        raise SpecError(
            f"--precision {options.precision}: the plan was priced in {dtype}, which runs in "
            f"{want} here; leave the flag out (or --precision plan), re-plan with --dtype "
            f"{options.precision}, or rehearse with --scale < 1"
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
        if options.hf_weights:
            check_hf_checkpoint(options.hf_weights, spec.model, options.scale)
    except (SpecError, KeyError, TypeError) as exc:
        raise SpecError(f"{options.plan}: {exc}") from None
    return spec
