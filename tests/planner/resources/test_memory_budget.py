"""torchtitan's memory-budget AC ("budget:<b>"): the bytes a layer keeps and the forward FLOPs
it reruns, against a per-tensor oracle written here from the shapes and the partitioner's
0/1 knapsack solved by enumeration on its normalised sizes (floor = the block input, 1 = no
recompute; all-to-all outputs saved for every budget above 0)."""

from __future__ import annotations

import itertools
import random

import pytest

from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.parallel import ParallelConfig, budget_module, memory_budget
from planner.plan.schema import ParallelPlan
from planner.resources import memory_budget as mb
from planner.resources.compute import TRAIN_FACTOR, layer_work
from planner.resources.memory import attention_activations, layer_activations, mlp_activations
from planner.resources.recompute import budget_kept, budget_rerun
from planner.specs import SpecError, TrainingSpec

S, B = 4096, 2
TRAINING = TrainingSpec(seq_len=S, global_batch=64)
BUDGETS = (0.0, 0.05, 0.25, 0.5, 0.75, 0.95, 1.0)


def _par(budget: float, ep: int = 8, tp: int = 1) -> ParallelConfig:
    return ParallelConfig(pp=1, dp=8, tp=tp, ep=ep, micro_batch=B, recompute="selective",
                          recompute_modules=(budget_module(budget),))  # fmt: skip


def _parts(model, layer, par):
    return attention_activations(model, layer, TRAINING, par) + mlp_activations(
        model, layer, TRAINING, par
    )


def _kept(model, layer, par) -> float:
    return sum(v for _, v in budget_kept(layer, _parts(model, layer, par), TRAINING, par,
                                         model.hidden_size))  # fmt: skip


def _oracle_tensors(model, layer) -> list[tuple[float, float, bool]]:
    """(bytes, FLOPs, all-to-all output) of every tensor no recompute keeps beside the block
    input, for a grouped-query MoE layer (Qwen3-30B-A3B) at tp = cp = 1, ep = 8 in bf16 with
    flash attention."""
    d, att, moe = model.hidden_size, layer.attention, layer.moe
    T, a = B * S, 2.0
    q, kv = att.num_heads * att.head_dim, att.num_kv_heads * att.head_dim
    k, f, E = moe.top_k, moe.expert_ffn, moe.num_experts
    ctx = (S + 1) / 2
    sdpa = 2 * B * att.num_heads * S * ctx * 2 * att.head_dim  # q k and p v products
    return [
        (a * T * d, 0.0, False),  # the input norm's output
        (a * T * (q + 2 * kv), 2 * T * d * (q + 2 * kv), False),  # wqkv
        (a * T * q, sdpa, False),  # SDPA output
        (4.0 * B * att.num_heads * S, 0.0, False),  # its fp32 log-sum-exp
        (a * T * d, 2 * T * q * d, False),  # the residual sum after wo
        (a * T * d, 0.0, False),  # the MLP norm's output
        (4.0 * T * E, 2 * T * d * E, False),  # router probabilities (fp32)
        (12.0 * T * k, 0.0, False),  # top-k values and indices
        (a * T * k * d, 0.0, True),  # dispatch all-to-all output
        (a * T * k * f, 2 * T * k * d * f, False),  # experts' w1
        (a * T * k * f, 2 * T * k * d * f, False),  # experts' w3
        (a * T * k * f, 0.0, False),  # silu(w1) * w3
        (a * T * k * d, 2 * T * k * f * d, True),  # combine all-to-all output: the w2 outputs
    ]


def _exact(tensors, budget: float) -> tuple[float, float]:
    """(kept bytes above the floor, recomputed FLOPs): the all-to-all outputs when budget > 0,
    then of the others the subset of most FLOPs (at least 1 each) within the budget, the
    smallest such, by enumerating every subset."""
    if budget in (0.0, 1.0):
        return (sum(b for b, _, _ in tensors) if budget else 0.0), (
            0.0 if budget else sum(f for _, f, _ in tensors)
        )
    cap = budget * sum(b for b, _, _ in tensors)
    free = [t for t in tensors if not t[2]]
    best = (-1.0, 0.0, ())
    for n in range(len(free) + 1):
        for subset in itertools.combinations(range(len(free)), n):
            size = sum(free[i][0] for i in subset)
            value = sum(max(free[i][1], 1.0) for i in subset)
            if size <= cap and (value, -size) > (best[0], -best[1]):
                best = (value, size, subset)
    saved = sum(b for b, _, a2a in tensors if a2a)
    redo = sum(free[i][1] for i in range(len(free)) if i not in best[2])
    return best[1] + saved, redo


@pytest.mark.parametrize("budget", BUDGETS)
def test_qwen3_moe_layer_matches_the_per_tensor_oracle(budget):
    model = load_model("qwen3-30b-a3b")
    layer, par = model.layers[-1], _par(budget)
    floor = 2.0 * B * S * model.hidden_size
    used, redo = _exact(_oracle_tensors(model, layer), budget)
    assert _kept(model, layer, par) == pytest.approx(floor + used, rel=1e-12)
    choice = mb.layer_choice(layer, _parts(model, layer, par), TRAINING, par,
                             model.hidden_size, budget)  # fmt: skip
    assert choice.recompute_flops == pytest.approx(redo, rel=1e-12)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3", "mixtral-8x7b"])
def test_budget_one_is_no_recompute_and_zero_is_full_recomputes_floor(name):
    model = load_model(name)
    for layer in (model.layers[0], model.layers[-1]):
        none = layer_activations(model, layer, TRAINING, _par(1.0), "none").total
        full = layer_activations(model, layer, TRAINING, _par(1.0), "full").total
        assert _kept(model, layer, _par(1.0)) == pytest.approx(none, rel=1e-12)
        assert _kept(model, layer, _par(0.0)) == pytest.approx(full, rel=1e-12)
        top = mb.layer_choice(layer, _parts(model, layer, _par(1.0)), TRAINING, _par(1.0),
                              model.hidden_size, 1.0)  # fmt: skip
        assert top.recompute_flops == 0.0


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "deepseek-v3"])
def test_kept_bytes_stay_within_the_normalised_budget_and_grow_with_it(name):
    model = load_model(name)
    layer = model.layers[-1]
    none = layer_activations(model, layer, TRAINING, _par(1.0), "none").total
    floor = layer_activations(model, layer, TRAINING, _par(1.0), "full").total
    kept, redo = [], []
    for b in BUDGETS:
        par = _par(b)
        choice = mb.layer_choice(layer, _parts(model, layer, par), TRAINING, par,
                                 model.hidden_size, b)  # fmt: skip
        a2a = sum(t.size_bytes for t in choice.tensors if t.collective) if b > 0 else 0.0
        assert choice.kept_bytes <= floor + a2a + b * (none - floor) * (1 + 1e-9)
        kept.append(choice.kept_bytes)
        redo.append(choice.recompute_flops)
    assert kept == sorted(kept) and redo == sorted(redo, reverse=True)
    assert redo[0] > redo[2] > 0.0  # b = 0.25 reruns less than b = 0, more than nothing


def test_rerun_shares_match_the_layer_works_at_budget_zero():
    """At b = 0 every GEMM whose output a backward reads is rerun: all of attention, the
    router and the routed experts; of the shared experts w1 and w3 (2 of 3), not w2."""
    model, cluster = load_model("deepseek-v3"), load_cluster("h100")
    layer, par = model.layers[-1], _par(0.0)
    work = layer_work(model, layer, cluster, TRAINING, par)
    fwd = {w.name: w.flops / TRAIN_FACTOR for w in work}
    rerun = budget_rerun(layer, _parts(model, layer, par), TRAINING, par, model.hidden_size, fwd)
    share = dict(rerun.share)
    for name in ("attn_core", "router", "experts"):
        assert share[name] == pytest.approx(1.0, rel=1e-12)
    assert share["attn_proj"] == pytest.approx(1.0, rel=1e-4)  # the q / kv norms are not GEMMs
    assert share["shared"] == pytest.approx(2 / 3, rel=1e-12)
    assert rerun.repeats_dispatch  # ep = 8, b = 0: the all-to-all outputs are recomputed
    half = budget_rerun(layer, _parts(model, layer, _par(0.5)), TRAINING, _par(0.5),
                        model.hidden_size, fwd)  # fmt: skip
    assert not half.repeats_dispatch  # b > 0: the partitioner never recomputes a collective
    assert budget_rerun(layer, _parts(model, layer, _par(1.0)), TRAINING, _par(1.0),
                        model.hidden_size, fwd).share == ()  # fmt: skip


def test_budget_module_grid_and_plan_round_trip():
    assert budget_module(0.35) == "budget:0.35" and memory_budget(("budget:0.35",)) == 0.35
    assert memory_budget(("op",)) is None
    par = _par(0.5)
    assert ParallelPlan.of(par).config() == par
    for bad in (0.33, -0.05, 1.5):
        with pytest.raises(SpecError, match=r"--memory-budget .* steps of 0.05") as err:
            budget_module(bad)
        assert "\n" not in str(err.value)
    with pytest.raises(SpecError, match="give it alone"):
        ParallelConfig(pp=1, dp=8, recompute="selective", recompute_modules=("op", "budget:0.5"))


def test_knapsack_matches_enumeration_on_random_items():
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(1, 8)
        sizes = [rng.choice([1.0, 2.0, 3.0, 5.0, rng.uniform(0.1, 6)]) for _ in range(n)]
        values = [rng.choice([1.0, 4.0, rng.uniform(1, 10)]) for _ in range(n)]
        cap = rng.uniform(0, sum(sizes))
        best = max(
            (sum(values[i] for i in s), -sum(sizes[i] for i in s))
            for k in range(n + 1)
            for s in itertools.combinations(range(n), k)
            if sum(sizes[i] for i in s) <= cap
        )
        mask = mb.knapsack(sizes, values, cap)
        chosen = [i for i in range(n) if mask >> i & 1]
        assert sum(sizes[i] for i in chosen) <= cap
        assert sum(values[i] for i in chosen) == pytest.approx(best[0], rel=1e-12)
        assert sum(sizes[i] for i in chosen) == pytest.approx(-best[1], rel=1e-12)
