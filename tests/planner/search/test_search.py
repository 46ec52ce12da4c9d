"""The outer search: bounds vs brute force, branch and bound vs exhaustive evaluation,
determinism across --threads, fixed sizes, Ctrl-C and infeasibility messages.

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

from planner.inputs.clusters import load_cluster
from planner.ip.solvers import LinearModel, SolverOptions, solve
from planner.resources.cost import even_split
from planner.resources.stage_inputs import StageCostInputs, StageExtras, UnitCost
from planner.search import bounds
from planner.search.branch_bound import _evaluate, new_context
from planner.search.costing import Costing, Screened
from planner.search.make_plan import default_dispatchers, make_plan
from planner.search.model_evaluator import ModelEvaluator
from planner.search.space import make_space
from planner.specs import SpecError
from tests.planner.ip.test_stage_ip import brute_force
from tests.planner.ip.test_stage_ip import random_inputs as random_stage_inputs
from tests.planner.search.plan_stubs import (
    ToyEvaluator,
    enumerate_layouts,
    toy_cluster,
    toy_model,
    toy_training,
)

OPTS = SolverOptions("cpsat", 10.0, 1, 0)


# ----------------------------------------------------------------------------- bounds


def _random_inputs(rng: random.Random, n: int, pp: int, m: int, rc: bool) -> StageCostInputs:
    units = []
    for i in range(n):
        t = rng.uniform(0.5, 2.0)
        act = rng.uniform(1, 5)
        units.append(UnitCost(i, "moe", t, t * 1.3, rng.uniform(1, 5), act, act * 0.2))
    first = StageExtras(rng.uniform(0, 1), rng.uniform(0, 3), rng.uniform(0, 1))
    last = StageExtras(rng.uniform(0, 1), rng.uniform(0, 3), rng.uniform(0, 1))
    vp = rng.choice([1, 2]) if pp > 1 else 1
    m = m * pp if vp > 1 else m
    overlap = rng.random() < 0.3
    return StageCostInputs(tuple(units), first, last, rng.uniform(8, 30), pp, m, rc, vp, overlap)


def _brute(inputs: StageCostInputs, min_layers: int) -> tuple[float, float]:
    """(min over splits of max stage memory, min of max stage time) by enumeration."""
    n, pp = len(inputs.units), inputs.pp
    best_mem = best_time = math.inf
    for cuts in itertools.combinations_with_replacement(range(n + 1), pp - 1):
        edges = (0, *cuts, n)
        if any(b - a < min_layers for a, b in itertools.pairwise(edges)):
            continue
        split = tuple(tuple(range(a, b)) for a, b in itertools.pairwise(edges))
        mem_min, _ = bounds.split_cost(inputs, split, inputs.recompute_allowed)
        _, time_fast = bounds.split_cost(inputs, split, False)
        best_mem = min(best_mem, max(mem_min))
        best_time = min(best_time, max(time_fast))
    return best_mem, best_time


@pytest.mark.parametrize("seed", range(40))
def test_bounds_equal_the_relaxed_brute_force_and_never_exceed_the_real_one(seed):
    """Interleaved (vp = 2) and overlapped in-flight counts included: the bounds solve the
    relaxation (empty stages allowed) exactly and stay below every real split (>= vp layers
    per stage); the step bound is pipeline_slots x the bottleneck, the quick one below it."""
    rng = random.Random(seed)
    n, pp = rng.randint(1, 7), rng.randint(1, 4)
    inputs = _random_inputs(rng, n, pp, rng.randint(1, 6), rng.random() < 0.5)
    relaxed_mem, relaxed_time = _brute(inputs, 0)
    assert bounds.min_peak_memory_bytes(inputs) == pytest.approx(relaxed_mem, rel=1e-6)
    assert bounds.bottleneck_time_lower_bound_s(inputs) == pytest.approx(relaxed_time, rel=1e-6)
    assert bounds.memory_may_fit(inputs) == (relaxed_mem <= inputs.usable_memory_bytes)
    step = bounds.step_time_lower_bound_s(inputs)
    assert step == pytest.approx(inputs.pipeline_slots * relaxed_time, rel=1e-6)
    assert inputs.pipeline_slots == inputs.num_microbatches + (pp - 1) / inputs.vp
    assert bounds.quick_step_time_bound_s(inputs) <= step * (1 + 1e-9)
    if pp * inputs.vp <= n:
        real_mem, real_time = _brute(inputs, inputs.vp)
        assert bounds.min_peak_memory_bytes(inputs) <= real_mem * (1 + 1e-9)
        assert bounds.bottleneck_time_lower_bound_s(inputs) <= real_time


@pytest.mark.parametrize("seed", range(6))
def test_recompute_aware_pruning_never_cuts_the_optimum_and_is_tighter(seed):
    """can_beat (fractional recompute to fit memory, empty stages allowed) against the stage
    split enumeration of tests/planner/ip: true at the real optimum's step, false below the
    relaxation; on instances where memory forces recompute it prunes steps the time-only
    bound lets through."""
    rng = random.Random(100 + seed)
    tighter = 0
    for _ in range(25):
        pp = rng.randint(1, 3)
        inputs = random_stage_inputs(rng, rng.randint(pp, 6), pp, rng.choice([None, 2]))
        best = brute_force(inputs)
        if best == math.inf:
            continue
        slots = inputs.pipeline_slots
        assert bounds.can_beat(inputs, slots * best * (1 + 1e-9))
        relaxed = bounds.step_time_lower_bound_s(inputs)
        assert not bounds.can_beat(inputs, relaxed * (1 - 1e-6))
        tighter += not bounds.can_beat(inputs, 0.5 * (relaxed + slots * best))
    assert tighter >= 1


def test_even_split_sizes():
    assert even_split(7, 3) == ((0, 1, 2), (3, 4), (5, 6))
    assert even_split(4, 4) == ((0,), (1,), (2,), (3,))


# ----------------------------------------------------------------------------- search


def exhaustive_best(model, cluster, training, gpus, backend, fixed=None, **space_kw):
    """Every candidate costed, screened and solved: (best row, candidates screened, all),
    over the dispatchers make_plan searches on `cluster` by default."""
    space_kw.setdefault("dispatchers", default_dispatchers(cluster))
    space = make_space(gpus, fixed, **space_kw)
    ctx = new_context(model, cluster, training, space, OPTS, backend)
    costing = Costing(model, cluster, training, backend)
    layouts = enumerate_layouts(model, cluster, training, space)
    screened = [costing.screen(i, c) for i, c in enumerate(layouts)]
    rows = [_evaluate(ctx, s) for s in screened if isinstance(s, Screened)]
    ok = [r for r in rows if r.feasible and r.estimate]
    best = min(ok, key=lambda r: (r.step_time_s, r.order))
    return best, sum(isinstance(s, Screened) for s in screened), layouts, rows


@pytest.mark.parametrize("memory_gib", [3.0, 8.0])
def test_branch_and_bound_finds_the_exhaustive_optimum_with_fewer_solves(memory_gib):
    """Every knob searched (vp, etp, folded ep, recompute modules, FSDP, overlap, three
    dispatchers): the same optimum as solving every candidate, with fewer solves and fewer
    costings than candidates; pruned rows' bounds are not below the best."""
    model, cluster, training = toy_model(), toy_cluster(memory_gib), toy_training()
    want, survivors, layouts, _ = exhaustive_best(model, cluster, training, 16, ToyEvaluator())
    backend = ToyEvaluator()
    result = make_plan(model, cluster, training, 16, None, OPTS, evaluator=backend)
    assert result.best.step_time_s == pytest.approx(want.step_time_s, rel=1e-12)
    assert (result.best.parallel, result.best.knobs) == (want.parallel, want.knobs)
    assert result.plan.predicted.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
    assert backend.solves < survivors / 3
    assert backend.costed < len(layouts) / 3
    pruned = [r for r in result.rows if r.status == "pruned"]
    assert pruned and all(r.bound_step_time_s >= result.best.step_time_s for r in pruned)
    assert all(r.reason.startswith("pruned: bound") for r in pruned)
    assert {r.status for r in result.rows} >= {"solved", "pruned", "dominated"}
    # every candidate enumerated is a row, ranked: feasible solved rows first by step time
    assert sorted(r.order for r in result.rows) == list(range(len(layouts)))
    assert result.rows[0].order == result.best.order


def test_dominated_dispatchers_are_rows_with_the_reason():
    """HALO-dedup is the toy's 0.7x all-to-all for EP groups beyond a node (same memory as
    flat): flat and DeepEP (0.9x, a dispatch buffer) are dominated there; inside a node HALO
    is not enumerated and DeepEP trades memory for time against flat, so both stay. Plain
    HALO (0.8x) is searched only when named."""
    result = make_plan(
        toy_model(), toy_cluster(8.0), toy_training(), 16, None, OPTS, evaluator=ToyEvaluator()
    )
    dominated = [r for r in result.rows if r.status == "dominated"]
    assert {r.knobs.dispatcher for r in dominated} == {"flat", "deepep"}
    assert all(r.parallel.ep * r.parallel.etp > 4 for r in dominated)
    assert all("dispatcher halo-dedup is no slower" in r.reason for r in dominated)
    inside = [r for r in result.rows if r.parallel.ep * r.parallel.etp <= 4]
    assert not any(r.knobs.dispatcher.startswith("halo") for r in inside)
    assert not any(r.knobs.dispatcher == "halo" for r in result.rows)
    named = make_plan(
        toy_model(), toy_cluster(8.0), toy_training(), 16, None, OPTS, evaluator=ToyEvaluator(),
        dispatchers=("halo", "halo-dedup"),
    )  # fmt: skip
    beaten = [r for r in named.rows if r.status == "dominated"]
    assert {r.knobs.dispatcher for r in beaten} == {"halo"}


def test_small_memory_forces_recompute_or_deeper_pipeline():
    model, training = toy_model(), toy_training()
    roomy = make_plan(model, toy_cluster(16.0), training, 16, None, OPTS, evaluator=ToyEvaluator())
    tight = make_plan(model, toy_cluster(2.2), training, 16, None, OPTS, evaluator=ToyEvaluator())
    assert tight.best.step_time_s >= roomy.best.step_time_s
    assert max(tight.plan.predicted.memory_gib_per_stage) <= tight.plan.predicted.usable_memory_gib
    infeasible = [r for r in tight.rows if r.status == "infeasible"]
    assert infeasible and all("GiB" in r.reason for r in infeasible)


def test_nothing_fits_without_cp_so_a_second_pass_tries_it():
    """Sequence 12288 (cp is not searched below 16384): no layout fits 1.15 GiB until cp
    splits the activations; the second pass's rows follow the first's."""
    model, training, cluster = toy_model(), toy_training(seq_len=12288), toy_cluster(1.15)
    space = make_space(16, {"cp": 1}, dispatchers=default_dispatchers(cluster))
    fixed = make_plan(model, cluster, training, 16, {"cp": 1}, OPTS, evaluator=ToyEvaluator())
    assert fixed.plan is None and "closest is" in fixed.message
    result = make_plan(model, cluster, training, 16, None, OPTS, evaluator=ToyEvaluator())
    assert result.plan is not None and result.plan.parallel.cp == 2
    first = len(enumerate_layouts(model, cluster, training, space))
    assert all(r.parallel.cp == 1 for r in result.rows if r.order < first)
    assert all(r.parallel.cp > 1 for r in result.rows if r.order >= first)


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
    assert all(len(s.layers) >= result.plan.parallel.vp for s in result.plan.stages)


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
    assert len(result.rows) == len(full.rows)
    assert result.best.step_time_s >= full.best.step_time_s
    none = make_plan(*args, evaluator=ToyEvaluator(interrupt_after=0))
    assert none.interrupted and none.plan is None


def test_nothing_fits_explains_the_closest_candidate_and_the_fixes():
    result = make_plan(
        toy_model(), toy_cluster(1.1), toy_training(), 4, None, OPTS, evaluator=ToyEvaluator()
    )
    assert result.plan is None and not result.interrupted
    msg = result.message
    closest = min(result.rows, key=lambda r: (r.memory_need_gib / r.usable_memory_gib, r.order))
    need, usable = closest.memory_need_gib, closest.usable_memory_gib
    assert "closest is pp=" in msg and f"needing {need:.1f} GiB > {usable:.1f} GiB usable" in msg
    # the memory needed grows ~1/GPUs: the next power of two that covers the ratio, which fits
    more = 4 * 2 ** math.ceil(math.log2(need / usable))
    assert msg.endswith(f"; try more GPUs (--gpus {more})")
    assert make_plan(toy_model(), toy_cluster(1.1), toy_training(), more, None, OPTS,
                     evaluator=ToyEvaluator()).plan is not None  # fmt: skip


def test_nothing_fits_names_no_fix_that_fails():
    """FSDP is searched at pp = 1, where these layouts have dp = 1: --fsdp (with pipelining)
    fits nothing, nor do 8 GPUs, so neither is named."""
    args = (toy_model(), toy_cluster(1.05), toy_training())
    result = make_plan(*args, 4, None, OPTS, evaluator=ToyEvaluator())
    assert result.message.endswith("; try more GPUs or a device with more memory")
    assert "--fsdp" not in result.message and "--gpus" not in result.message
    fsdp = make_plan(*args, 4, None, OPTS, evaluator=ToyEvaluator(), sharding=("fsdp",))
    assert fsdp.plan is None
    assert make_plan(*args, 8, None, OPTS, evaluator=ToyEvaluator()).plan is None


def test_nothing_fits_names_fsdp_with_pipelining_and_nodes_when_they_fit():
    args = (toy_model(layers=8, d=4096), toy_cluster(2.0), toy_training())
    result = make_plan(*args, 16, None, OPTS, evaluator=ToyEvaluator())
    assert result.message.endswith(
        "; try --fsdp (FSDP with pipelining too), more GPUs (--gpus 32 --nodes 8)"
    )
    fsdp = make_plan(*args, 16, None, OPTS, evaluator=ToyEvaluator(), sharding=("fsdp",))
    assert fsdp.plan is not None and fsdp.plan.parallel.pp > 1


def test_baselines_are_scored_and_never_beat_piper():
    result = make_plan(
        toy_model(), toy_cluster(4.0), toy_training(), 16, None, OPTS, evaluator=ToyEvaluator()
    )
    names = [b.name for b in result.baselines]
    assert names == ["uniform", "xmoe", "generic"]  # the toy model has no published recipe
    xmoe = result.baselines[1]
    if xmoe.parallel is not None:
        assert (xmoe.parallel.pp, xmoe.parallel.tp, xmoe.parallel.dp) == (1, 1, 16)
    mega = result.baselines[2]
    assert mega.parallel.ep * mega.parallel.tp <= 4 and mega.parallel.micro_batch == 1
    assert mega.knobs.sharding == "zero" and mega.knobs.dispatcher == "flat"
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
        def cost_inputs(self, model, cluster, training, par, dispatcher):
            if par.tp == 2:
                raise SpecError("layout: tp=2 is not supported here")
            return super().cost_inputs(model, cluster, training, par, dispatcher)

    result = make_plan(
        toy_model(), toy_cluster(8.0), toy_training(), 16, None, OPTS, evaluator=Picky()
    )
    rows = [r for r in result.rows if r.parallel.tp == 2 and r.status != "pruned"]
    assert rows and all(not r.feasible for r in rows)
    assert any("tp=2 is not supported" in r.reason for r in rows)
    assert result.plan.parallel.tp != 2


def test_deepep_is_searched_only_where_it_runs():
    # DeepEP / HybridEP need NVLink: not searched on Frontier's Infinity Fabric or the CPU
    # emulation unless asked for; searched on the NVIDIA presets
    assert default_dispatchers(load_cluster("frontier")) == ("flat", "halo-dedup")
    assert default_dispatchers(load_cluster("cpu-gloo")) == ("flat", "halo-dedup")
    for name in ("h100", "h200", "gb200-nvl72"):
        assert "deepep" in default_dispatchers(load_cluster(name))


def test_whole_iteration_cuda_graphs_turn_the_overlap_off():
    model, cluster = toy_model(), toy_cluster(8.0)
    training = replace(toy_training(), cuda_graphs="full")
    got = make_plan(model, cluster, training, 16, None, OPTS, evaluator=ToyEvaluator())
    assert got.plan is not None and not any(r.knobs.a2a_overlap for r in got.rows)
    with pytest.raises(SpecError, match="--cuda-graphs full"):
        make_plan(model, cluster, training, 16, None, OPTS, a2a_overlap=True,
                  evaluator=ToyEvaluator())  # fmt: skip
