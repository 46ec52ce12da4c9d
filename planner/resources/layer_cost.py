"""Per-layer and per-boundary costs on one rank: the building blocks of estimate() and of the
StageCostInputs the stage IP reads. Memory from memory.py, compute from compute.py,
communication from comm.py; this module only adds them up per layer.

All values are per rank and per micro-batch (forward + backward) unless named otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from planner.parallel import ParallelConfig
from planner.resources import comm, traffic
from planner.resources.compute import Work, head_work, layer_work
from planner.resources.memory import (
    Accounting,
    ActBytes,
    StateBytes,
    embedding_held,
    head_held,
    layer_activations,
    layer_param_split,
    state_bytes,
)
from planner.specs import ClusterSpec, LayerSpec, ModelSpec, Recompute, SpecError, TrainingSpec

Dispatcher = Literal["flat", "halo"]


@dataclass(frozen=True)
class LayerCost:
    """One transformer layer on one rank, per micro-batch."""

    layer: int
    kind: str
    params_dense: float  # non-expert parameters held (already / tp)
    params_expert: float  # routed-expert parameters held (already / ep)
    state: StateBytes
    act: ActBytes  # kept without recompute
    act_recompute: ActBytes  # kept under the recompute policy (full: the layer input)
    work: tuple[Work, ...]
    comm_s: tuple[tuple[str, float], ...]  # ("a2a_<level>", s), ("tp_<level>", s)
    recompute_extra_s: float  # what recomputing adds in the backward pass
    tables: tuple[str, ...]

    @property
    def compute_s(self) -> float:
        return sum(w.time_s for w in self.work)

    @property
    def time_s(self) -> float:
        return self.compute_s + sum(s for _, s in self.comm_s)

    @property
    def time_recompute_s(self) -> float:
        return self.time_s + self.recompute_extra_s


@dataclass(frozen=True)
class ExtrasCost:
    """Embedding (first stage) or head + loss + MTP (last stage) on one rank."""

    params_dense: float
    params_expert: float
    state: StateBytes
    act_bytes: float
    work: tuple[Work, ...]

    @property
    def time_s(self) -> float:
        return sum(w.time_s for w in self.work)


def effective_recompute(training: TrainingSpec, parallel: ParallelConfig) -> Recompute:
    """The layout's recompute choice wins; TrainingSpec.recompute is the default."""
    return parallel.recompute if parallel.recompute != "none" else training.recompute


def check_layout(model: ModelSpec, cluster: ClusterSpec, parallel: ParallelConfig) -> None:
    """Raise SpecError (one line, with the fix) when the layout cannot run this model here."""
    if parallel.world > cluster.total_gpus:
        raise SpecError(
            f"layout: pp*dp*tp = {parallel.world} GPUs but cluster {cluster.name} has "
            f"{cluster.total_gpus}; lower pp, dp or tp"
        )
    if parallel.pp > model.num_layers:
        raise SpecError(
            f"layout: pp={parallel.pp} exceeds the {model.num_layers} layers of {model.name}; "
            "use pp <= layers"
        )
    experts = model.num_experts
    if experts and experts % parallel.ep:
        options = ", ".join(str(e) for e in range(1, experts + 1) if experts % e == 0)
        raise SpecError(
            f"layout: ep={parallel.ep} must divide the {experts} experts of {model.name}; "
            f"pick ep from {options}"
        )
    if not experts and parallel.ep != 1:
        raise SpecError(f"layout: {model.name} has no experts; use ep=1")
    heads = model.layers[0].attention.num_heads
    if heads % parallel.tp:
        raise SpecError(
            f"layout: tp={parallel.tp} must divide the {heads} attention heads of {model.name}"
        )


def _layer_comm(
    model: ModelSpec,
    layer: LayerSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: Dispatcher,
) -> tuple[list[tuple[str, float]], tuple[str, ...]]:
    """Four all-to-alls per MoE layer (dispatch + combine, forward + backward) and, with
    tp > 1, the layer's TP all-reduce equivalents; volumes from planner.resources.traffic."""
    out: list[tuple[str, float]] = []
    tables: tuple[str, ...] = ()
    nbytes = traffic.a2a_bytes(model, layer, training, parallel)
    if nbytes > 0:
        t, level, tables = comm.a2a_time_s(cluster, parallel.ep, nbytes, dispatcher)
        out.append((f"a2a_{level}", 4 * t))
    if parallel.tp > 1:
        buf = traffic.tp_buffer_bytes(model, training, parallel)
        t, level = comm.ring_allreduce_s(cluster, parallel.tp, 1, buf)
        out.append((f"tp_{level}", traffic.tp_allreduces(layer) * t))
    return out, tables


def layer_cost(
    model: ModelSpec,
    index: int,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: Dispatcher = "flat",
    accounting: Accounting = "piper",
) -> LayerCost:
    """Memory, compute and communication of layer `index` on one rank per micro-batch.

    Recomputing repeats the forward: "full" repeats every forward GEMM, elementwise pass and
    the two forward all-to-alls (and tp collectives); "selective" repeats the attention scores.
    """
    layer = model.layers[index]
    policy = effective_recompute(training, parallel)
    kept_policy: Recompute = policy if policy != "none" else "full"
    work = tuple(layer_work(model, layer, cluster, training, parallel))
    comm_s, comm_tables = _layer_comm(model, layer, cluster, training, parallel, dispatcher)
    if kept_policy == "full":
        extra = sum(w.forward_s for w in work) + sum(s for _, s in comm_s) / 2
    else:
        extra = sum(w.forward_s for w in work if w.name == "attn_core")
    tables = tuple(sorted({t for w in work for t in w.tables} | set(comm_tables)))
    dense, expert = layer_param_split(model, layer, parallel, accounting)
    return LayerCost(
        layer=index,
        kind=layer.kind,
        params_dense=dense,
        params_expert=expert,
        state=state_bytes(dense, expert, training, parallel),
        act=layer_activations(model, layer, training, parallel, "none", accounting),
        act_recompute=layer_activations(model, layer, training, parallel, kept_policy, accounting),
        work=work,
        comm_s=tuple(comm_s),
        recompute_extra_s=extra,
        tables=tables,
    )


def layer_costs(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    dispatcher: Dispatcher = "flat",
    accounting: Accounting = "piper",
) -> tuple[LayerCost, ...]:
    """layer_cost for every layer; identical LayerSpecs are computed once."""
    cache: dict[LayerSpec, LayerCost] = {}
    out = []
    for i, layer in enumerate(model.layers):
        if layer not in cache:
            cache[layer] = layer_cost(model, i, cluster, training, parallel, dispatcher, accounting)
        c = cache[layer]
        out.append(c if c.layer == i else _relabel(c, i))
    return tuple(out)


def _relabel(c: LayerCost, index: int) -> LayerCost:
    return dataclasses.replace(c, layer=index)


def first_extras(
    model: ModelSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    accounting: Accounting = "piper",
) -> ExtrasCost:
    """Embedding on the first stage (the paper's accounting leaves it out)."""
    if accounting == "paper":
        return ExtrasCost(0.0, 0.0, StateBytes(), 0.0, ())
    held = embedding_held(model, training, parallel)
    state = state_bytes(held.params_dense, held.params_expert, training, parallel)
    return ExtrasCost(held.params_dense, held.params_expert, state, held.act_bytes, ())


def last_extras(
    model: ModelSpec,
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
    accounting: Accounting = "piper",
) -> ExtrasCost:
    """Final norm, head, loss and MTP modules on the last stage (left out by the paper)."""
    if accounting == "paper":
        return ExtrasCost(0.0, 0.0, StateBytes(), 0.0, ())
    held = head_held(model, training, parallel)
    state = state_bytes(held.params_dense, held.params_expert, training, parallel)
    work = tuple(head_work(model, cluster, training, parallel))
    return ExtrasCost(held.params_dense, held.params_expert, state, held.act_bytes, work)
