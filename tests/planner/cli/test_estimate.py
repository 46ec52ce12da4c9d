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
from planner.targets import TARGETS, with_conventions

ARGS = ["estimate", "--model", "mixtral-8x7b", "--cluster", "frontier", "--pp", "4", "--dp",
        "8", "--ep", "8", "--global-batch", "256"]  # fmt: skip


def test_json_matches_the_api(capsys):
    assert main([*ARGS, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    par = ParallelConfig(pp=4, dp=8, ep=8, micro_batch=1, num_microbatches=32)
    # frontier's default target is megatron: its conventions and its distributed optimizer
    tr = with_conventions(TrainingSpec(global_batch=256, zero=True), TARGETS["megatron"])
    est = estimate(load_model("mixtral-8x7b"), load_cluster("frontier"), tr, par)
    assert data["step_time_s"] == pytest.approx(est.step_time_s, rel=1e-8)
    assert data["target"] == "megatron" and data["training"]["zero"]
    assert data["memory_margin_gib"] == pytest.approx(0.04 * 59.6, rel=1e-6)
    assert data["parallel"]["num_microbatches"] == 32 and data["parallel"]["edp"] == 1
    assert len(data["stages"]) == 4 and data["stages"][0]["layers"] == list(range(8))
    assert set(data["comm_s"]) == {"a2a_node", "dp_node", "p2p_switch"}


def test_halo_dedup_says_its_share_of_halos_network_bytes(capsys):
    """DeepSeek-V2-Lite (64 experts, top-6) with ep 32 on 8-GPU H100 nodes: 4 nodes."""
    from planner.sim.routing import dedup_ratio

    args = ["estimate", "--model", "deepseek-v2-lite", "--cluster", "h100", "--pp", "1",
            "--dp", "32", "--ep", "32", "--global-batch", "64", "--target", "piper"]  # fmt: skip
    assert main([*args, "--dispatcher", "halo-dedup", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["dedup_ratio"] == pytest.approx(dedup_ratio(64, 4, 6), rel=1e-8)  # JSON rounds
    assert main([*args, "--dispatcher", "halo-dedup"]) == 0
    want = f"32 GPUs, halo-dedup all-to-all, {dedup_ratio(64, 4, 6):.2f}x HALO's network bytes"
    assert want in capsys.readouterr().out
    assert main([*args, "--dispatcher", "halo", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["dedup_ratio"] is None


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


KNOBS = ["estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--pp", "2", "--vp", "2",
         "--dp", "4", "--tp", "2", "--cp", "2", "--ep", "8", "--etp", "2", "--seq-len", "8192",
         "--global-batch", "64", "--recompute-modules", "layernorm,moe_act", "--zero",
         "--target", "megatron", "--dispatcher", "deepep", "--a2a-overlap", "--dtype", "fp8",
         "--optimizer-dtype", "bf16", "--mtp-layers", "0"]  # fmt: skip


def test_every_knob_reaches_the_resource_model(capsys):
    assert main([*KNOBS, "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    par = ParallelConfig(
        pp=2, dp=4, tp=2, ep=8, micro_batch=1, num_microbatches=16, recompute="selective",
        vp=2, cp=2, etp=2, recompute_modules=("layernorm", "moe_act"),
    )  # fmt: skip
    tr = TrainingSpec(
        seq_len=8192, global_batch=64, dtype="fp8", bytes_per_param=18, zero=True,
        recompute="selective", optimizer_dtype="bf16", mtp_layers=0, a2a_overlap=True,
        gate_in_activation=True, uniform_recompute=True,
    )  # fmt: skip
    est = estimate(load_model("qwen3-30b-a3b"), load_cluster("h100"), tr, par, dispatcher="deepep")
    assert data["step_time_s"] == pytest.approx(est.step_time_s, rel=1e-8)
    assert data["unpaired_s"] == pytest.approx(est.unpaired_s, rel=1e-8) and est.unpaired_s > 0
    p = data["parallel"]
    assert (p["vp"], p["cp"], p["etp"], p["edp"], p["world"]) == (2, 2, 2, 1, 32)
    assert p["recompute_modules"] == ["layernorm", "moe_act"]
    assert data["training"]["dtype"] == "fp8" and data["training"]["mtp_layers"] == 0
    st = data["stages"][0]
    assert {"quantize", "cp_node", "etp_node"} <= set(st["time_s"])
    assert "cp_kv_buffers" in st["memory_gib"] and "a2a_leaf" in st["hidden_s"]
    # 2 (pp - 1) + (vp - 1) pp + 1; the overlap's extra forward pairs layer by layer
    assert st["in_flight"] == 5 and "a2a_overlap_layer" in st["memory_gib"]


def test_table_shows_the_new_terms(capsys):
    assert main(KNOBS) == 0
    out = capsys.readouterr().out
    assert "pp=2 vp=2 dp=4 tp=2 cp=2 ep=8 etp=2 edp=1" in out
    assert (
        "recompute=selective(layernorm,moe_act)" in out and "deepep all-to-all, overlapped" in out
    )
    assert "fp8, distributed optimizer, Adam moments bf16, MTP layers 0" in out
    assert "communication hidden behind compute" in out and "unpaired warm-up" in out
    assert "cp_kv_buffe" in out and "quantize" in out  # names cut to 11 characters


@pytest.mark.parametrize(
    "extra,match",
    [
        (["--fsdp", "--zero"], "fsdp and zero"),
        (["--recompute", "full", "--recompute-modules", "moe"], "needs --recompute selective"),
        (["--recompute-modules", "attn"], "recompute module(s) attn unknown"),
        (["--vp", "2"], "vp=2 needs pp > 1"),
        (["--a2a-overlap"], "needs ep > 1"),
        (["--cp", "3", "--gpus", "12", "--dp", "4"], "seq_len=4096 must be a multiple of 6"),
        (["--dtype", "mxfp8", "--cluster", "h100"], "mxfp8"),
        (["--dispatcher", "halo", "--ep", "2", "--dp", "2"], "use --target piper"),
        (
            [
                "--dispatcher",
                "halo",
                "--a2a-overlap",
                "--ep",
                "2",
                "--dp",
                "2",
                "--target",
                "piper",
            ],
            "--a2a-overlap: Piper's runtime",
        ),  # fmt: skip
    ],
)
def test_bad_knob_combinations_are_one_line_exit_2(extra, match, capsys):
    base = ["estimate", "--model", "mixtral-8x7b", "--cluster", "frontier", "--pp", "1",
            "--dp", "8", "--global-batch", "64"]  # fmt: skip
    rc = main([*base, *extra])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and match in err, err


def test_a_reader_that_stops_early_is_not_an_error():
    """`piper estimate ... | head -1`: the reader closes the pipe before the output is written;
    the command stops quietly with exit 0, no 'Broken pipe' line."""
    import subprocess
    import sys

    entry = "import sys; from planner.cli import main; sys.exit(main())"
    cmd = [sys.executable, "-c", entry, "estimate", "--model", "tiny-moe", "--cluster",
           "cpu-gloo", "--dp", "2", "--ep", "2", "--target", "piper"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # before the child has imported anything: its first write fails
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 0, err
    assert "Broken pipe" not in err and "Traceback" not in err and "Exception ignored" not in err
