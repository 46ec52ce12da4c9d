"""Hand-made inputs and an analytic toy backend for the search tests (no resource model needed).

The toy backend keeps the contract of planner.search.evaluator.Evaluator with simple formulas:
per layer, time = tokens x cost / tp (+ an all-to-all term / ep for MoE layers), state =
16 B x (attention / tp + experts / ep), activations = tokens x d x 34 / tp (2 x d kept when
recomputed). Its estimate() is the 1F1B step of the given split, so it is consistent with the
bounds the search prunes with. The stage IP is the real one (planner.ip.stage_ip).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.ip.solvers import SolveReport, SolverOptions
from planner.ip.stage_ip import solve_stages
from planner.parallel import ParallelConfig
from planner.plan.schema import RankPlan
from planner.resources.stage_inputs import StageCostInputs, StageExtras, UnitCost
from planner.search.evaluator import EstimateView, RankChoice, StageChoice
from planner.search.model_evaluator import ModelEvaluator
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

    def cost_inputs(self, model, cluster, training, par: ParallelConfig) -> StageCostInputs:
        d = model.hidden_size
        tokens = par.micro_batch * training.seq_len
        units = []
        for i, layer in enumerate(model.layers):
            attn = 4 * d * d
            mlp = 3 * d * layer.dense_ffn if layer.kind == "dense" else 0
            experts = 3 * d * layer.moe.expert_ffn * layer.moe.num_experts if layer.moe else 0
            state = 16.0 * ((attn + mlp) / par.tp + experts / par.ep)
            t = tokens * (
                attn + mlp + (experts / max(layer.moe.num_experts, 1) * 2 if layer.moe else 0)
            )
            t = 6 * t / par.tp / 1e14
            if layer.moe:
                t += tokens * d * 2 * 4 * (par.ep - 1) / par.ep / 1e10 * (1 + par.ep // 4)
            act = tokens * d * 34.0 / par.tp
            rc = par.recompute != "none"
            units.append(
                UnitCost(i, layer.kind, t, t * 4 / 3, state, act, tokens * d * 2.0 if rc else act)
            )
        emb = 16.0 * model.vocab_size * d / par.tp
        first = StageExtras(tokens * 1e-12, emb, tokens * d * 2.0)
        last = StageExtras(tokens * model.vocab_size * d * 6 / 1e14, emb, tokens * d * 8.0)
        usable = (cluster.device.memory_gib - cluster.framework_overhead_gib) * GIB
        if training.zero:
            units = [
                UnitCost(
                    u.layer,
                    u.kind,
                    u.time_s,
                    u.time_recompute_s,
                    u.state_bytes / 4,
                    u.act_bytes,
                    u.act_recompute_bytes,
                )
                for u in units
            ]
        return StageCostInputs(
            tuple(units), first, last, usable, par.pp, par.num_microbatches, par.recompute != "none"
        )

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
        self, model, cluster, training, par, stage_layers, recompute_layers
    ) -> EstimateView:
        self.estimates += 1
        inputs = self.cost_inputs(model, cluster, training, par)
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
        step = (par.num_microbatches + par.pp - 1) * max(time) + 1e-3 * par.dp
        usable = inputs.usable_memory_bytes / GIB
        fits = max(mem) <= usable * (1 + 1e-9)
        tokens = training.global_batch * training.seq_len
        tflops = 6 * 1e9 * tokens / step / par.world / 1e12
        return EstimateView(
            step,
            tokens / step,
            tflops / 100.0,
            tflops,
            (par.pp - 1) / (par.num_microbatches + par.pp - 1),
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
            stage, rest = divmod(r, par.dp * par.tp)
            dp, tp = divmod(rest, par.tp)
            rows.append(
                RankPlan(
                    r,
                    r // cluster.gpus_per_node,
                    r % cluster.gpus_per_node,
                    stage,
                    dp,
                    tp,
                    (dp * par.tp + tp) % par.ep,
                )
            )
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


def toy_training(**kw) -> TrainingSpec:
    kw.setdefault("seq_len", 1024)
    kw.setdefault("global_batch", 32)
    return TrainingSpec(**kw)
