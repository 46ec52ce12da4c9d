"""Enumerate the candidates of a search space, grouped into families.

Validity rules (ARCHITECTURE section 2, planner/parallel.py):
- world: pp * dp * tp * cp == gpus;
- tp divides the attention heads and stays inside one node (tp <= gpus_per_node);
- the expert mesh folds over the attention ranks: etp * ep divides tp * cp * dp, ep divides
  the routed experts, etp every expert's FFN width (so ep may exceed dp * tp);
- cp: seq_len a multiple of 2 * cp; vp > 1 needs pp > 1, num_microbatches a multiple of pp
  and at least pp * vp layers; pp <= layers;
- global batch = dp * micro_batch * num_microbatches, so dp divides the global batch;
- optional: ep <= max_ep (EP kept inside a fast domain).
Which values are tried where the user fixed nothing: planner.search.space.

A *family* holds the candidates of one (pp, tp, cp, dp, ep, etp, micro-batch, vp, dispatcher)
that differ only in the recompute policy, the optimizer sharding and the all-to-all overlap.
Its first member is the fastest per micro-batch: no recompute (recomputing only adds time),
the least sharding (FSDP adds weight gathers), the overlap on where allowed (it hides
communication); so the first member's step-time bound holds for the whole family
(planner.search.branch_bound costs the others only when that bound can still win).

Any size may be fixed by the user; a fixed size that breaks a rule is a SpecError naming the
flag and the fix. The order is deterministic (sizes ascending; members in policy order).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.parallel import ParallelConfig, divisors
from planner.search import space as sp
from planner.search.space import Candidate, Knobs, SearchSpace
from planner.specs import ClusterSpec, ModelSpec, SpecError, TrainingSpec
from planner.targets import etp_allowed


@dataclass(frozen=True)
class Family:
    """Candidates sharing everything but recompute, sharding and the all-to-all overlap.
    members[0] is the fastest; member i has enumeration order `first_order + i`."""

    members: tuple[Candidate, ...]
    first_order: int

    @property
    def shape(self) -> tuple[float, int, int]:
        """(micro_batch / (tp cp), ep, etp): what an MoE layer's dispatch depends on (the
        tokens per rank in units of the sequence, and the EP group)."""
        p = self.members[0].parallel
        return (p.micro_batch / (p.tp * p.cp), p.ep, p.etp)

    @property
    def dispatcher(self) -> str:
        return self.members[0].knobs.dispatcher


def _common(a: int, b: int) -> list[int]:
    return [d for d in divisors(a) if b % d == 0]


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


def _expert_meshes(model: ModelSpec, tp: int, cp: int, dp: int, space: SearchSpace) -> list:
    """(etp, ep) pairs: etp * ep divides tp * cp * dp, ep divides the experts (and max_ep)."""
    experts = max(model.num_experts, 1)
    fixed_etp, fixed_ep = space.value("etp"), space.value("ep")
    out = []
    for etp in [fixed_etp] if fixed_etp is not None else divisors(tp):
        if (tp * cp * dp) % etp:
            continue
        for ep in divisors(tp * cp * dp // etp):
            if experts % ep or (space.max_ep is not None and ep > space.max_ep):
                continue
            if fixed_ep is not None and ep != fixed_ep:
                continue
            if not etp_allowed(space.etp_rule, etp, tp, ep):
                continue
            if sp.etp_ok(etp, ep, model, searched=fixed_etp is None):
                out.append((etp, ep))
    return out


def _micro_batches(per_dp: int, space: SearchSpace) -> list[int]:
    fixed = space.value("micro_batch")
    if fixed is not None:
        return [fixed] if per_dp % fixed == 0 else []
    return divisors(per_dp)


def _members(
    par: ParallelConfig,
    dispatcher: sp.DispatcherName,
    space: SearchSpace,
    policies: list,
    mtp: int,
) -> list[Candidate]:
    """The family of one sized layout: policies x sharding x overlap, fastest first."""
    shardings = [s for s in sp.SHARDINGS if s in space.sharding]
    if len(shardings) > 1 and par.pp > 1:  # searched FSDP only without pipelining
        shardings = [s for s in shardings if s != "fsdp"] or shardings
    out = []
    for rc, modules in policies:
        layout = ParallelConfig(
            par.pp, par.dp, par.tp, par.ep, par.micro_batch, par.num_microbatches, rc,
            par.vp, par.cp, par.etp, modules,
        )  # fmt: skip
        allowed, _ = sp.a2a_overlap_allowed(layout, dispatcher, mtp)
        overlaps = [True, False] if space.a2a_overlap is None else [space.a2a_overlap]
        for sharding in shardings:
            for overlap in overlaps:
                if overlap and not allowed:
                    continue
                out.append(Candidate(layout, Knobs(sharding, overlap, dispatcher)))
    return out


def enumerate_families(
    model: ModelSpec, cluster: ClusterSpec, training: TrainingSpec, space: SearchSpace
) -> list[Family]:
    """All valid candidates of `space.gpus` GPUs as families, sizes ascending
    (pp, tp, cp, etp, ep, micro-batch, vp, dispatcher; members in policy order).

    Raises SpecError when the fixed sizes leave no valid candidate, naming the rules.
    """
    _check_fixed_ep(model, space)
    g, out, order = cluster.gpus_per_node, [], 0
    policies, mtp = sp.policies(space, model, training), sp.mtp_layers(model, training)
    top_k = max((ly.moe.top_k for ly in model.layers if ly.moe is not None), default=1)
    for pp in _pp_choices(model, space):
        for tp in _tp_choices(model, cluster, space):
            for cp in sp.cp_choices(space, model, training, tp, g):
                if space.gpus % (pp * tp * cp) or training.seq_len % (2 * cp if cp > 1 else 1):
                    continue
                dp = space.gpus // (pp * tp * cp)
                fixed_dp = space.value("dp")
                if (fixed_dp is not None and dp != fixed_dp) or training.global_batch % dp:
                    continue
                per_dp = training.global_batch // dp
                for etp, ep in _expert_meshes(model, tp, cp, dp, space):
                    for mb in _micro_batches(per_dp, space):
                        m = per_dp // mb
                        for vp in sp.vp_choices(space, pp, m, model.num_layers):
                            base = ParallelConfig(pp, dp, tp, ep, mb, m, "none", vp, cp, etp)
                            for d in sp.dispatcher_choices(space, ep, etp, g, top_k):
                                members = _members(base, d, space, policies, mtp)
                                if members:
                                    out.append(Family(tuple(members), order))
                                    order += len(members)
    if not out:
        raise SpecError(_no_layout_message(model, training, space))
    return out


def _check_fixed_ep(model: ModelSpec, space: SearchSpace) -> None:
    ep = space.value("ep")
    experts = max(model.num_experts, 1)
    if ep is not None and experts % ep:
        raise SpecError(
            f"plan: --ep {ep} must divide the {experts} experts of {model.name}; "
            f"pick one of {divisors(experts)}"
        )


def _no_layout_message(model: ModelSpec, training: TrainingSpec, space: SearchSpace) -> str:
    fixed = ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in space.fixed) or "no fixed sizes"
    if space.a2a_overlap:
        fixed += ", --a2a-overlap (ep > 1, no full recompute, vp > 1 when pp > 1)"
    return (
        f"plan: no valid layout of {space.gpus} GPUs for {model.name} with {fixed} and global "
        f"batch {training.global_batch}: need pp*dp*tp*cp = GPUs, dp*micro_batch | global "
        f"batch, etp*ep | tp*cp*dp, ep | {max(model.num_experts, 1)} experts, seq_len a "
        "multiple of 2*cp, and for vp > 1: pp > 1 and micro-batches a multiple of pp; change "
        "--gpus, --global-batch or the fixed sizes"
    )
