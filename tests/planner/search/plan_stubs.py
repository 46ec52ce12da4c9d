"""Hand-made inputs and an analytic toy backend for the search tests (no resource model needed).

The toy backend keeps the contract of planner.search.evaluator.Evaluator with simple formulas:
per layer, time = tokens x cost / (tp cp) (+ an all-to-all term for MoE layers, + an etp
and a cp term), state = 16 B x (attention / tp + experts / (etp ep)), activations =
tokens x d x 34 / (tp cp vp) per live chunk (2 x d kept with full recompute, 60% with a
module set). Knobs: ZeRO quarters the state; FSDP eighths it and adds a gather per layer;
the all-to-all overlap halves the all-to-all; HALO makes it 0.8x when the EP group leaves a
node; DeepEP 0.9x with a dispatch buffer. Its estimate() is pipeline_slots x the slowest
stage of the given split (+ a dp term), consistent with the bounds the search prunes with.
The stage IP is the real one (planner.ip.stage_ip).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.ip.rank_ip import logical_rank
from planner.ip.solvers import SolveReport, SolverOptions
from planner.ip.stage_ip import solve_stages
from planner.parallel import ParallelConfig
from planner.plan.schema import RankPlan
from planner.resources.stage_inputs import StageCostInputs, StageExtras, UnitCost
from planner.search.enumerate import enumerate_families
from planner.search.evaluator import EstimateView, RankChoice, StageChoice
from planner.search.model_evaluator import ModelEvaluator
from planner.search.space import Candidate
from planner.specs import (
    GIB,
    AttentionSpec,
    ClusterSpec,
    DeviceSpec,
    LayerSpec,
    LevelSpec,
    ModelSpec,
    MoESpec,
    TrainingSpec,
)


def toy_model(layers: int = 6, experts: int = 8, d: int = 1024, dense_first: int = 1) -> ModelSpec:
    att = AttentionSpec("gqa", num_heads=8, num_kv_heads=8, head_dim=d // 8)
    moe = MoESpec(num_experts=experts, top_k=2, expert_ffn=2 * d)
    specs = [
        LayerSpec("dense", att, dense_ffn=4 * d)
        if i < dense_first
        else LayerSpec("moe", att, moe=moe)
        for i in range(layers)
    ]
    return ModelSpec("toy", "toy", d, 4096, tuple(specs))


def toy_cluster(memory_gib: float = 8.0, gpus_per_node: int = 4, nodes: int = 4) -> ClusterSpec:
    dev = DeviceSpec("toy-gpu", memory_gib, (("bf16", 100.0),), 1000.0)
    levels = (
        LevelSpec("node", gpus_per_node, 100.0, 1.0),
        LevelSpec("system", gpus_per_node * nodes, 10.0, 5.0),
    )
    return ClusterSpec(
        "toy", dev, gpus_per_node, nodes, 1, 10.0, levels, framework_overhead_gib=1.0
    )


@dataclass
class ToyEvaluator:
    """Analytic backend; counts calls; `interrupt_after` raises KeyboardInterrupt on that solve."""

    interrupt_after: int | None = None
    solves: int = 0
    estimates: int = 0
    costed: int = 0

    def cost_inputs(
        self, model, cluster, training, par: ParallelConfig, dispatcher: str
    ) -> StageCostInputs:
        self.costed += 1
        d = model.hidden_size
        tokens = par.micro_batch * training.seq_len / par.cp
        shard = 4 if training.zero else 8 if training.fsdp else 1
        units = []
        for i, layer in enumerate(model.layers):
            attn = 4 * d * d
            mlp = 3 * d * layer.dense_ffn if layer.kind == "dense" else 0
            experts = 3 * d * layer.moe.expert_ffn * layer.moe.num_experts if layer.moe else 0
            state = 16.0 * ((attn + mlp) / par.tp + experts / (par.ep * par.etp)) / shard
            t = tokens * (
                attn + mlp + (experts / max(layer.moe.num_experts, 1) * 2 if layer.moe else 0)
            )
            t = 6 * t / par.tp / 1e14 + 1e-4 * (par.cp - 1) + 2e-4 * (par.etp - 1) * bool(layer.moe)
            if layer.moe:
                t += self._a2a_s(tokens, d, par, cluster, training, dispatcher)
            if training.fsdp:
                t += state * 1e-12
            act = tokens * d * 34.0 / par.tp / par.vp
            if layer.moe and dispatcher == "deepep" and par.ep > 1:
                act += tokens * d * 2.0 / par.vp
            kept = self._kept(par, tokens, d, act)
            extra = 4 / 3 if par.recompute == "full" else 1.05
            units.append(UnitCost(i, layer.kind, t, t * extra, state, act, kept))
        emb = 16.0 * model.vocab_size * d / par.tp / shard
        first = StageExtras(tokens * 1e-12, emb, tokens * d * 2.0 / par.vp)
        last = StageExtras(tokens * model.vocab_size * d * 6 / 1e14, emb, tokens * d * 8.0 / par.vp)
        usable = (cluster.device.memory_gib - cluster.framework_overhead_gib) * GIB
        return StageCostInputs(
            tuple(units), first, last, usable, par.pp, par.num_microbatches,
            par.recompute != "none", par.vp, training.a2a_overlap,
        )  # fmt: skip

    @staticmethod
    def _a2a_s(tokens, d, par, cluster, training, dispatcher) -> float:
        t = tokens * d * 2 * 4 * (par.ep - 1) / par.ep / 1e10 * (1 + par.ep // 4)
        if dispatcher in ("halo", "halo-dedup") and par.ep * par.etp > cluster.gpus_per_node:
            t *= 0.8 if dispatcher == "halo" else 0.7
        if dispatcher == "deepep":
            t *= 0.9
        return t / 2 if training.a2a_overlap else t

    @staticmethod
    def _kept(par: ParallelConfig, tokens: float, d: int, act: float) -> float:
        if par.recompute == "full":
            return tokens * d * 2.0 / par.tp / par.vp
        if par.recompute == "selective":
            return act * 0.6
        return act

    def solve_stages(self, inputs: StageCostInputs, options: SolverOptions) -> StageChoice:
        self.solves += 1
        if self.interrupt_after is not None and self.solves > self.interrupt_after:
            raise KeyboardInterrupt
        sol = solve_stages(inputs, options)
        return StageChoice(sol.stage_layers, sol.recompute_layers, sol.report)

    def score_stages(self, inputs: StageCostInputs, options: SolverOptions) -> StageChoice:
        self.solves += 1
        if self.interrupt_after is not None and self.solves > self.interrupt_after:
            raise KeyboardInterrupt
        return ModelEvaluator().score_stages(inputs, options)

    def estimate(
        self, model, cluster, training, par, stage_layers, recompute_layers, dispatcher
    ) -> EstimateView:
        self.estimates += 1
        inputs = self.cost_inputs(model, cluster, training, par, dispatcher)
        self.costed -= 1
        mem, time = [], []
        for s, (layers, rc) in enumerate(zip(stage_layers, recompute_layers, strict=True)):
            k = inputs.in_flight(s)
            m = sum(
                inputs.units[i].state_bytes
                + k
                * (inputs.units[i].act_recompute_bytes if i in rc else inputs.units[i].act_bytes)
                for i in layers
            )
            t = sum(
                inputs.units[i].time_recompute_s if i in rc else inputs.units[i].time_s
                for i in layers
            )
            for extra, on in ((inputs.first, s == 0), (inputs.last, s == par.pp - 1)):
                if on:
                    m += extra.state_bytes + k * extra.act_bytes
                    t += extra.time_s
            mem.append(m / GIB)
            time.append(t)
        step = inputs.pipeline_slots * max(time) + 1e-3 * par.dp
        usable = inputs.usable_memory_bytes / GIB
        fits = max(mem) <= usable * (1 + 1e-9)
        tokens = training.global_batch * training.seq_len
        tflops = 6 * 1e9 * tokens / step / par.world / 1e12
        return EstimateView(
            step,
            tokens / step,
            tflops / 100.0,
            tflops,
            (par.pp - 1) / par.vp / inputs.pipeline_slots,
            tuple(mem),
            usable,
            (("a2a", 0.1 * step), ("p2p", 0.01 * step)),
            fits,
            "" if fits else f"stage 0 needs {max(mem):.1f} GiB > {usable:.1f} GiB",
            (
                ("weights", tuple(x * 0.5 for x in mem)),
                ("activations", tuple(x * 0.5 for x in mem)),
            ),
            (("compute", tuple(time)),),
            tuple(time),
        )

    def place_experts(self, load_E, ep, options):
        per = len(load_E) // ep
        order = sorted(range(len(load_E)), key=lambda e: (-load_E[e], e))
        rank = [0] * len(load_E)
        for i, e in enumerate(order):  # snake order keeps slots equal
            r = i % ep if (i // ep) % 2 == 0 else ep - 1 - i % ep
            rank[e] = r
        assert all(rank.count(r) == per for r in range(ep))
        return tuple(rank), SolveReport(options.backend, "OPTIMAL", 1.0, 1.0, 0.0, 0.0)

    def place_ranks(self, par, cluster, allocation, options) -> RankChoice:
        rows = []
        for r in range(par.world):
            stage, dp, cp, tp, ep = logical_rank(par, r)
            g = cluster.gpus_per_node
            rows.append(RankPlan(r, r // g, r % g, stage, dp, tp, ep, cp))
        return RankChoice(tuple(rows), SolveReport(options.backend, "OPTIMAL", 0.0, 0.0, 0.0, 0.0))

    def describe_model(self, model):
        return {
            "name": model.name,
            "source": model.source,
            "config": {"hidden_size": model.hidden_size},
        }

    def describe_cluster(self, cluster):
        return {
            "name": cluster.name,
            "gpus_per_node": cluster.gpus_per_node,
            "nodes": cluster.num_nodes,
        }


def enumerate_layouts(model, cluster, training, space) -> list[Candidate]:
    """Every candidate of the space, in enumeration order (the families' members)."""
    return [c for f in enumerate_families(model, cluster, training, space) for c in f.members]


def toy_training(**kw) -> TrainingSpec:
    kw.setdefault("seq_len", 1024)
    kw.setdefault("global_batch", 32)
    return TrainingSpec(**kw)
