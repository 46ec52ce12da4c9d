"""The search against the real resource model (planner.resources): its bounds never exceed
the predicted step or memory of any split (brute force over splits, vp/cp/etp/FSDP layouts
included), a family's first member bounds the others, and branch and bound finds the
exhaustive optimum over every knob."""

from __future__ import annotations

import itertools

import pytest

from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.ip.solvers import SolverOptions
from planner.parallel import ParallelConfig
from planner.search import bounds
from planner.search.costing import Costing, training_for
from planner.search.enumerate import enumerate_families
from planner.search.make_plan import make_plan
from planner.search.model_evaluator import ModelEvaluator
from planner.search.space import Candidate, Knobs, make_space
from planner.specs import GIB, TrainingSpec
from tests.planner.search.test_search import exhaustive_best

OPTS = SolverOptions("cpsat", 10.0, 1, 0)

LAYOUTS = [  # (layout, knobs, sequence length): every searched knob at least once
    (ParallelConfig(2, 2, 1, 2, 1, 4, "none", vp=2), Knobs("zero", True, "deepep"), 2048),
    (ParallelConfig(2, 1, 2, 4, 1, 2, "full", cp=2), Knobs("zero", False, "flat"), 4096),
    (ParallelConfig(1, 2, 2, 2, 2, 2, "full", etp=2), Knobs("fsdp", False, "halo"), 2048),
    (
        ParallelConfig(2, 4, 1, 4, 1, 4, "selective", vp=2, recompute_modules=("moe_act",)),
        Knobs("none", False, "flat"),
        2048,
    ),
    (ParallelConfig(4, 2, 1, 2, 1, 2, "full"), Knobs("fsdp", False, "deepep"), 2048),
]


def _splits(num_layers: int, pp: int, min_layers: int):
    for cuts in itertools.combinations(range(1, num_layers), pp - 1):
        edges = (0, *cuts, num_layers)
        if all(b - a >= min_layers for a, b in itertools.pairwise(edges)):
            yield tuple(tuple(range(a, b)) for a, b in itertools.pairwise(edges))


@pytest.mark.parametrize(("par", "knobs", "seq"), LAYOUTS)
def test_bounds_never_exceed_the_real_model_on_any_split(par, knobs, seq):
    """tiny-moe on CPU ranks: for every contiguous split (>= vp layers a stage; recompute all
    or none) the predicted step is at least the step bound, and the fullest stage's memory at
    least the memory bound plus the framework overhead."""
    model, cluster = load_model("tiny-moe"), load_cluster("cpu-gloo")
    cand = Candidate(par, knobs)
    training = training_for(TrainingSpec(seq_len=seq, global_batch=par.global_batch), cand)
    backend = ModelEvaluator()
    inputs = backend.cost_inputs(model, cluster, training, par, knobs.dispatcher)
    step_bound = bounds.step_time_lower_bound_s(inputs)
    mem_bound = bounds.min_peak_memory_bytes(inputs)
    overhead = cluster.framework_overhead_gib * GIB
    checked = 0
    for split in _splits(model.num_layers, par.pp, par.vp):
        for recompute in {False, True} if inputs.recompute_allowed else {False}:
            rc = split if recompute else tuple(() for _ in split)
            est = backend.estimate(model, cluster, training, par, split, rc, knobs.dispatcher)
            assert est.step_time_s >= step_bound * (1 - 1e-9)
            fullest = max(est.memory_gib_per_stage) * GIB
            assert fullest >= (mem_bound + overhead) * (1 - 1e-6)
            checked += 1
    assert checked >= 1


def test_a_familys_first_member_bounds_the_others_on_the_real_model():
    """qwen1.5-moe-a2.7b on 8 Frontier GCDs: inside every family each member's bound is at
    least the first member's, and the recompute policies of one knobs group share their
    layers' times without recompute (the two facts the lazy search relies on)."""
    model, cluster = load_model("qwen1.5-moe-a2.7b"), load_cluster("frontier")
    training = TrainingSpec(global_batch=64)
    costing = Costing(model, cluster, training, ModelEvaluator())
    families = enumerate_families(model, cluster, training, make_space(8, {"pp": 2}))
    for fam in families[::7]:
        inputs = [costing.cost_inputs(c) for c in fam.members]
        first = bounds.step_time_lower_bound_s(inputs[0])
        for cand, inp in zip(fam.members, inputs, strict=True):
            assert bounds.step_time_lower_bound_s(inp) >= first * (1 - 1e-6), cand
            same = [i for c, i in zip(fam.members, inputs, strict=True) if c.knobs == cand.knobs]
            times = {tuple(round(u.time_s, 12) for u in i.units) for i in same}
            assert len(times) == 1, cand


@pytest.mark.slow
def test_pruning_is_safe_with_the_real_resource_model():
    """On a real model with every knob searched, branch and bound finds the exhaustive
    optimum (every candidate costed and solved), and every candidate's step-time bound is
    below its predicted step time."""
    model, cluster = load_model("qwen1.5-moe-a2.7b"), load_cluster("frontier")
    training = TrainingSpec(global_batch=32)
    want, _, _, rows = exhaustive_best(model, cluster, training, 8, ModelEvaluator())
    for row in rows:
        if row.estimate is not None:
            assert row.bound_step_time_s <= row.step_time_s * (1 + 1e-9)
    got = make_plan(model, cluster, training, 8, None, OPTS)
    assert got.best.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
    assert (got.best.parallel, got.best.knobs) == (want.parallel, want.knobs)


def _uniform_family_cases():
    """mixtral-8x7b on 24 H100s, pp 3, as the megatron target prices it (one recompute
    policy for every layer): the families whose full-recompute member was the bound's source
    when a planned mb=1 layout was pruned behind a mb=2 one."""
    from planner.inputs.clusters import with_nodes
    from planner.search.make_plan import with_conventions
    from planner.targets import TARGETS

    model, cluster = load_model("mixtral-8x7b"), with_nodes(load_cluster("h100"), 3)
    training = with_conventions(TrainingSpec(4096, 1024), TARGETS["megatron"])
    assert training.uniform_recompute
    return model, cluster, training


def test_a_uniform_policy_bounds_each_family_by_its_member_without_recompute():
    """Under a uniform recompute policy a member's layer times include its recompute: the
    bound a family is queued with never exceeds any member's own step bound, and the members
    with full recompute bound above the member without (what made the old source unsafe)."""
    from planner.search.families import Bounded, _bound_one

    model, cluster, training = _uniform_family_cases()
    costing = Costing(model, cluster, training, ModelEvaluator())
    space = make_space(24, {"pp": 3, "tp": 1, "ep": 8})
    checked = above = 0
    for fam in enumerate_families(model, cluster, training, space):
        got = _bound_one(costing, fam)
        if not isinstance(got, Bounded):
            continue
        own = {c: bounds.step_time_lower_bound_s(costing.cost_inputs(c)) for c in fam.members}
        assert got.bound_s <= min(own.values()) * (1 + 1e-9), fam.members[0]
        assert got.source.parallel.recompute == "none"
        full = [b for c, b in own.items() if c.parallel.recompute == "full"]
        above += any(b > own[got.source] * 1.1 for b in full)
        checked += 1
    assert checked >= 4 and above >= 1


def test_branch_and_bound_finds_the_exhaustive_optimum_under_a_uniform_policy():
    """The megatron target's uniform recompute, mixtral-8x7b on 24 H100s (pp 3, tp 1, ep 8:
    micro-batch, recompute policy and sharding searched): branch and bound = every candidate
    solved."""
    model, cluster, training = _uniform_family_cases()
    fixed = {"pp": 3, "tp": 1, "ep": 8}
    want, _, _, _ = exhaustive_best(
        model, cluster, training, 24, ModelEvaluator(), fixed=fixed, sharding=("none", "zero")
    )
    got = make_plan(model, cluster, training, 24, fixed, OPTS, sharding=("none", "zero"))
    assert got.best.step_time_s == pytest.approx(want.step_time_s, rel=1e-9)
    assert got.best.parallel.micro_batch == want.parallel.micro_batch


def test_the_uniform_baseline_ranks_sharding_variants_by_the_whole_step():
    """tiny-moe on 2 CPU ranks, the piper target: the plan is pp 1 (itself an even split) with
    FSDP; the unsharded variant ties with it on the pipelined stage time but its whole step
    is longer. The best uniform split is the plan's layout, not the unsharded tie."""
    from planner.targets import TARGETS

    model, cluster = load_model("tiny-moe"), load_cluster("cpu-gloo")
    training = TrainingSpec(seq_len=64, global_batch=8)
    got = make_plan(model, cluster, training, 2, None, OPTS, target=TARGETS["piper"])
    uniform = next(b for b in got.baselines if b.name == "uniform")
    assert got.best.parallel.pp == 1 and got.best.knobs.sharding == "fsdp"
    assert uniform.parallel == got.best.parallel and uniform.knobs == got.best.knobs
    assert uniform.estimate.step_time_s == pytest.approx(got.best.step_time_s, rel=1e-9)
