"""`piper estimate`: table, JSON, CSV files, determinism, one-line errors; every preset runs."""

from __future__ import annotations

import json

import pytest

from planner.cli import main
from planner.inputs.clusters import list_cluster_presets, load_cluster
from planner.inputs.models import list_model_presets, load_model
from planner.parallel import ParallelConfig
from planner.resources.cost import estimate
from planner.specs import TrainingSpec

ARGS = ["estimate", "--model", "mixtral-8x7b", "--cluster", "frontier", "--pp", "4", "--dp",
        "8", "--ep", "8", "--global-batch", "256"]  # fmt: skip


def test_json_matches_the_api(capsys):
    assert main([*ARGS, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    par = ParallelConfig(pp=4, dp=8, ep=8, micro_batch=1, num_microbatches=32)
    est = estimate(
        load_model("mixtral-8x7b"), load_cluster("frontier"), TrainingSpec(global_batch=256), par
    )
    assert data["step_time_s"] == pytest.approx(est.step_time_s, rel=1e-8)
    assert data["parallel"]["num_microbatches"] == 32 and data["parallel"]["edp"] == 1
    assert len(data["stages"]) == 4 and data["stages"][0]["layers"] == list(range(8))
    assert set(data["comm_s"]) == {"a2a_node", "dp_node", "p2p_switch"}


def test_table_and_files_are_deterministic(tmp_path, capsys):
    assert main([*ARGS, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    assert "TFLOPS per GPU" in out and "memory per rank (GiB)" in out
    assert main([*ARGS, "--out", str(tmp_path / "b")]) == 0
    for name in ("estimate.json", "memory.csv", "time.csv", "comm.csv"):
        a, b = (tmp_path / d / name for d in ("a", "b"))
        assert a.read_bytes() == b.read_bytes()
    mem = (tmp_path / "a" / "memory.csv").read_text().splitlines()
    assert mem[0] == "stage,component,gib" and "0,total," in "\n".join(mem)
    assert (tmp_path / "a" / "comm.csv").read_text().startswith("name,kind,level,seconds")


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--ep", "3"], "ep=3 must divide"),
        (["--gpus", "64"], "--gpus 64"),
        (["--global-batch", "100"], "not a multiple of dp*micro-batch"),
        (["--num-microbatches", "4"], "give only one of"),
    ],
)
def test_invalid_layout_is_one_line_exit_2(extra, match, capsys, tmp_path):
    rc = main([*ARGS, *extra, "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and match in err
    assert not (tmp_path / "x").exists()


def test_every_model_preset_on_every_cluster_gives_finite_numbers():
    tr = TrainingSpec(seq_len=2048, global_batch=64)
    for cname in list_cluster_presets():
        cluster = load_cluster(cname)
        g = cluster.gpus_per_node
        for mname in list_model_presets():
            model = load_model(mname)
            ep = g if model.num_experts and model.num_experts % g == 0 else 1
            pp = min(4, model.num_layers)
            par = ParallelConfig(pp=pp, dp=g, ep=ep, micro_batch=1, num_microbatches=8)
            est = estimate(model, cluster, tr, par)
            assert 0 < est.step_time_s < 1e6 and 0 < est.mfu < 1, (mname, cname)
            assert all(st.total_gib > 0 for st in est.stages)
