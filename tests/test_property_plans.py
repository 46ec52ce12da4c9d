"""Property tests (hypothesis): random valid models, clusters and GPU counts either plan, and
the plan satisfies its own constraints, or fail with a SpecError that explains why; random
invalid clusters, traces and allocations are rejected with SpecError and nothing else.

Constraints checked on every plan: stages are contiguous and cover every layer once; the
predicted memory of every stage fits the usable memory; pp*dp*tp*cp == gpus; etp*ep divides
tp*cp*dp (the folded expert mesh) and ep the expert count; every stage holds at least vp
layers; every EP rank holds E/ep experts of every MoE layer; the ranks table numbers 0..N-1
and puts each on a distinct device of the nodes used. Random subsets of the searched knobs
(sharding, the all-to-all overlap, the dispatcher) are fixed as the flags fix them.
"""

from __future__ import annotations

import copy
import functools
import json
import math
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from planner.inputs.allocation import parse_allocation
from planner.inputs.clusters import cluster_from_dict
from planner.inputs.models import model_from_config
from planner.ip.solvers import SolverOptions
from planner.migration.trace import check_divisible, load_trace
from planner.plan import plan_from_dict
from planner.search.make_plan import make_plan
from planner.specs import SpecError, TrainingSpec

SETTINGS = settings(
    max_examples=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
FAST = settings(SETTINGS, max_examples=120)


@st.composite
def model_configs(draw) -> dict:
    """A small valid MoE config in Piper's generic keys (at least one MoE layer)."""
    heads = draw(st.sampled_from([2, 4, 8]))
    layers = draw(st.integers(1, 6))
    experts = draw(st.sampled_from([2, 4, 6, 8, 16]))
    return {
        "model_type": "moe",
        "hidden_size": heads * draw(st.sampled_from([16, 32, 64, 128])),
        "num_attention_heads": heads,
        "num_key_value_heads": draw(st.sampled_from([h for h in (1, 2, heads) if heads % h == 0])),
        "num_hidden_layers": layers,
        "first_k_dense_replace": draw(st.integers(0, layers - 1)),
        "intermediate_size": draw(st.integers(32, 1024)),
        "moe_intermediate_size": draw(st.integers(16, 512)),
        "num_experts": experts,
        "num_experts_per_tok": draw(st.integers(1, min(experts, 4))),
        "n_shared_experts": draw(st.integers(0, 1)),
        "vocab_size": draw(st.integers(256, 32000)),
    }


@st.composite
def cluster_dicts(draw) -> dict:
    """A valid cluster YAML structure with 1-3 topology levels (innermost first)."""
    g = draw(st.sampled_from([1, 2, 4, 8]))
    n = draw(st.integers(1, 16 // g))  # at most 16 devices: each search stays well under 1 s
    total = g * n
    levels = []
    if g >= 2 and draw(st.booleans()):
        levels.append({"name": "package", "devices": g // 2, "bw_gbps": 200.0})
    if n >= 2:
        levels.append({"name": "node", "devices": g, "bw_gbps": 100.0})
        switch = [k for k in range(2, n) if n % k == 0]
        if switch and len(levels) < 2 and draw(st.booleans()):
            levels.append({"name": "switch", "devices": g * draw(st.sampled_from(switch)),
                           "bw_gbps": 25.0})  # fmt: skip
    levels.append({"name": "system", "devices": total, "bw_gbps": 12.5, "taper": 0.5})
    for lv in levels:
        lv["latency_us"] = draw(st.floats(0.5, 10.0))
    memory = draw(st.sampled_from([0.1, 0.25, 0.5, 2.0, 8.0, 80.0]))
    return {
        "name": "hypo",
        "device": {
            "name": "dev",
            "memory_gib": memory,
            "peak_tflops": {"bf16": draw(st.floats(1.0, 1000.0))},
            "hbm_gbps": draw(st.floats(100.0, 5000.0)),
        },
        "gpus_per_node": g,
        "num_nodes": n,
        "nics_per_node": draw(st.integers(1, 8)),
        "nic_gbps": draw(st.floats(1.0, 50.0)),
        "framework_overhead_gib": memory * draw(st.sampled_from([0.05, 0.2, 0.5])),
        "levels": levels,
    }


def check_plan(p, model, cluster, gpus: int) -> None:
    """Every constraint a plan states about itself (see the module docstring)."""
    par = p.parallel
    assert par.pp * par.dp * par.tp * par.cp == gpus
    assert (par.tp * par.cp * par.dp) % (par.etp * par.ep) == 0  # the folded expert mesh
    assert par.edp == par.tp * par.cp * par.dp // (par.etp * par.ep)
    layers = [layer for st_ in p.stages for layer in st_.layers]
    assert layers == list(range(model.num_layers)), "stages must cover each layer once, in order"
    assert [s.stage for s in p.stages] == list(range(par.pp))
    assert all(len(s.layers) >= par.vp for s in p.stages)  # one layer per interleaved chunk
    assert par.vp == 1 or par.num_microbatches % par.pp == 0
    for s in p.stages:
        assert set(s.recompute_layers) <= set(s.layers)
    usable = p.predicted.usable_memory_gib
    assert len(p.predicted.memory_gib_per_stage) == par.pp
    assert max(p.predicted.memory_gib_per_stage) <= usable * (1 + 1e-9)
    assert sorted(e.layer for e in p.experts) == list(model.moe_layers)
    for e in p.experts:
        num_e = model.layers[e.layer].moe.num_experts
        assert num_e % par.ep == 0
        assert len(e.rank_of_expert) == num_e
        counts = [e.rank_of_expert.count(r) for r in range(par.ep)]
        assert counts == [num_e // par.ep] * par.ep
    assert sorted(r.rank for r in p.ranks) == list(range(gpus))
    devices = {(r.node, r.local_rank) for r in p.ranks}
    assert len(devices) == gpus
    assert all(0 <= r.local_rank < cluster.gpus_per_node for r in p.ranks)
    assert max(r.node for r in p.ranks) < cluster.num_nodes
    assert {r.stage for r in p.ranks} == set(range(par.pp))
    assert all(r.ep < par.ep and r.dp < par.dp and r.tp < par.tp for r in p.ranks)
    assert all(r.cp < par.cp for r in p.ranks)
    training = p.training
    assert not (training["zero"] and training["fsdp"])
    # plan.json is strict JSON (no NaN/Infinity, which jq and other tools reject)
    json.loads(p.to_json(), parse_constant=_reject_constant)


def _reject_constant(name: str) -> None:
    raise AssertionError(f"plan.json holds {name}, which is not JSON")


@SETTINGS
@given(cfg=model_configs(), cdict=cluster_dicts(), data=st.data())
def test_random_valid_inputs_plan_or_explain(cfg, cdict, data):
    model = model_from_config(cfg, "hypo-model", "hypothesis")
    cluster = cluster_from_dict(cdict, "hypothesis")
    total = cluster.total_gpus
    some = st.sampled_from(sorted({total, max(1, total // 2), 1}))
    gpus = data.draw(some | st.integers(1, total), label="gpus")
    training = TrainingSpec(
        seq_len=data.draw(st.sampled_from([128, 512, 2048]), label="seq_len"),
        global_batch=data.draw(st.sampled_from([8, 16, 64]), label="global_batch"),
    )
    knobs = {  # a random subset of the searched knobs fixed, as the flags do
        "sharding": data.draw(st.sampled_from([None, ("zero",), ("fsdp",), ("none",)])),
        "a2a_overlap": data.draw(st.sampled_from([None, True, False]), label="a2a_overlap"),
        "dispatchers": data.draw(
            st.sampled_from([None, ["flat"], ["halo"], ["halo-dedup"], ["deepep"]])
        ),
    }
    loads = None
    if data.draw(st.booleans(), label="trace"):  # unequal loads: the expert IP places experts
        loads = {
            layer: tuple(float(x) for x in data.draw(
                st.lists(st.integers(0, 1000), min_size=model.num_experts,
                         max_size=model.num_experts), label=f"load_E[{layer}]"))
            for layer in model.moe_layers
        }  # fmt: skip
    try:
        result = make_plan(
            model, cluster, training, gpus, None, SolverOptions("cpsat", 5.0, 1, 0), None, loads,
            **knobs,
        )  # fmt: skip
    except SpecError as exc:
        event(f"SpecError {str(exc)[:30]}")
        assert str(exc) and "\n" not in str(exc)
        return
    if result.plan is None:
        event("no layout fits")
        assert not result.interrupted
        assert result.message and "\n" not in result.message  # says what would fit
        return
    event(f"planned pp={result.plan.parallel.pp > 1} ep={result.plan.parallel.ep > 1}")
    check_plan(result.plan, model, cluster, gpus)


@SETTINGS
@given(cdict=cluster_dicts(), extra=st.integers(1, 64))
def test_more_gpus_than_the_cluster_is_a_spec_error(cdict, extra):
    cfg = {"model_type": "moe", "hidden_size": 64, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 128, "moe_intermediate_size": 64,
           "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 256}  # fmt: skip
    model = model_from_config(cfg, "m", "hypothesis")
    cluster = cluster_from_dict(cdict, "hypothesis")
    gpus = cluster.total_gpus + extra
    try:
        result = make_plan(model, cluster, TrainingSpec(seq_len=128, global_batch=8), gpus, None,
                      SolverOptions("cpsat", 5.0, 1, 0))  # fmt: skip
    except SpecError as exc:
        assert str(gpus) in str(exc) or str(cluster.total_gpus) in str(exc), str(exc)
        return
    assert result.plan is None and result.message, "planned on GPUs the cluster does not have"


# ---- invalid inputs: SpecError and nothing else ---------------------------------------------

BAD_VALUES = st.sampled_from([None, -1, 0, -0.5, 1.5, "x", "", [], {}, [1], True, float("nan")])


def _paths(d, prefix=()):
    """Every key path of a nested dict/list structure."""
    if isinstance(d, dict):
        for k, v in d.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


def _set(d, path, value):
    d = copy.deepcopy(d)
    target = d
    for key in path[:-1]:
        target = target[key]
    if value is _DELETE:
        del target[path[-1]]
    else:
        target[path[-1]] = value
    return d


_DELETE = object()


@FAST
@given(cdict=cluster_dicts(), data=st.data())
def test_corrupted_cluster_is_a_spec_error_or_still_valid(cdict, data):
    path = data.draw(st.sampled_from(list(_paths(cdict))), label="field")
    value = data.draw(st.one_of(BAD_VALUES, st.just(_DELETE)), label="value")
    bad = _set(cdict, path, value)
    try:
        cluster = cluster_from_dict(bad, "bad.yaml")
    except SpecError as exc:
        msg = str(exc)
        assert "\n" not in msg and "bad.yaml" in msg
        return
    # accepted: then it must still be a usable cluster
    assert cluster.total_gpus >= 1 and cluster.device.memory_gib > 0
    assert all(math.isfinite(lv.bw_gbps) and lv.bw_gbps > 0 for lv in cluster.levels)


@st.composite
def trace_rows(draw):
    intervals, layers, experts = draw(st.integers(1, 3)), draw(st.integers(1, 3)), 4
    cells = [(i, la, e) for i in range(intervals) for la in range(1, layers + 1)
             for e in range(experts)]  # fmt: skip
    return [(*cell, draw(st.integers(0, 100))) for cell in cells]


@FAST
@given(rows=trace_rows(), data=st.data())
def test_corrupted_trace_is_a_spec_error_or_still_valid(rows, data):
    action = data.draw(st.sampled_from(["drop", "duplicate", "negative", "shift", "none"]))
    i = data.draw(st.integers(0, len(rows) - 1))
    rows = list(rows)
    if action == "drop":
        del rows[i]
    elif action == "duplicate":
        rows.append(rows[i])
    elif action == "negative":
        rows[i] = (*rows[i][:3], -1)
    elif action == "shift":  # renumber one interval: a gap or a partial interval
        rows[i] = (rows[i][0] + 2, *rows[i][1:])
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "bad.csv"
        path.write_text("interval,layer,expert,tokens\n" + "".join(f"{i},{la},{e},{t}\n"
                        for i, la, e, t in rows))  # fmt: skip
        try:
            trace = load_trace(path)
        except SpecError as exc:
            error = str(exc)
        else:
            error = ""
    if error:
        assert "\n" not in error and "bad.csv" in error
        assert action != "none", f"a valid trace was rejected: {error}"
        return
    assert action in ("none", "drop")  # negative, duplicate and shifted rows are always caught
    assert (trace.tokens_ILE >= 0).all()
    assert trace.tokens_ILE.shape[0] * trace.num_layers * trace.num_experts == len(rows)
    ranks = data.draw(st.integers(1, 6), label="ep")
    try:
        check_divisible(trace, ranks)
    except SpecError as exc:
        assert trace.num_experts % ranks and "--ep" in str(exc)
    else:
        assert trace.num_experts % ranks == 0


NODE = st.fixed_dictionaries(
    {"hostname": st.one_of(st.text(min_size=1, max_size=4), st.integers(0, 3)),
     "switch": st.one_of(st.integers(0, 2), st.text(max_size=2))},
    optional={"group": st.one_of(st.integers(0, 1), st.none())},
)  # fmt: skip


@FAST
@given(rows=st.one_of(st.lists(st.one_of(NODE, BAD_VALUES), max_size=4), BAD_VALUES))
def test_random_allocation_is_a_spec_error_or_valid(rows):
    try:
        alloc = parse_allocation(rows, "alloc.yaml")
    except SpecError as exc:
        assert "\n" not in str(exc) and "alloc.yaml" in str(exc)
        return
    hosts = [n.hostname for n in alloc.nodes]
    assert len(hosts) == len(set(hosts)) >= 1
    assert all(n.switch for n in alloc.nodes)


def test_no_fit_with_nothing_usable_is_explained_not_a_crash():
    """Found by the property test above: 0.05 GiB left after the framework overhead and
    less than nothing once full recompute reserves its workspace."""
    cfg = {"model_type": "moe", "hidden_size": 512, "num_attention_heads": 4,
           "num_hidden_layers": 2, "intermediate_size": 1024, "moe_intermediate_size": 512,
           "num_experts": 4, "num_experts_per_tok": 2, "vocab_size": 1000}  # fmt: skip
    cdict = {"name": "small", "gpus_per_node": 1, "num_nodes": 1, "nics_per_node": 1,
             "nic_gbps": 50.0, "framework_overhead_gib": 0.2,
             "device": {"name": "d", "memory_gib": 0.25, "peak_tflops": {"bf16": 1.0},
                        "hbm_gbps": 233.0},
             "levels": [{"name": "system", "devices": 1, "bw_gbps": 12.5,
                         "latency_us": 7.0}]}  # fmt: skip
    model = model_from_config(cfg, "m", "test")
    cluster = cluster_from_dict(cdict, "test")
    training = TrainingSpec(seq_len=4096, global_batch=8)
    result = make_plan(model, cluster, training, 1, None, SolverOptions("cpsat", 5.0, 1, 0))
    assert result.plan is None and "fits in memory" in result.message
    assert "a device with more memory" in result.message


@functools.lru_cache(maxsize=1)
def _good_plan_dict() -> dict:
    from planner.inputs.clusters import load_cluster
    from planner.inputs.models import load_model

    result = make_plan(load_model("tiny-moe"), load_cluster("cpu-gloo"),
                  TrainingSpec(seq_len=256, global_batch=16), 8, {"pp": 2, "ep": 2},
                  SolverOptions("cpsat", 5.0, 1, 0))  # fmt: skip
    assert result.plan is not None, result.message
    return json.loads(result.plan.to_json())


@FAST
@given(data=st.data())
def test_corrupted_plan_json_is_a_spec_error_or_still_valid(data):
    good = _good_plan_dict()
    paths = [p for p in _paths(good) if p[0] not in ("extra", "model", "cluster", "training")]
    path = data.draw(st.sampled_from(paths), label="field")
    value = data.draw(st.one_of(BAD_VALUES, st.just(_DELETE), st.integers(-3, 40)), label="value")
    bad = _set(good, path, value)
    try:
        p = plan_from_dict(bad, "bad/plan.json")
    except SpecError as exc:
        assert "\n" not in str(exc) and "bad/plan.json" in str(exc)
        return
    # accepted: the sizes still agree with each other
    par = p.parallel
    assert min(par.pp, par.dp, par.tp, par.ep, par.micro_batch, par.num_microbatches) >= 1
    assert len(p.stages) == par.pp and len(p.ranks) in (0, par.pp * par.dp * par.tp)
    assert all(0 <= r < par.ep for e in p.experts for r in e.rank_of_expert)
    numbers = [*p.predicted.memory_gib_per_stage, *(s for _, s in p.predicted.comm_s)]
    numbers += [p.predicted.step_time_s, p.predicted.mfu, p.predicted.usable_memory_gib]
    assert all(isinstance(x, int | float) and not isinstance(x, bool) for x in numbers)
    assert all(isinstance(x, int | float) for x in (p.solver.objective, p.solver.gap))
