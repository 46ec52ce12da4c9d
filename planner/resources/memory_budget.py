"""torchtitan's `memory-budget` activation checkpointing: what a layer keeps under a budget b.

torchtitan 0.3.0 `activation_checkpoint:memory-budget --activation_checkpoint.memory_budget b`
(`torchtitan/distributed/activation_checkpoint.py` MemoryBudgetAC, b in [0, 1]) only sets
`torch._functorch.config.activation_memory_budget = b`; the compiled block's min-cut
partitioner (`torch/_functorch/partitioners.py`, `choose_saved_values_set`) then picks what
to save:
- b = 0 saves the graph inputs only (the block input: full recompute's a T d);
- b = 1 saves the runtime-optimised min-cut set;
- between them, sizes are normalised to (saved - inputs) / (b1 - inputs), with b1 the bytes
  of the b = 1 set, and a 0/1 knapsack (default solver "dp") over the tensors the min-cut
  would ban from recompute keeps the set of largest forward runtime (FlopCounterMode FLOPs,
  the default "flops" estimator) whose normalised size is at most b; collective outputs are
  saved whatever the budget (`force_save_collectives`; `ban_recomputation_if_allowed`: "the
  activation memory budget logic is not allowed to recompute collectives"), outside the
  knapsack.

Priced here, per layer on Piper's activation components (planner.resources.memory), with
the tensors and widths of per-op SAC (planner.resources.op_sac.linears): each component of
no recompute is split into the tensors that make it, each with its bytes per rank and
micro-batch and the forward FLOPs that recreate it (the producing op's; a residual sum is
priced as the row-parallel matmul feeding it, the SDPA outputs as core attention, the
combine's expert outputs as the experts' down projection, norms, activations, rope and
permutes as 0). b1 is no recompute's bytes; the floor the block input. With ep > 1 the
dispatch and combine all-to-all outputs are saved for every b > 0. The knapsack is the
partitioner's default "dp" one, solved exactly (torch quantises the normalised sizes to
1e-4): the other tensors of largest total FLOPs (at least 1 each, as FlopCounterMode's
estimate) whose bytes are at most b (b1 - floor) are kept, the others recomputed. torch's
"greedy" solver (decreasing FLOPs per byte while they fit) would rerun up to a third of a
Mixtral layer's forward FLOPs more at some budgets, so it is not the price.
Approximations: the knapsack's choice is the saved set (torch runs the min-cut once more with
the knapsack's recomputable tensors unbanned, which can save a cheaper equivalent); the
pointwise chains the b = 1 min-cut itself recomputes are not priced (b = 1 is priced as no
recompute); a recomputed tensor is priced by its own op alone, not by the ops that recreate
its inputs.

Shape letters: none (bytes and FLOPs are per rank and micro-batch of one layer).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from planner.parallel import ParallelConfig
from planner.resources.op_sac import linears
from planner.specs import LayerSpec, MoESpec, TrainingSpec

# the components that are all-to-all outputs when ep > 1 (planner.resources.memory)
A2A_COMPONENTS = ("dispatch", "combine")


@dataclass(frozen=True)
class Tensor:
    """One saved tensor of a layer without recompute.

    component: the activation component it is part of; size_bytes: per rank and micro-batch;
    flops: the forward FLOPs that recreate it (per rank); work: the compute Work those FLOPs
    belong to (planner.resources.compute; "" = none: elementwise or communication);
    collective: an all-to-all output, saved for any budget above 0."""

    name: str
    component: str
    size_bytes: float
    flops: float
    work: str
    collective: bool = False


@dataclass(frozen=True)
class BudgetChoice:
    """The partitioner's choice for one layer and budget, as priced.

    kept: per tensor, True when saved; floor_bytes: the block input (always saved);
    kept_bytes: floor + the kept tensors; recompute_flops: forward FLOPs of the others."""

    tensors: tuple[Tensor, ...]
    kept: tuple[bool, ...]
    floor_bytes: float
    kept_bytes: float
    recompute_flops: float


def _split(name: str, total: float, pieces: list[Tensor]) -> list[Tensor]:
    """`pieces` of component `name`, scaled to fit `total`, and the rest as a 0-FLOP tensor."""
    made = sum(t.size_bytes for t in pieces)
    if made > total > 0:  # never more than the component holds
        pieces = [Tensor(t.name, name, t.size_bytes * total / made, t.flops, t.work)
                  for t in pieces]  # fmt: skip
        made = total
    rest = total - made
    return pieces + ([Tensor(f"{name}_rest", name, rest, 0.0, "")] if rest > 0 else [])


def _attention_core(layer: LayerSpec, training: TrainingSpec, parallel: ParallelConfig):
    """Forward FLOPs of the score (q k) and value (p v) products on the rank, causal
    (planner.resources.compute.attention_work's count)."""
    att, s = layer.attention, training.seq_len
    w = att.sliding_window
    ctx = (s + 1) / 2 if w is None or w >= s else w - w * (w - 1) / (2 * s)
    if att.kind == "mla":
        d_qk, d_v = att.qk_nope_head_dim + att.qk_rope_head_dim, att.v_head_dim
    else:
        d_qk = d_v = att.head_dim
    rows = 2 * parallel.micro_batch * att.num_heads / parallel.tp * s * ctx / parallel.cp
    return rows * d_qk, rows * d_v


def _attention_pieces(
    name: str, size: float, layer: LayerSpec, training: TrainingSpec, parallel: ParallelConfig
) -> list[Tensor]:
    """The SDPA output and log-sum-exp (flash attention), or the scores, probabilities and
    context of unfused attention."""
    qk_flops, pv_flops = _attention_core(layer, training, parallel)
    if name == "context":
        flops = pv_flops + (qk_flops if training.flash_attention else 0.0)
        return [Tensor("sdpa.out", name, size, flops, "attn_core")]
    if training.flash_attention:  # the log-sum-exp: a second output of the same op
        return [Tensor("sdpa.lse", name, size, 0.0, "")]
    return [Tensor("scores", name, size / 2, qk_flops, "attn_core"),
            Tensor("probs", name, size / 2, 0.0, "")]  # fmt: skip


def _moe_pieces(
    name: str, size: float, moe: MoESpec, tokens: float, a: int, hidden: int, skew: float
) -> list[Tensor]:
    """Router probabilities (the gate's FLOPs), the experts' w1 / w3 outputs, the combine
    input (their w2's FLOPs) and the dispatch output (none), each component's rest at 0."""
    rows, f, d = skew * tokens * moe.top_k, moe.expert_ffn, hidden
    if name == "router":
        gate = Tensor("router.probs", name, tokens * 4 * moe.num_experts,
                      2 * tokens * d * moe.num_experts, "router")  # fmt: skip
        return _split(name, size, [gate])
    if name == "experts":
        ups = [Tensor(f"experts.{w}", name, a * rows * f, 2 * rows * d * f, "experts")
               for w in (("w1", "w3") if moe.gated else ("w1",))]  # fmt: skip
        return _split(name, size, ups)
    if name == "combine":  # the experts' down projections
        return [Tensor("combine", name, size, 2 * rows * d * f, "experts")]
    return [Tensor(name, name, size, 0.0, "")]  # dispatch: an all-to-all or permute output


def layer_tensors(
    layer: LayerSpec,
    parts: Sequence[tuple[str, float]],
    training: TrainingSpec,
    parallel: ParallelConfig,
    hidden: int,
) -> tuple[float, tuple[Tensor, ...]]:
    """(floor bytes, the other saved tensors) of one layer without recompute; `parts` are the
    layer's activation components without recompute. The tensors and the floor add up to
    `parts`."""
    a = 4 if training.dtype == "fp32" else 2
    tokens = parallel.micro_batch * training.seq_len / (parallel.tp * parallel.cp)
    per_elem, d = a * tokens, hidden
    mm = [lin for lin, _ in linears(layer, d, parallel.tp)]
    wo_flops = sum(2 * tokens * lin.params for lin in mm
                   if lin.work == "attn_proj" and not lin.component)  # fmt: skip
    floor = min(per_elem * d, dict(parts).get("attn_norm", 0.0))
    tensors: list[Tensor] = []
    for name, size in parts:
        if name == "attn_norm":
            pieces = [Tensor("attn_norm.out", name, size - floor, 0.0, "")]
        elif name in ("qkv", "dense_mlp", "shared"):
            pieces = _split(name, size, [
                Tensor(f"{lin.work}.{lin.name}", name, per_elem * lin.width,
                       2 * tokens * lin.params, lin.work)
                for lin in mm if lin.component == name
            ])  # fmt: skip
        elif name == "mlp_norm":  # the residual sum after wo, then the norm's output
            residual = Tensor("residual", name, min(per_elem * d, size), wo_flops, "attn_proj")
            pieces = _split(name, size, [residual])
        elif name in ("context", "scores"):
            pieces = _attention_pieces(name, size, layer, training, parallel)
        elif layer.moe is not None:
            skew = training.routing_skew
            pieces = _moe_pieces(name, size, layer.moe, tokens, a, d, skew)
        else:
            pieces = [Tensor(name, name, size, 0.0, "")]
        if name in A2A_COMPONENTS and parallel.ep > 1:
            pieces = [replace(t, collective=True) for t in pieces]
        tensors += [t for t in pieces if t.size_bytes > 0]
    return floor, tuple(tensors)


def knapsack(sizes: Sequence[float], values: Sequence[float], capacity: float) -> int:
    """The subset (a bit mask over the items) of largest total value whose size is at most
    `capacity`, the smallest such: exact, over the Pareto front of (size, value) subsets."""
    front = [(0.0, -0.0, 0)]  # (size, -value, mask): size ascending, value strictly rising
    for i, (size, value) in enumerate(zip(sizes, values, strict=True)):
        grown = [(s + size, v - value, m | 1 << i) for s, v, m in front if s + size <= capacity]
        merged, front, best = sorted(front + grown), [], 1.0
        for state in merged:
            if state[1] < best:
                front.append(state)
                best = state[1]
    return front[-1][2]


def choose(tensors: Sequence[Tensor], floor_bytes: float, budget: float) -> BudgetChoice:
    """At budget 1 keep everything; at 0 nothing above the floor; in between the collective
    outputs, then the other tensors of largest total runtime (FLOPs, at least 1 each: the
    partitioner's FlopCounterMode estimate) whose bytes are at most budget x (no recompute's
    bytes - floor): the partitioner's default "dp" knapsack, solved exactly.
    Raises ValueError for a budget outside [0, 1]."""
    if not 0.0 <= budget <= 1.0:
        raise ValueError(f"memory budget {budget} is outside [0, 1]")
    total = sum(t.size_bytes for t in tensors)
    if budget in (0.0, 1.0):
        kept = [budget == 1.0] * len(tensors)
    else:
        free = [i for i, t in enumerate(tensors) if not t.collective]
        mask = knapsack([tensors[i].size_bytes for i in free],
                        [max(tensors[i].flops, 1.0) for i in free], budget * total)  # fmt: skip
        chosen = {i for bit, i in enumerate(free) if mask >> bit & 1}
        kept = [t.collective or i in chosen for i, t in enumerate(tensors)]
    used = sum(t.size_bytes for t, k in zip(tensors, kept, strict=True) if k)
    redo = sum(t.flops for t, k in zip(tensors, kept, strict=True) if not k)
    return BudgetChoice(tuple(tensors), tuple(kept), floor_bytes, floor_bytes + used, redo)


def layer_choice(
    layer: LayerSpec,
    parts: Sequence[tuple[str, float]],
    training: TrainingSpec,
    parallel: ParallelConfig,
    hidden: int,
    budget: float,
) -> BudgetChoice:
    """The priced partitioner choice of one layer (layer_tensors, then choose)."""
    return _layer_choice(layer, tuple(parts), training, parallel, hidden, budget)


@lru_cache(maxsize=4096)  # the search prices the same layer shape under many layouts
def _layer_choice(
    layer: LayerSpec,
    parts: tuple[tuple[str, float], ...],
    training: TrainingSpec,
    parallel: ParallelConfig,
    hidden: int,
    budget: float,
) -> BudgetChoice:
    floor, tensors = layer_tensors(layer, parts, training, parallel, hidden)
    return choose(tensors, floor, budget)


def kept_components(choice: BudgetChoice, parts: Sequence[tuple[str, float]]):
    """`parts` (the components without recompute) as `choice` keeps them; the block input
    stays in attn_norm."""
    out = {name: 0.0 for name, _ in parts}
    if "attn_norm" in out:
        out["attn_norm"] = choice.floor_bytes
    for t, keep in zip(choice.tensors, choice.kept, strict=True):
        if keep:
            out[t.component] += t.size_bytes
    return [(name, out[name]) for name, _ in parts]


def work_share(choice: BudgetChoice, work_flops: dict[str, float]) -> dict[str, float]:
    """Share of each compute Work's forward FLOPs (`work_flops`: Work name -> forward FLOPs
    on the rank) that the recomputed tensors repeat, at most 1."""
    redo: dict[str, float] = {}
    for t, keep in zip(choice.tensors, choice.kept, strict=True):
        if not keep and t.work:
            redo[t.work] = redo.get(t.work, 0.0) + t.flops
    return {w: min(f / work_flops[w], 1.0) for w, f in redo.items() if work_flops.get(w)}


def repeats_dispatch(choice: BudgetChoice) -> bool:
    """True when an all-to-all output is recomputed (budget 0, ep > 1): the forward
    dispatch and combine run again in backward."""
    return any(t.collective and not k for t, k in zip(choice.tensors, choice.kept, strict=True))
