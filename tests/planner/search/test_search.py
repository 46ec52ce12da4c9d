"""The outer search: enumeration rules, bounds vs brute force, branch and bound vs exhaustive
evaluation, determinism across --threads, fixed sizes, Ctrl-C and infeasibility messages.

Uses the analytic toy backend of plan_stubs (the real stage IP, a made-up resource model).
"""

from __future__ import annotations

import itertools
import math
import os
import random
import signal
import time
from dataclasses import replace

import pytest

from planner.ip.solvers import LinearModel, SolverOptions, solve
from planner.resources.cost import even_split
from planner.resources.stage_inputs import StageCostInputs, StageExtras, UnitCost
from planner.search import bounds
from planner.search.branch_bound import _evaluate, new_context, screen
from planner.search.enumerate import enumerate_layouts, make_space
from planner.search.make_plan import make_plan
from planner.search.model_evaluator import ModelEvaluator
from planner.specs import SpecError
from tests.planner.search.plan_stubs import ToyEvaluator, toy_cluster, toy_model, toy_training

OPTS = SolverOptions("cpsat", 10.0, 1, 0)


# ----------------------------------------------------------------------------- enumeration


def test_enumeration_equals_brute_force_over_all_tuples():
    model, cluster, training = toy_model(layers=6, experts=8), toy_cluster(), toy_training()
    got = {
        (p.pp, p.dp, p.tp, p.ep, p.micro_batch, p.num_microbatches, p.recompute)
        for p in enumerate_layouts(model, cluster, training, make_space(16))
    }
    want = set()
    for pp, dp, tp, ep, mb in itertools.product(
        range(1, 17), range(1, 17), (1, 2, 4, 8), range(1, 17), range(1, 33)
    ):
        if pp * dp * tp != 16 or pp > 6 or tp > cluster.gpus_per_node or 8 % tp:
            continue
        if (dp * tp) % ep or 8 % ep or 32 % (dp * mb):
            continue
        for rc in ("none", "full"):
            want.add((pp, dp, tp, ep, mb, 32 // (dp * mb), rc))
    assert got == want
    assert all(pp * dp * tp == 16 for pp, dp, tp, *_ in got)


def test_fixed_sizes_restrict_enumeration_and_bad_ones_name_the_flag():
    model, cluster, training = toy_model(), toy_cluster(), toy_training()
    layouts = enumerate_layouts(model, cluster, training, make_space(16, {"pp": 2, "ep": 4}))
    assert layouts and all(p.pp == 2 and p.ep == 4 for p in layouts)
    with pytest.raises(SpecError, match="--pp 3"):
        enumerate_layouts(model, cluster, training, make_space(16, {"pp": 3}))
    with pytest.raises(SpecError, match="--ep 3"):
        enumerate_layouts(model, cluster, training, make_space(16, {"ep": 3}))
    with pytest.raises(SpecError, match="no valid layout"):
        enumerate_layouts(model, cluster, training, make_space(16, {"pp": 2, "dp": 2, "tp": 2}))


# ----------------------------------------------------------------------------- bounds


def _random_inputs(rng: random.Random, n: int, pp: int, m: int, rc: bool) -> StageCostInputs:
    units = []
    for i in range(n):
        t = rng.uniform(0.5, 2.0)
        act = rng.uniform(1, 5)
        units.append(UnitCost(i, "moe", t, t * 1.3, rng.uniform(1, 5), act, act * 0.2))
    first = StageExtras(rng.uniform(0, 1), rng.uniform(0, 3), rng.uniform(0, 1))
    last = StageExtras(rng.uniform(0, 1), rng.uniform(0, 3), rng.uniform(0, 1))
    return StageCostInputs(tuple(units), first, last, rng.uniform(8, 30), pp, m, rc)


def _brute(inputs: StageCostInputs, allow_empty: bool) -> tuple[float, float]:
    """(min over splits of max stage memory, min of max stage time) by enumeration."""
    n, pp = len(inputs.units), inputs.pp
    best_mem = best_time = math.inf
    lo = 0 if allow_empty else 1
    for cuts in itertools.combinations_with_replacement(range(n + 1), pp - 1):
        edges = (0, *cuts, n)
        if any(b - a < lo for a, b in itertools.pairwise(edges)):
            continue
        split = tuple(tuple(range(a, b)) for a, b in itertools.pairwise(edges))
        mem_min, _ = bounds.split_cost(inputs, split, inputs.recompute_allowed)
        _, time_fast = bounds.split_cost(inputs, split, False)
        best_mem = min(best_mem, max(mem_min))
        best_time = min(best_time, max(time_fast))
    return best_mem, best_time


@pytest.mark.parametrize("seed", range(40))
def test_bounds_equal_the_relaxed_brute_force_and_never_exceed_the_real_one(seed):
    rng = random.Random(seed)
    n, pp = rng.randint(1, 7), rng.randint(1, 4)
    inputs = _random_inputs(rng, n, pp, rng.randint(1, 6), rng.random() < 0.5)
    relaxed_mem, relaxed_time = _brute(inputs, allow_empty=True)
    assert bounds.min_peak_memory_bytes(inputs) == pytest.approx(relaxed_mem, rel=1e-6)
    assert bounds.bottleneck_time_lower_bound_s(inputs) == pytest.approx(relaxed_time, rel=1e-6)
    assert bounds.memory_may_fit(inputs) == (relaxed_mem <= inputs.usable_memory_bytes)
    if pp <= n:
        real_mem, real_time = _brute(inputs, allow_empty=False)
        assert bounds.min_peak_memory_bytes(inputs) <= real_mem * (1 + 1e-9)
        assert bounds.bottleneck_time_lower_bound_s(inputs) <= real_time


def test_even_split_sizes():
    assert even_split(7, 3) == ((0, 1, 2), (3, 4), (5, 6))
    assert even_split(4, 4) == ((0,), (1,), (2,), (3,))


# ----------------------------------------------------------------------------- search


def _exhaustive_best(model, cluster, training, gpus, backend):
    ctx = new_context(model, cluster, training, gpus, None, OPTS, backend)
    layouts = enumerate_layouts(model, cluster, training, ctx.space)
    survivors, _ = screen(ctx, layouts)
    rows = [_evaluate(ctx, c) for c in survivors]
    ok = [r for r in rows if r.feasible and r.estimate]
    return min(ok, key=lambda r: (r.step_time_s, r.order)), len(survivors)


@pytest.mark.parametrize("memory_gib", [3.0, 8.0])
def test_branch_and_bound_finds_the_exhaustive_optimum_with_fewer_solves(memory_gib):
    model, cluster, training = toy_model(), toy_cluster(memory_gib), toy_training()
    want, survivors = _exhaustive_best(model, cluster, training, 16, ToyEvaluator())
    backend = ToyEvaluator()
    result = make_plan(model, cluster, training, 16, None, OPTS, evaluator=backend)
    assert result.best.step_time_s == pytest.approx(want.step_time_s, rel=1e-12)
    assert result.plan.predicted.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
    assert backend.solves < survivors
    pruned = [r for r in result.rows if r.status == "pruned"]
    assert pruned and all(r.bound_step_time_s >= result.best.step_time_s for r in pruned)
    assert all(r.reason.startswith("pruned: bound") for r in pruned)
    # every layout enumerated is a row, ranked: feasible solved rows first by step time
    assert len(result.rows) == len(enumerate_layouts(model, cluster, training, make_space(16)))
    assert result.rows[0].order == result.best.order


def test_small_memory_forces_recompute_or_deeper_pipeline():
    model, training = toy_model(), toy_training()
    roomy = make_plan(model, toy_cluster(16.0), training, 16, None, OPTS, evaluator=ToyEvaluator())
    tight = make_plan(model, toy_cluster(2.2), training, 16, None, OPTS, evaluator=ToyEvaluator())
    assert tight.best.step_time_s >= roomy.best.step_time_s
    assert max(tight.plan.predicted.memory_gib_per_stage) <= tight.plan.predicted.usable_memory_gib
    infeasible = [r for r in tight.rows if not r.feasible]
    assert infeasible and all("GiB" in r.reason for r in infeasible)


def test_fixed_pp_and_ep_are_honoured():
    result = make_plan(
        toy_model(),
        toy_cluster(),
        toy_training(),
        16,
        {"pp": 2, "ep": 2},
        OPTS,
        evaluator=ToyEvaluator(),
    )
    assert (result.plan.parallel.pp, result.plan.parallel.ep) == (2, 2)
    assert all(r.parallel.pp == 2 and r.parallel.ep == 2 for r in result.rows)
    assert len(result.plan.stages) == 2


def test_outputs_do_not_depend_on_threads():
    args = (toy_model(), toy_cluster(3.0), toy_training(), 16, None)
    one = make_plan(*args, OPTS, evaluator=ToyEvaluator())
    two = make_plan(*args, replace(OPTS, threads=2), evaluator=ToyEvaluator())
    assert one.plan.to_json() == two.plan.to_json()
    assert [(r.order, r.status, r.reason, r.step_time_s) for r in one.rows] == [
        (r.order, r.status, r.reason, r.step_time_s) for r in two.rows
    ]


def test_ctrl_c_keeps_the_best_plan_so_far():
    args = (toy_model(), toy_cluster(3.0), toy_training(), 16, None, OPTS)
    counting = ToyEvaluator()
    full = make_plan(*args, evaluator=counting)
    assert counting.solves > 2
    result = make_plan(*args, evaluator=ToyEvaluator(interrupt_after=2))
    assert result.interrupted and result.plan is not None
    assert result.plan.extra["interrupted"] is True
    assert any(r.status == "interrupted" for r in result.rows)
    assert result.best.step_time_s >= full.best.step_time_s
    none = make_plan(*args, evaluator=ToyEvaluator(interrupt_after=0))
    assert none.interrupted and none.plan is None


def test_nothing_fits_explains_the_closest_candidate_and_the_fixes():
    result = make_plan(
        toy_model(), toy_cluster(1.2), toy_training(), 4, None, OPTS, evaluator=ToyEvaluator()
    )
    assert result.plan is None and not result.interrupted
    msg = result.message
    assert "closest is pp=" in msg and "--zero" in msg
    closest = min(result.rows, key=lambda r: r.memory_need_gib)
    need, usable = closest.memory_need_gib, closest.usable_memory_gib
    assert f"needing {need:.1f} GiB > {usable:.1f} GiB usable" in msg
    # the memory needed grows ~1/GPUs: suggest the next power of two that covers the ratio
    assert f"--gpus {4 * 2 ** math.ceil(math.log2(need / usable))}" in msg


def test_baselines_are_scored_and_never_beat_piper():
    result = make_plan(
        toy_model(), toy_cluster(4.0), toy_training(), 16, None, OPTS, evaluator=ToyEvaluator()
    )
    names = [b.name for b in result.baselines]
    assert names == ["uniform", "xmoe", "megatron"]
    xmoe = result.baselines[1]
    if xmoe.parallel is not None:
        assert (xmoe.parallel.pp, xmoe.parallel.tp, xmoe.parallel.dp) == (1, 1, 16)
    mega = result.baselines[2]
    assert mega.parallel.ep * mega.parallel.tp <= 4 and mega.parallel.micro_batch == 1
    for b in result.baselines:
        if b.estimate is not None and b.estimate.fits:
            assert b.speedup(result.best.step_time_s) >= 1 - 1e-9


def test_dp_scoring_and_ip_scoring_give_the_same_plan():
    args = (toy_model(layers=5), toy_cluster(3.0), toy_training(), 16, None, OPTS)
    by_dp = make_plan(*args, evaluator=ToyEvaluator(), score="dp")
    by_ip = make_plan(*args, evaluator=ToyEvaluator(), score="ip")
    assert by_dp.plan.to_json() == by_ip.plan.to_json()
    assert by_dp.plan.solver.backend == "cpsat"  # the winner is always confirmed by the IP


class _SigintEvaluator(ToyEvaluator):
    """Sends a real SIGINT to the process from a solver thread on the n-th scoring call."""

    interrupt_at = 4  # first call of the second batch: the first batch gave an incumbent

    def score_stages(self, inputs, options):
        if self.solves == self.interrupt_at:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(0.2)  # the main thread raises KeyboardInterrupt meanwhile
        self.solves += 1
        return ModelEvaluator().score_stages(inputs, options)


def test_a_real_sigint_mid_search_keeps_the_best_plan():
    backend = _SigintEvaluator()
    result = make_plan(
        toy_model(), toy_cluster(8.0), toy_training(), 16, None, OPTS, evaluator=backend
    )
    assert result.interrupted and result.plan is not None
    assert any(r.status == "interrupted" for r in result.rows)


def test_ctrl_c_after_a_cp_sat_solve_still_raises_keyboard_interrupt():
    model = LinearModel("tiny")
    x = model.int_var(0, 5, "x")
    model.add([(1, x)], ">=", 2)
    model.minimize([(1, x)])
    assert solve(model, OPTS).report.objective == 2
    with pytest.raises(KeyboardInterrupt):  # not SIG_DFL (process killed), not swallowed
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(1.0)


def test_pruning_is_safe_with_the_real_resource_model():
    """On a real model, branch and bound finds the exhaustive optimum, and every candidate's
    step-time bound is below its predicted step time."""
    from planner.inputs.clusters import load_cluster
    from planner.inputs.models import load_model
    from planner.specs import TrainingSpec

    model, cluster = load_model("qwen1.5-moe-a2.7b"), load_cluster("frontier")
    training = TrainingSpec(global_batch=64)
    ctx = new_context(model, cluster, training, 8, None, OPTS, ModelEvaluator())
    survivors, _ = screen(ctx, enumerate_layouts(model, cluster, training, ctx.space))
    rows = [_evaluate(ctx, c) for c in survivors]
    for cand, row in zip(survivors, rows, strict=True):
        if row.estimate is not None:
            assert cand.bound_s <= row.step_time_s * (1 + 1e-9)
    want = min((r for r in rows if r.feasible), key=lambda r: (r.step_time_s, r.order))
    got = make_plan(model, cluster, training, 8, None, OPTS)
    assert got.best.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
    assert got.best.parallel == want.parallel


def test_a_tiny_time_limit_still_returns_a_plan_with_its_gap():
    opts = SolverOptions("cpsat", 0.001, 1, 0)
    result = make_plan(
        toy_model(layers=8),
        toy_cluster(4.0),
        toy_training(),
        16,
        None,
        opts,
        evaluator=ToyEvaluator(),
        score="ip",
    )
    assert result.plan is not None
    s = result.plan.solver
    assert s.status in ("OPTIMAL", "FEASIBLE") and s.gap >= 0 and math.isfinite(s.gap)
    assert s.bound <= s.objective * (1 + 1e-9)


def test_a_layout_the_resource_model_rejects_becomes_an_infeasible_row():
    class Picky(ToyEvaluator):
        def cost_inputs(self, model, cluster, training, par):
            if par.tp == 2:
                raise SpecError("layout: tp=2 is not supported here")
            return super().cost_inputs(model, cluster, training, par)

    result = make_plan(
        toy_model(), toy_cluster(8.0), toy_training(), 16, None, OPTS, evaluator=Picky()
    )
    rows = [r for r in result.rows if r.parallel.tp == 2]
    assert rows and all(not r.feasible and "tp=2 is not supported" in r.reason for r in rows)
    assert result.plan.parallel.tp != 2
