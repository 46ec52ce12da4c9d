"""runtime/bench/profile.py micro-benchmarks and `piper profile` end to end on CPU (gloo)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from planner.cli import main
from planner.inputs.clusters import load_cluster
from runtime.bench import profile as prof

TINY = prof.ProfileSizes(
    gemm_k=32,
    gemm_n=48,
    gemm_tokens=(4, 16),
    experts=3,
    expert_tokens=(2, 8),
    attn_heads=2,
    attn_head_dim=8,
    attn_seq=(16, 32),
    membw_bytes=(1024,),
    p2p_bytes=(64, 4096),
    a2a_bytes=(256, 8192),
    iters=1,
)
CPU = torch.device("cpu")


@pytest.fixture
def half_second(monkeypatch):
    """Every timed op takes 0.5 s, so throughput is FLOPs (or bytes) / 0.5."""
    calls = []

    def fake(fn, device, iters, warmup=1):
        calls.append(fn())
        return 0.5

    monkeypatch.setattr(prof, "time_op", fake)
    return calls


def test_flop_and_byte_conventions(half_second):
    assert prof.bench_gemm(TINY, torch.float32, CPU) == pytest.approx(
        [2 * m * 32 * 48 / 0.5 / 1e12 for m in (4, 16)]
    )
    assert half_second[0].shape == (4, 48)
    grouped, looped = prof.bench_expert_gemm(TINY, torch.float32, CPU)
    want = [2 * 3 * m * 32 * 48 / 0.5 / 1e12 for m in (2, 8)]
    assert grouped == pytest.approx(want) and looped == pytest.approx(want)
    assert prof.bench_attention(TINY, torch.float32, CPU) == pytest.approx(
        [2 * 2 * s * s * 8 / 0.5 / 1e12 for s in (16, 32)]
    )
    assert prof.bench_membw(TINY, CPU) == pytest.approx([2 * 1024 / 0.5 / 1e9])


def test_grouped_and_looped_compute_the_same_product():
    torch.manual_seed(0)
    x, w = torch.randn(3, 5, 4), torch.randn(3, 4, 6)
    looped = torch.stack([x[i] @ w[i] for i in range(3)])
    assert torch.allclose(torch.bmm(x, w), looped, atol=1e-6)


def test_real_timings_are_positive_and_finite():
    values = prof.bench_gemm(TINY, torch.float32, CPU) + prof.bench_attention(
        TINY, torch.float32, CPU
    )
    assert all(0 < v < 1e4 for v in values)


def _comm_body(rank, world, sizes):
    nodes = prof.node_of_ranks(2)
    rows = prof._comm(sizes, nodes, CPU)
    return nodes, [(r["kind"], r["ranks"], r["x"], r["y"]) for r in rows]


def test_comm_rows_per_level(run_distributed):
    results = run_distributed(_comm_body, 4, TINY, timeout_s=60)
    nodes, rows = results[0]
    assert nodes == [0, 0, 1, 1]
    kinds = [(k, ranks) for k, ranks, _, _ in rows]
    assert kinds == [("p2p", [0, 1]), ("p2p", [0, 2]), ("a2a", [0, 1]), ("a2a", [0, 1, 2, 3])]
    for _, _, x, y in rows:
        assert len(x) == len(y) == 2 and all(v > 0 for v in y)


def test_sizes_scale_with_device():
    cpu = prof.sizes_for(quick=False, on_gpu=False, hidden=None, ffn=None)
    gpu = prof.sizes_for(quick=False, on_gpu=True, hidden=4096, ffn=1024)
    assert max(gpu.gemm_tokens) > max(cpu.gemm_tokens)
    assert (gpu.gemm_k, gpu.gemm_n) == (4096, 1024)
    assert isinstance(prof.parse_args(["--raw-out", "x"]), argparse.Namespace)


@pytest.mark.slow
def test_profile_plan_run_calibrate_loop_on_cpu(tmp_path, capsys):
    """The issue's loop on CPU: a quick 2-rank gloo profile (2 emulated nodes) -> a cluster
    YAML the planner loads and whose measured tables the resource model uses -> piper plan
    with it -> a 3-step piper run -> piper calibrate against the run's metrics.jsonl."""
    prof_yaml = tmp_path / "cpu-measured.yaml"
    args = ["profile", "--nproc", "2", "--ranks-per-node", "1", "--quick", "--out", str(prof_yaml)]
    assert main(args) == 0
    cluster = load_cluster(str(prof_yaml))
    names = {t.name for t in cluster.tables}
    assert {"gemm_fp32", "gemm_grouped_fp32", "attention_fp32", "a2a_system", "p2p_system"} <= names
    assert "hostname:" in prof_yaml.read_text()
    from planner.inputs.models import load_model
    from planner.parallel import ParallelConfig
    from planner.resources.cost import estimate
    from planner.specs import TrainingSpec

    est = estimate(load_model("tiny-moe"), cluster, TrainingSpec(seq_len=64, global_batch=4,
                   dtype="fp32"), ParallelConfig(pp=1, dp=2, ep=2, num_microbatches=2))  # fmt: skip
    assert {"gemm_fp32", "attention_fp32"} <= set(est.used_measured_tables)

    plan_dir = tmp_path / "plan"
    assert main(["plan", "--model", "tiny-moe", "--cluster", str(prof_yaml), "--gpus", "2",
                 "--pp", "1", "--ep", "2", "--seq-len", "64", "--global-batch", "4",
                 "--out", str(plan_dir)]) == 0  # fmt: skip
    plan = json.loads((plan_dir / "plan.json").read_text())
    assert plan["cluster"]["name"] == "cpu-measured"
    assert plan["parallel"]["ep"] == 2

    run_dir = tmp_path / "run"
    assert main(["run", str(plan_dir / "plan.json"), "--steps", "3", "--out", str(run_dir)]) == 0
    capsys.readouterr()
    cal_dir = tmp_path / "cal"
    fit = tmp_path / "fitted.yaml"
    assert main(["calibrate", str(plan_dir / "plan.json"), str(run_dir / "metrics.jsonl"),
                 "--out", str(cal_dir), "--write-profile", str(fit)]) == 0  # fmt: skip
    table = capsys.readouterr().out
    assert "| step_time_s | all |" in table and "| a2a_s | 0 |" in table
    rows = (cal_dir / "calibration.csv").read_text().splitlines()
    measured = {r.split(",")[0] + r.split(",")[1]: float(r.split(",")[4]) for r in rows[1:]}
    assert measured["step_time_sall"] > 0 and measured["memory_gib0"] > 0
    assert load_cluster(str(fit)).name == "cpu-measured-calibrated"
    # the run's own metrics feed the fit (a RUNS.csv with only its header: no other runs)
    header = tmp_path / "runs.csv"
    header.write_text("model,hardware,gpus,precision,seq,gbs,mbs,tp,pp,vp,cp,ep,etp,recompute,"
                      "measured_tokens_per_s_per_gpu\n")  # fmt: skip
    fitted = tmp_path / "run-fitted.yaml"
    pair = f"{plan_dir / 'plan.json'}:{run_dir / 'metrics.jsonl'}"
    assert main(["calibrate", "--fit", str(header), "--cluster", str(prof_yaml), "--out",
                 str(fitted), "--params", "gemm_efficiency", "--run", pair]) == 0  # fmt: skip
    fitted_cluster = load_cluster(str(fitted))
    assert fitted_cluster.name == "cpu-measured-fitted"
    assert dict(fitted_cluster.calibration)["runs"] == "1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_benchmarks_bf16():
    """On a GPU: bf16 GEMM throughput grows with M and is a sane fraction of any GPU's peak."""
    dev = torch.device("cuda", 0)
    sz = prof.sizes_for(quick=False, on_gpu=True, hidden=4096, ffn=4096)
    sz = prof.ProfileSizes(**{**sz.__dict__, "gemm_tokens": (64, 8192), "iters": 5})
    small, large = prof.bench_gemm(sz, torch.bfloat16, dev)
    assert 1.0 < large < 5000.0 and large > 2 * small
    assert 50.0 < prof.bench_membw(sz, dev)[-1] < 20000.0


def test_cuda_request_without_cuda_fails_cleanly(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(SystemExit, match="no CUDA device"):
        prof.main(["--raw-out", str(tmp_path / "r.json"), "--device", "cuda"])
    import planner.cli.profile as cli_profile

    def failing(args, raw_path):
        raise cli_profile.ProfileFailed("runtime.bench.profile: --device cuda but no CUDA device")

    monkeypatch.setattr(cli_profile, "_launch", failing)
    out = tmp_path / "x.yaml"
    assert main(["profile", "--nproc", "1", "--device", "cuda", "--out", str(out)]) == 1
    assert "no CUDA device" in capsys.readouterr().err and not out.exists()
