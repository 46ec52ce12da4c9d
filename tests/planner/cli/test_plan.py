"""`piper plan` as a user runs it: defaults, files, determinism, fixed sizes, infeasibility,
--json, --trace, Ctrl-C. In-process (planner.cli.main) to keep it fast."""

from __future__ import annotations

import csv
import itertools
import json
from pathlib import Path

import pytest

from planner.cli import main
from planner.plan import load_plan
from planner.search import make_plan as search_module

OUTPUTS = {
    "plan.json",
    "timings.json",
    "candidates.csv",
    "stages.csv",
    "memory.csv",
    "comm.csv",
    "summary.md",
    "memory.png",
    "time.png",
    "timeline.png",
}


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("default")
    assert main(["plan", "--out", str(out)]) == 0
    return out


def test_default_plan_writes_every_output_and_a_valid_plan(default_run, capsys):
    assert OUTPUTS <= {p.name for p in default_run.iterdir()}
    plan = load_plan(default_run / "plan.json")
    assert plan.model.name == "mixtral-8x7b" and plan.cluster.name == "frontier"
    assert plan.training["seq_len"] == 4096 and plan.training["global_batch"] == 1024
    par = plan.parallel
    assert par.pp * par.dp * par.tp * par.cp == 64
    assert par.dp * par.micro_batch * par.num_microbatches == 1024
    assert [layer for s in plan.stages for layer in s.layers] == list(range(32))
    assert len(plan.ranks) == 64 and sorted(r.rank for r in plan.ranks) == list(range(64))
    assert plan.solver.status == "OPTIMAL" and plan.solver.backend == "cpsat"
    assert max(plan.predicted.memory_gib_per_stage) <= 64.0
    assert len(plan.inputs_sha256) == 64
    timings = json.loads((default_run / "timings.json").read_text())
    assert timings["total_s"] > 0


def _outputs(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in path.iterdir() if p.name != "timings.json"}


def test_outputs_are_byte_identical_across_runs_threads_and_scoring(tmp_path, capsys):
    small = ["plan", "--gpus", "16", "--global-batch", "256"]
    assert main([*small, "--out", str(tmp_path / "a")]) == 0
    assert main([*small, "--out", str(tmp_path / "b")]) == 0
    capsys.readouterr()
    assert main([*small, "--threads", "2", "--json", "--out", str(tmp_path / "c")]) == 0
    doc = json.loads(capsys.readouterr().out)
    first = _outputs(tmp_path / "a")
    assert OUTPUTS - {"timings.json"} == set(first)
    assert _outputs(tmp_path / "b") == first
    assert _outputs(tmp_path / "c") == first
    # the stage IP on every candidate finds the same plan as the exact DP
    assert main([*small, "--score", "ip", "--out", str(tmp_path / "d")]) == 0
    assert _outputs(tmp_path / "d") == first
    # --json: a machine-readable summary of the same plan
    plan = load_plan(tmp_path / "c" / "plan.json")
    assert doc["ok"] and doc["inputs_sha256"] == plan.inputs_sha256
    assert doc["parallel"]["pp"] == plan.parallel.pp
    assert doc["knobs"]["dispatcher"] == plan.extra["dispatcher"]
    assert doc["knobs"]["a2a_overlap"] == plan.training["a2a_overlap"]
    assert [b["name"] for b in doc["baselines"]] == ["uniform", "xmoe", "generic"]


def test_fixed_pp_and_ep_are_honoured(tmp_path):
    assert main(["plan", "--pp", "4", "--ep", "4", "--out", str(tmp_path)]) == 0
    plan = load_plan(tmp_path / "plan.json")
    assert (plan.parallel.pp, plan.parallel.ep) == (4, 4)
    lines = (tmp_path / "candidates.csv").read_text().splitlines()
    header = lines[0].split(",")
    pp, ep = header.index("pp"), header.index("ep")
    assert all(row.split(",")[pp] == "4" and row.split(",")[ep] == "4" for row in lines[1:])
    assert len(plan.stages) == 4


def test_a_model_whose_state_cannot_fit_is_refused_before_the_search(tmp_path, capsys):
    """deepseek-v3 (671.0B parameters x 18 B) on 64 GCDs of 64 GiB: 175.8 GiB per GCD even
    fully sharded; 212 GCDs would hold it; the next doubling of 64 is 256."""
    code = main(["plan", "--model", "deepseek-v3", "--gpus", "64", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.splitlines() == [
        "piper plan: error: plan: deepseek-v3 cannot fit on 64 GPUs of frontier: its weights, "
        "gradients and optimizer state (671.0B parameters x 18 B) need 175.8 GiB per GPU even "
        "fully sharded, over the 53.1 GiB usable; at least 212 GPUs hold them; try more GPUs "
        "(--gpus 256)"
    ]
    assert not (tmp_path / "plan.json").exists()


def test_trace_drives_a_balanced_expert_placement(tmp_path):
    loads = [90, 10, 70, 30, 60, 40, 55, 45]  # tokens per expert, layer 0 of mixtral-8x7b
    rows = ["interval,layer,expert,tokens"]
    rows += [f"{i},0,{e},{t // 2}" for i in range(2) for e, t in enumerate(loads)]
    trace = tmp_path / "trace.csv"
    trace.write_text("\n".join(rows) + "\n")
    out = tmp_path / "out"
    args = ["plan", "--gpus", "16", "--global-batch", "256", "--ep", "4", "--trace", str(trace)]
    assert main([*args, "--out", str(out)]) == 0
    plan = load_plan(out / "plan.json")
    placement = next(e for e in plan.experts if e.layer == 0).rank_of_expert
    rank_load = [sum(t for e, t in enumerate(loads) if placement[e] == r) for r in range(4)]
    assert sorted(placement.count(r) for r in range(4)) == [2, 2, 2, 2]
    # oracle: best pairing of 8 experts into 4 ranks of 2 by brute force
    best = min(max(loads[a] + loads[b] for a, b in pairs) for pairs in _pairings(list(range(8))))
    assert max(rank_load) == best
    other = next(e for e in plan.experts if e.layer == 1).rank_of_expert  # uniform layer
    assert other == (0, 0, 1, 1, 2, 2, 3, 3)


def _pairings(items):
    if not items:
        yield []
        return
    first = items[0]
    for k in range(1, len(items)):
        rest = items[1:k] + items[k + 1 :]
        for tail in _pairings(rest):
            yield [(first, items[k]), *tail]


TINY = ["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "8", "--seq-len", "128",
        "--global-batch", "16"]  # fmt: skip


def test_every_knob_is_fixed_by_its_flag(tmp_path):
    """--vp --etp --recompute-modules --fsdp --a2a-overlap --dispatcher --mtp-layers --dtype:
    the plan and every candidate row carry them."""
    flags = ["--pp", "2", "--vp", "2", "--etp", "2", "--ep", "2", "--recompute-modules",
             "moe_act,layernorm", "--fsdp", "--a2a-overlap", "--dispatcher", "deepep",
             "--mtp-layers", "0", "--optimizer-dtype", "bf16", "--target", "megatron"]  # fmt: skip
    assert main([*TINY, *flags, "--out", str(tmp_path)]) == 0
    plan = load_plan(tmp_path / "plan.json")
    par = plan.parallel
    assert (par.pp, par.vp, par.etp, par.ep, par.recompute) == (2, 2, 2, 2, "selective")
    assert par.recompute_modules == ("layernorm", "moe_act")
    assert plan.training["fsdp"] and not plan.training["zero"] and plan.training["a2a_overlap"]
    assert plan.training["mtp_layers"] == 0 and plan.training["optimizer_dtype"] == "bf16"
    assert plan.extra["dispatcher"] == "deepep"
    assert all(len(s.layers) >= 2 for s in plan.stages)  # one layer per interleaved chunk
    rows = list(csv.DictReader((tmp_path / "candidates.csv").open()))
    assert rows and all(
        (r["vp"], r["etp"], r["sharding"], r["a2a_overlap"], r["dispatcher"])
        == ("2", "2", "fsdp", "1", "deepep")
        and r["recompute_modules"] == "layernorm moe_act"
        for r in rows
    )


@pytest.mark.parametrize(
    ("target", "varied", "never"),
    [
        # no DeepEP on the CPU emulation's fabric; Megatron runs no HALO
        ("megatron", {"sharding": {"zero", "fsdp"}, "a2a_overlap": {"0", "1"},
                      "dispatcher": {"flat"}}, {"dispatcher": {"halo", "deepep"}}),
        # plain HALO never moves fewer bytes than HALO-dedup: searched only when named
        ("piper", {"sharding": {"none", "fsdp"}, "a2a_overlap": {"0"},
                   "dispatcher": {"flat", "halo-dedup"}},
         {"sharding": {"zero"}, "a2a_overlap": {"1"}, "dispatcher": {"halo", "deepep"}}),
    ],
)  # fmt: skip
def test_the_search_varies_the_knobs_when_nothing_is_fixed(tmp_path, target, varied, never):
    """The search tries every value its target runs, and no other."""
    assert main([*TINY, "--target", target, "--out", str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "candidates.csv").open()))
    varied = {**varied, "vp": {"1", "2"}, "recompute": {"none", "full", "selective"}}
    for column, values in varied.items():
        assert {r[column] for r in rows} >= values, column
    for column, values in never.items():
        assert not {r[column] for r in rows} & values, column
    assert {r["status"] for r in rows} >= {"solved", "pruned"}
    assert all(r["reason"] for r in rows if r["status"] != "solved" or r["feasible"] == "0")


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--zero", "--fsdp"], "give one of them"),
        (["--recompute", "full", "--recompute-modules", "moe"], "needs --recompute selective"),
        (["--recompute-modules", "attention"], "--recompute-modules attention"),
        (["--pp", "1", "--vp", "2"], "vp > 1: pp > 1"),
        (["--mtp-layers", "-1"], "mtp_layers must be >= 0"),
        (["--dtype", "mxfp8"], "mxfp8"),
    ],
)
def test_bad_knob_flags_exit_2_with_one_line(tmp_path, capsys, flags, words):
    assert main([*TINY, "--target", "megatron", *flags, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and words in err, err
    assert not (tmp_path / "o").exists()


def test_ctrl_c_before_any_solution_exits_130_and_writes_nothing(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        return search_module.PlanResult(None, (), None, (), (), True, "", 64)

    monkeypatch.setattr(search_module, "make_plan", interrupted)
    assert main(["plan", "--out", str(tmp_path / "x")]) == 130
    assert "interrupted" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_deepseek_v3_on_1024_gpus_plans(tmp_path):
    out = tmp_path / "ds"
    args = ["plan", "--model", "deepseek-v3", "--cluster", "frontier", "--gpus", "1024"]
    assert main([*args, "--out", str(out)]) == 0
    plan = load_plan(out / "plan.json")
    par = plan.parallel
    assert par.pp * par.dp * par.tp * par.cp == 1024
    assert 256 % par.ep == 0 and (par.tp * par.cp * par.dp) % (par.etp * par.ep) == 0
    assert all(len(s.layers) >= par.vp for s in plan.stages)
    assert [layer for s in plan.stages for layer in s.layers] == list(range(61))
    assert plan.solver.status == "OPTIMAL"
    assert max(plan.predicted.memory_gib_per_stage) <= 64.0


def test_pairings_helper_counts():
    assert sum(1 for _ in _pairings(list(range(6)))) == 15  # 5 x 3 x 1
    assert list(itertools.islice(_pairings([0, 1]), 5)) == [[(0, 1)]]


def test_allocation_file_places_ranks_on_its_nodes(tmp_path):
    alloc = tmp_path / "alloc.csv"
    rows = ["hostname,switch,group"] + [f"n{i:02d},{i % 3},0" for i in range(5)]
    alloc.write_text("\n".join(rows) + "\n")
    args = ["plan", "--gpus", "32", "--global-batch", "256", "--allocation", str(alloc)]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    plan = load_plan(tmp_path / "out" / "plan.json")
    assert {r.node for r in plan.ranks} <= set(range(5))
    per_node = [sum(r.node == n for r in plan.ranks) for n in range(5)]
    assert max(per_node) <= 8 and sum(per_node) == 32
    assert "straddle" in plan.extra["rank_note"]


def test_trace_for_a_dense_layer_is_a_one_line_error(tmp_path, capsys):
    trace = tmp_path / "trace.csv"
    trace.write_text("interval,layer,expert,tokens\n" + "".join(f"0,0,{e},5\n" for e in range(64)))
    args = ["plan", "--model", "deepseek-v2-lite", "--gpus", "8", "--trace", str(trace)]
    assert main([*args, "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "layer 0 is not an MoE layer" in err


def test_a_fixed_dispatcher_is_priced_and_recorded(tmp_path):
    small = [
        "plan",
        "--model",
        "deepseek-v2-lite",
        "--gpus",
        "32",
        "--ep",
        "32",
        "--target",
        "piper",
    ]
    assert main([*small, "--dispatcher", "flat", "--out", str(tmp_path / "flat")]) == 0
    assert main([*small, "--dispatcher", "halo", "--out", str(tmp_path / "halo")]) == 0
    flat, halo = (
        load_plan(tmp_path / "flat" / "plan.json"),
        load_plan(tmp_path / "halo" / "plan.json"),
    )
    assert (flat.extra["dispatcher"], halo.extra["dispatcher"]) == ("flat", "halo")
    assert flat.inputs_sha256 != halo.inputs_sha256
    assert flat.predicted.step_time_s != halo.predicted.step_time_s  # EP 32 spans nodes


def test_inputs_sha256_follows_content_not_paths(tmp_path):
    from dataclasses import replace

    from planner.inputs.clusters import load_cluster
    from planner.inputs.models import load_model, read_config_file
    from planner.inputs.paths import MODELS_DIR
    from planner.search.assemble import inputs_sha256
    from planner.search.model_evaluator import ModelEvaluator
    from planner.specs import TrainingSpec

    config = tmp_path / "m" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(read_config_file(MODELS_DIR / "mixtral-8x7b.json")))
    backend, training = ModelEvaluator(), TrainingSpec()
    cluster = backend.describe_cluster(load_cluster("frontier"))
    sizes = {"gpus": 64}

    def digest(model: str, **kw) -> str:
        doc = backend.describe_model(load_model(model))
        return inputs_sha256(doc, kw.get("cluster", cluster), kw.get("training", training), sizes)

    assert digest("mixtral-8x7b") == digest(str(config))
    assert digest("mixtral-8x7b") != digest(
        "mixtral-8x7b", training=replace(training, seq_len=2048)
    )
    assert digest("mixtral-8x7b") != digest("mixtral-8x22b")
    other = {**cluster, "gpus_per_node": 4}
    assert digest("mixtral-8x7b") != digest("mixtral-8x7b", cluster=other)


def test_allocation_smaller_than_gpus_fails_before_searching(tmp_path, capsys):
    alloc = tmp_path / "alloc.csv"
    alloc.write_text("hostname,switch\nn0,0\nn1,0\n")
    assert main(["plan", "--allocation", str(alloc), "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "2 nodes hold 16 GPUs but --gpus is 64" in err
