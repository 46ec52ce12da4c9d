"""RUNS.csv rows as layouts: the published calibration file, the split, every fault as one
line naming the file, the line and the column; a piper run (plan + metrics) as a run."""

from __future__ import annotations

import json

import pytest

from planner.calibrate.runs import (
    accounted_split,
    hardware_matches,
    load_runs,
    parse_runs,
    run_of_metrics,
)
from planner.inputs.clusters import load_cluster
from planner.inputs.paths import PROFILES_DIR
from planner.specs import GIB, SpecError
from tests.planner.calibrate.test_compare import RANKS, metrics_lines, tiny_plan

PUBLISHED = PROFILES_DIR / "runs" / "published_runs.csv"
HEAD = (
    "id,model,hardware,gpus,precision,seq,gbs,mbs,tp,pp,vp,cp,ep,etp,recompute,"
    "measured_tokens_per_s_per_gpu,measured_tflops_per_gpu,measured_peak_gib,note\n"
)
GOOD = '7,qwen3-30b-a3b,H100,16,BF16,4096,256,1,1,2,1,1,8,1,"selective(norm,act)",900,,61.5,x\n'


def test_the_published_file_reads_as_its_layouts():
    runs = {r.label: r for r in load_runs(PUBLISHED)}
    assert len(runs) == 18
    r4 = runs["id 4"]  # Qwen3-235B tp2 pp8 vp4 ep32, DeepEP and the all-to-all overlap
    p, t = r4.parallel, r4.training
    assert (p.tp, p.pp, p.vp, p.cp, p.ep, p.etp, p.dp, p.edp) == (2, 8, 4, 1, 32, 1, 16, 1)
    assert p.num_microbatches == 2048 // 16 and p.selective_modules == ("layernorm", "moe_act")
    assert r4.dispatcher == "deepep" and t.a2a_overlap and t.zero and not t.fsdp
    assert r4.metric == "tokens/s/GPU" and r4.measured == 1861.8 and r4.cuda_graphs == "none"
    r5 = runs["id 5"]
    assert r5.training.fsdp and r5.parallel.recompute == "full" and r5.parallel.edp == 32
    r9 = runs["id 9"]
    assert r9.parallel.cp == 2 and r9.metric == "TFLOPS/GPU" and r9.measured == 335
    assert runs["id 23"].training.cuda_graphs == "partial"
    r36 = runs["id 36"]
    assert r36.training.cuda_graphs == "partial" and r36.training.dtype == "mxfp8"
    assert runs["id 36"].parallel.selective_modules == ("mlp",)  # the 26.04.01 config's
    assert runs["id 35"].training.cuda_graphs == "none" and runs["id 35"].dispatcher == "deepep"
    # the recipes' settings columns override the notes: DeepSeek-V3 on H100 runs DeepEP
    assert runs["id 33"].dispatcher == "deepep" and runs["id 33"].training.a2a_overlap
    assert runs["id 34"].dispatcher == "flat" and runs["id 34"].training.a2a_overlap


def test_settings_columns_are_checked():
    settings = "measured_peak_gib,dispatcher,a2a_overlap,cuda_graphs,grad_overlap,note"
    head = HEAD.replace("measured_peak_gib,note", settings)
    row = GOOD.replace(",61.5,x", ",61.5,deepep,1,partial,0,x")
    (run,) = parse_runs(head + row)
    assert run.dispatcher == "deepep" and run.training.a2a_overlap
    assert run.training.cuda_graphs == "partial" and not run.training.grad_overlap
    (default,) = parse_runs(head + GOOD.replace(",61.5,x", ",61.5,deepep,1,partial,,x"))
    assert default.training.grad_overlap  # empty: overlapped, as Megatron's recipes run
    for bad, column in ((",61.5,nccl,1,partial,1,x", "dispatcher"),
                        (",61.5,deepep,maybe,none,1,x", "a2a_overlap"),
                        (",61.5,deepep,0,most,1,x", "cuda_graphs"),
                        (",61.5,deepep,0,none,often,x", "grad_overlap")):  # fmt: skip
        with pytest.raises(SpecError, match=column):
            parse_runs(head + GOOD.replace(",61.5,x", bad))


def test_accounted_split_counts_embedding_and_loss():
    # 94 layers + 2 units over 8 ranks: 12 each, the first and last rank one layer fewer
    assert [len(s) for s in accounted_split(94, 8)] == [11, 12, 12, 12, 12, 12, 12, 11]
    assert [len(s) for s in accounted_split(61, 4)] == [15, 16, 16, 14]
    assert accounted_split(5, 1) == ((0, 1, 2, 3, 4),)


def test_a_row_with_peak_memory_and_the_optional_columns():
    (run,) = parse_runs(HEAD + GOOD, "mine.csv")
    assert run.label == "id 7" and run.measured_peak_gib == 61.5
    assert (run.parallel.dp, run.parallel.num_microbatches) == (8, 32)
    assert run.where == "mine.csv line 2 (id 7)"


def test_hardware_names_the_device_or_the_cluster():
    assert hardware_matches("H100", load_cluster("h100"))
    assert hardware_matches("gb200", load_cluster("gb200-nvl72"))
    assert not hardware_matches("H100", load_cluster("gb200-nvl72"))
    assert not hardware_matches("", load_cluster("h100"))


BAD_ROWS = [
    (
        "tp",
        GOOD.replace(",1,1,2,1,1,8,", ",1,x,2,1,1,8,"),
        "column 'tp' must be a positive integer",
    ),
    ("gpus", GOOD.replace("H100,16,", "H100,15,"), "column 'gpus'=15 is not a multiple"),
    ("gbs", GOOD.replace(",256,1,", ",250,1,"), "column 'gbs'=250"),
    ("precision", GOOD.replace("BF16", "int4"), "column 'precision'"),
    ("model", GOOD.replace("qwen3-30b-a3b", "qwen9-moe"), "column 'model'"),
    ("recompute", GOOD.replace("norm,act", "norm,attn"), "column 'recompute'"),
    ("measured", GOOD.replace(",900,,", ",,,"), "are both empty"),
    ("negative", GOOD.replace(",900,", ",-3,"), "must be a positive number"),
    ("peak", GOOD.replace(",61.5,", ",lots,"), "column 'measured_peak_gib'"),
    ("ep", GOOD.replace(",1,8,1,", ",1,5,1,"), "ep=5"),
    ("commas", GOOD.replace('"selective(norm,act)"', "selective(norm,act)"), "more fields"),
]


@pytest.mark.parametrize("name,row,message", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_a_bad_row_is_one_line_naming_the_file_line_and_column(name, row, message):
    with pytest.raises(SpecError) as err:
        parse_runs(HEAD + GOOD + row, "mine.csv")
    text = str(err.value)
    assert text.startswith("mine.csv line 3 (id 7): ") and message in text, text
    assert "\n" not in text


@pytest.mark.parametrize(
    "text,message",
    [
        ("", "empty"),
        (HEAD, "a header but no runs"),
        (HEAD.replace("etp,", ""), "no column 'etp'"),
        (
            HEAD.replace("measured_tokens_per_s_per_gpu,measured_tflops_per_gpu,", ""),
            "no measured column",
        ),
    ],  # fmt: skip
)
def test_a_bad_file_is_one_line(text, message):
    with pytest.raises(SpecError, match=message):
        parse_runs(text, "mine.csv")


def test_missing_and_binary_files(tmp_path):
    with pytest.raises(SpecError, match="no such runs file"):
        load_runs(tmp_path / "absent.csv")
    (tmp_path / "b.csv").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(SpecError, match="not a text file"):
        load_runs(tmp_path / "b.csv")


def test_a_piper_run_becomes_a_run(tmp_path):
    plan = tmp_path / "plan.json"
    plan.write_text(tiny_plan().to_json())
    steps = metrics_lines([(9.0, 0.2, 0.2, RANKS), (2.0, 0.2, 0.2, RANKS), (4.0, 0.2, 0.2, RANKS)])
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps(s) + "\n" for s in steps))
    run = run_of_metrics(plan, metrics, skip_steps=1)
    # median tokens/s of steps 1 and 2 (256 / 2 and 256 / 4) over pp * dp = 4 GPUs
    assert run.measured == pytest.approx((128 + 64) / 2 / 4)
    assert run.metric == "tokens/s/GPU" and run.parallel.world == 4
    assert run.stage_layers == ((0, 1), (2, 3))
    assert run.measured_peak_gib == pytest.approx(max(r[1] for r in RANKS) / GIB)


def test_state_dtype_columns_price_pure_bf16_training():
    settings = "measured_peak_gib,optimizer_dtype,grad_dtype,master_weights,note"
    head = HEAD.replace("measured_peak_gib,note", settings)
    (pure,) = parse_runs(head + GOOD.replace(",61.5,x", ",61.5,bf16,bf16,0,x"))
    t = pure.training
    assert (t.optimizer_dtype, t.grad_dtype, t.master_weights) == ("bf16", "bf16", False)
    (plain,) = parse_runs(head + GOOD.replace(",61.5,x", ",61.5,,,,x"))
    assert (plain.training.optimizer_dtype, plain.training.grad_dtype) == ("fp32", None)
    assert plain.training.master_weights
    # without master weights the optimizer holds the bf16 moments only: 4 B per parameter
    # against Megatron's 12 (fp32 master + fp32 moments); gradients 2 B against 4
    from planner.resources.memory import grad_bytes_per_param, optimizer_bytes_per_param

    assert optimizer_bytes_per_param(t) == 4 and grad_bytes_per_param(t) == 2
    assert optimizer_bytes_per_param(plain.training) == 12
    assert grad_bytes_per_param(plain.training) == 4
    for bad, column in ((",61.5,fp16,bf16,0,x", "optimizer_dtype"),
                        (",61.5,bf16,fp8,0,x", "grad_dtype"),
                        (",61.5,bf16,bf16,maybe,x", "master_weights"),
                        (",61.5,fp32,bf16,0,x", "master_weights")):  # fmt: skip
        with pytest.raises(SpecError, match=column):
            parse_runs(head + GOOD.replace(",61.5,x", bad))


def test_fsdp_reduce_dtype_column_prices_fsdp2s_fp32_reduce_scatter():
    from planner.resources.memory import fsdp_reduce_bytes_per_param

    head = HEAD.replace("measured_peak_gib,note", "measured_peak_gib,fsdp_reduce_dtype,note")
    (fp32,) = parse_runs(head + GOOD.replace(",61.5,x", ",61.5,fp32,x"))
    (plain,) = parse_runs(head + GOOD.replace(",61.5,x", ",61.5,,x"))
    assert (fp32.training.fsdp_reduce_dtype, plain.training.fsdp_reduce_dtype) == ("fp32", None)
    assert fsdp_reduce_bytes_per_param(fp32.training) == 4
    assert fsdp_reduce_bytes_per_param(plain.training) == 2  # Megatron-FSDP: bf16 gradients
    with pytest.raises(SpecError, match="fsdp_reduce_dtype"):
        parse_runs(head + GOOD.replace(",61.5,x", ",61.5,fp16,x"))
