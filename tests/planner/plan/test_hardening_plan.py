"""An untrusted plan.json is refused in one line naming the file and the field: non-finite
predicted intervals, local ranks out of range or shared on a node, an empty ranks table for
`piper place`, control characters in values from a fixed set, a broken cluster profile; the
CLI exits 2 with one stderr line, no traceback and nothing written."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from planner.inputs.clusters import cluster_to_dict, load_cluster
from planner.plan import plan_from_dict
from planner.plan.check import check_plan_dict, one_line
from planner.plan.priced import check_priced
from planner.specs import SpecError
from tests.hardening_cli import run_piper
from tests.planner.outputs.export_plans import make_plan

INTERVALS = {
    "level": 0.8, "source": "fitted on 3 runs", "time_log_sd": 0.1, "param_log_sd": 0.0,
    "memory_log_sd": 0.2, "tokens_per_s": [9e4, 1.1e5], "step_time_s": [0.9, 1.1],
    "tflops_per_gpu": [90.0, 110.0], "mfu": [0.4, 0.6],
    "memory_gib_per_stage": [[0.9, 1.1]] * 4,
}  # fmt: skip


def plan_dict(**changes: Any) -> dict[str, Any]:
    """make_plan's plan.json (8 ranks, 2 per node on 4 nodes) with predicted intervals."""
    d = make_plan().to_dict()
    d["predicted"]["intervals"] = json.loads(json.dumps(INTERVALS))
    return d | changes


def full_cluster(**device: Any) -> dict[str, Any]:
    """plan.json's cluster section as `piper plan` writes it: the whole cpu-gloo profile."""
    profile = cluster_to_dict(load_cluster("cpu-gloo"))
    profile["device"] |= device
    return {**profile, "gpus_per_node": 2, "nodes_used": 4}


def write(folder: Path, d: dict[str, Any]) -> str:
    path = folder / "plan.json"
    path.write_text(json.dumps(d))  # NaN and Infinity as Python's json writes them
    return str(path)


def refused(argv: list[str], out: Path, *words: str) -> str:
    """`piper ARGV` exits 2 with one stderr line holding `words`, writing nothing to `out`."""
    result = run_piper(argv)
    assert result.code == 2, result.stderr
    assert len(result.stderr.splitlines()) == 1, result.stderr
    assert "Traceback" not in result.stderr
    for word in words:
        assert word in result.stderr, result.stderr
    assert not out.exists()
    return result.stderr


def one_line_refusal(call, prefix: str, *words: str) -> str:
    """The SpecError `call()` raises: one line, starting with `prefix`, holding every word."""
    with pytest.raises(SpecError) as err:
        call()
    message = str(err.value)
    assert "\n" not in message and message.startswith(prefix)
    for word in words:
        assert word in message, message
    return message


def check_refuses(d: dict[str, Any], *words: str) -> str:
    return one_line_refusal(lambda: check_plan_dict(d, "mine.json"), "mine.json: ", *words)


def test_the_plans_below_start_valid():
    check_plan_dict(plan_dict())
    plan = plan_from_dict(plan_dict(cluster=full_cluster()))
    assert plan.cluster_spec().gpus_per_node == 2
    assert plan.predicted.intervals is not None


@pytest.mark.parametrize(
    ("path", "value", "field"),
    [
        (("step_time_s",), [0.05, float("inf")], "predicted.intervals.step_time_s[1]"),
        (("mfu",), [float("-inf"), 0.5], "predicted.intervals.mfu[0]"),
        (("memory_gib_per_stage",), [[0.9, float("nan")]] * 4,
         "predicted.intervals.memory_gib_per_stage[0][1]"),
        (("time_log_sd",), float("inf"), "predicted.intervals.time_log_sd"),
        (("source",), "fitted\non 3 runs", "predicted.intervals.source"),
    ],
)  # fmt: skip
def test_predicted_intervals_are_finite(path, value, field):
    d = plan_dict()
    d["predicted"]["intervals"][path[0]] = value
    check_refuses(d, f"field '{field}'")


def test_infinite_interval_through_export(tmp_path):
    d = plan_dict()
    d["predicted"]["intervals"]["step_time_s"] = [0.05, float("inf")]
    path, out = write(tmp_path, d), tmp_path / "out"
    refused(["export", path, "--to", "slurm", "--out", str(out)], out, path,
            "'predicted.intervals.step_time_s[1]'", "got inf")  # fmt: skip


def test_local_ranks_within_the_node_and_distinct(tmp_path):
    d = plan_dict()
    for r in d["ranks"]:
        r["local_rank"] += 1000
    check_refuses(d, "field 'ranks[0].local_rank' is 1001", "< 2 (cluster.gpus_per_node)")
    d = plan_dict()
    for r in d["ranks"]:
        r["local_rank"] = 0
    path, out = write(tmp_path, d), tmp_path / "out"
    refused(["export", path, "--to", "slurm", "--out", str(out)], out, path,
            "'ranks[1].local_rank' is 0 on node 2, as ranks[0]'s")  # fmt: skip


def test_node_ids_may_skip_nodes_of_an_allocation():
    """Node ids index the cluster's (or the allocation's) nodes: a plan placed on nodes 1, 2
    and 9 of an allocation is valid."""
    d = plan_dict()
    d["ranks"][2]["node"] = d["ranks"][3]["node"] = 9  # node 0's two ranks moved to node 9
    check_plan_dict(d, "plan.json")


def test_a_plan_without_gpus_per_node_still_needs_distinct_local_ranks():
    d = plan_dict()
    d["cluster"].pop("gpus_per_node")
    for r in d["ranks"]:
        r["local_rank"] += 5
    check_plan_dict(d)  # no bound without the cluster's devices per node
    d["ranks"][1]["local_rank"] = d["ranks"][0]["local_rank"]  # both on node 2
    check_refuses(d, "ranks[1].local_rank")


def test_place_refuses_an_empty_ranks_table(tmp_path):
    path, out = write(tmp_path, plan_dict(ranks=[])), tmp_path / "out"
    check_plan_dict(json.loads(Path(path).read_text()))  # export and calibrate read such plans
    topology = tmp_path / "topology.conf"
    topology.write_text("SwitchName=s0 Nodes=n[1-4]\n")
    argv = ["place", path, "--nodelist", "n[1-4]", "--topology", str(topology), "--out"]
    refused([*argv, str(out)], out, path, "field 'ranks' is empty")


def test_place_refuses_local_ranks_beyond_the_presets_nodes(tmp_path):
    d = plan_dict()
    d["cluster"].pop("gpus_per_node")  # the preset cpu-gloo has 2 devices per node
    for r in d["ranks"]:
        r["local_rank"] += 2
    path, out = write(tmp_path, d), tmp_path / "out"
    topology = tmp_path / "topology.conf"
    topology.write_text("SwitchName=s0 Nodes=n[1-4]\n")
    argv = ["place", path, "--nodelist", "n[1-4]", "--topology", str(topology), "--out"]
    refused([*argv, str(out)], out, path, "local rank 3", "2 devices per node")


@pytest.mark.parametrize(
    ("section", "key", "field"),
    [
        ("extra", "dispatcher", "extra.dispatcher"),
        ("extra", "target", "extra.target"),
        ("training", "cuda_graphs", "training.cuda_graphs"),
        ("training", "fsdp_reduce_dtype", "training.fsdp_reduce_dtype"),
        ("training", "grad_dtype", "training.grad_dtype"),
        ("training", "activation_offload_modules", "training.activation_offload_modules"),
    ],
)
def test_a_value_from_a_fixed_set_is_checked_and_quoted_on_one_line(section, key, field):
    d = plan_dict()
    d[section][key] = "x\nline2"
    check_refuses(d, f"field '{field}'", r"'x\nline2'", "not one of")


def test_control_characters_in_an_export_error(tmp_path):
    d = plan_dict()
    d["training"]["activation_offload_modules"] = "attn_norm,x\r\ny"
    path, out = write(tmp_path, d), tmp_path / "out"
    refused(["export", path, "--to", "megatron", "--out", str(out)], out, path,
            "'training.activation_offload_modules'", r"'x\r\ny'")  # fmt: skip
    d = plan_dict(schema_version="1\n2")
    refused(["export", write(tmp_path, d), "--to", "slurm", "--out", str(out)], out,
            r"schema_version '1\n2'")  # fmt: skip


def test_check_priced_keeps_one_line_for_a_plan_built_in_code():
    plan = replace(make_plan(), extra={"dispatcher": "a\nb", "target": "c\td"})
    with pytest.raises(SpecError, match=r"a\\nb dispatcher.*--target c\\td") as err:
        check_priced(plan, "piper")
    assert "\n" not in str(err.value)
    assert one_line("plain text") == "plain text"


def test_a_broken_cluster_profile_is_refused_at_load(tmp_path):
    path = write(tmp_path, plan_dict(cluster=full_cluster(memory_gib="abc")))
    metrics = tmp_path / "metrics.jsonl"
    step = {
        "step_time_s": 1.0,
        "dispatch_s": 0.1,
        "combine_s": 0.1,
        "peak_memory_bytes": 1e9,
        "tokens_per_s": 100.0,
        "bytes_intra_node": 0,
        "bytes_inter_node": 0,
        "loss": 1.0,
    }
    metrics.write_text("".join(json.dumps({"step": s, **step}) + "\n" for s in range(3)))
    out = tmp_path / "cal"
    refused(["calibrate", path, str(metrics), "--out", str(out)], out, path, "device.memory_gib")
    refused(["export", path, "--to", "slurm", "--out", str(out)], out, "device.memory_gib")


def test_a_key_given_twice_in_plan_json_is_refused(tmp_path, capsys):
    """json keeps the last of two equal keys silently: `"name": "tiny-moe", "name": "other"`
    would have named the Slurm job after the second."""
    from planner.cli import main

    text = json.dumps(plan_dict(), indent=1)
    assert text.count('"schema_version"') == 1
    text = text.replace('"schema_version"', '"schema_version": 0, "schema_version"', 1)
    path = tmp_path / "plan.json"
    path.write_text(text)
    assert main(["export", str(path), "--to", "slurm"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("key 'schema_version' is given twice in one object; keep one (or "
                        "regenerate it with 'piper plan --out DIR')")  # fmt: skip
    assert len(err.splitlines()) == 1
