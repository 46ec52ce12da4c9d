"""runtime/bench/profile.py micro-benchmarks and `piper profile` end to end on CPU (gloo)."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from planner.cli import main
from planner.inputs.clusters import load_cluster
from runtime.bench import comm_bench
from runtime.bench import profile as prof

TINY = prof.ProfileSizes(
    gemm_k=32,
    gemm_n=48,
    gemm_tokens=(4, 16),
    experts=3,
    expert_tokens=(2, 8),
    expert_shapes=(prof.ExpertShape("a", 32, 48), prof.ExpertShape("b", 16, 24)),
    attn_heads=2,
    attn_head_dim=8,
    attn_head_dims=(4, 8),
    attn_seq=(16, 32),
    membw_bytes=(1024,),
    permute_tokens=(8, 32),
    permute_topk=2,
    permute_hidden=16,
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
    train, fwd = prof.bench_gemm(TINY, torch.float32, CPU)
    assert fwd == pytest.approx([2 * m * 32 * 48 / 0.5 / 1e12 for m in (4, 16)])
    assert train == pytest.approx([3 * 2 * m * 32 * 48 / 0.5 / 1e12 for m in (4, 16)])
    # training = forward y[M,N], data gradient dx[M,K], weight gradient dw[K,N]
    assert [t.shape for t in half_second[0]] == [(4, 48), (4, 32), (32, 48)]
    res = prof.bench_expert_gemm(TINY, torch.float32, CPU, TINY.expert_shapes[1])
    want = [2 * 3 * m * 16 * 24 / 0.5 / 1e12 for m in (2, 8)]
    assert res["grouped_fwd"] == pytest.approx(want)
    assert res["grouped"] == pytest.approx([3 * w for w in want])
    assert res["looped"] == pytest.approx([3 * w for w in want])
    train, fwd = prof.bench_attention(TINY, torch.float32, CPU, head_dim=4)
    assert fwd == pytest.approx([2 * 2 * s * s * 4 / 0.5 / 1e12 for s in (16, 32)])
    assert train == pytest.approx([3 * f for f in fwd])
    assert prof.bench_membw(TINY, CPU) == pytest.approx([2 * 1024 / 0.5 / 1e9])
    perm, unperm = prof.bench_permute(TINY, torch.float32, CPU)
    # the resource model's bytes: (1 + k) T d elements of 4 B
    want = [(1 + 2) * t * 16 * 4 / 0.5 / 1e9 for t in (8, 32)]
    assert perm == pytest.approx(want) and unperm == pytest.approx(want)


def test_permute_then_unpermute_sums_each_token_k_times():
    rows = prof.routed_rows(50, 3, CPU, experts=8)
    assert rows.shape == (150,)
    assert torch.bincount(rows, minlength=50).tolist() == [3] * 50
    x = torch.randn(50, 6)
    y = prof.permute(x, rows)
    assert torch.equal(y, x[rows])
    assert torch.allclose(prof.unpermute(y, rows, 50), 3 * x, atol=1e-5)
    # expert order: each token's k copies land in k different expert groups, so the first
    # rows (the first experts' tokens) are increasing token ids, not token 0's k copies
    assert rows[:3].tolist() != [0, 0, 0]


def test_expert_gemm_products_are_the_training_gemms():
    torch.manual_seed(0)
    x, w, dy = torch.randn(3, 5, 4), torch.randn(3, 4, 6), torch.randn(3, 5, 6)
    y, dx, dw = prof._train_matmuls(torch.bmm, x, w, dy)
    xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
    torch.bmm(xr, wr).backward(dy)
    assert torch.allclose(y, torch.stack([x[i] @ w[i] for i in range(3)]), atol=1e-6)
    assert torch.allclose(dx, xr.grad, atol=1e-5) and torch.allclose(dw, wr.grad, atol=1e-5)


def test_compute_block_has_every_shape_and_head_dim(monkeypatch):
    monkeypatch.setattr(prof, "median_over_ranks", lambda values: values)
    out = prof.measure_compute(TINY, torch.float32, CPU)
    assert [(s["model"], s["k"], s["n"]) for s in out["gemm_grouped_shapes"]] == [
        ("a", 32, 48),
        ("b", 16, 24),
    ]
    assert out["gemm_grouped"]["y"] == out["gemm_grouped_shapes"][0]["grouped"]
    assert (out["gemm_grouped"]["k"], out["gemm_grouped"]["n"]) == (32, 48)
    assert [h["head_dim"] for h in out["attention_head_dims"]] == [8, 4]
    assert out["attention"]["head_dim"] == 8
    assert out["permute"]["x"] == [8, 32] and out["permute"]["topk"] == 2
    values = [v for s in out["gemm_grouped_shapes"] for v in s["grouped"] + s["looped"]]
    values += out["permute"]["y"] + out["unpermute"]["y"] + out["attention"]["y"]
    assert all(0 < v < 1e4 for v in values)


def test_real_timings_are_positive_and_finite():
    values = [v for pair in prof.bench_gemm(TINY, torch.float32, CPU) for v in pair]
    values += [v for pair in prof.bench_attention(TINY, torch.float32, CPU) for v in pair]
    assert all(0 < v < 1e4 for v in values)


def _comm_body(rank, world, sizes):
    nodes = comm_bench.node_of_ranks(2)
    rows = comm_bench.comm_rows(sizes, nodes, CPU)
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
    assert gpu.expert_tokens == (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    assert gpu.expert_shapes == (prof.ExpertShape("", 4096, 1024),)
    assert max(cpu.expert_tokens) <= 256 and cpu.permute_hidden <= 256  # CPU stays fast
    assert isinstance(prof.parse_args(["--raw-out", "x"]), argparse.Namespace)


def test_expert_shapes_come_from_the_presets():
    shapes, topk = prof.shapes_of_models(["mixtral-8x7b", "deepseek-v3", "qwen3-235b-a22b"])
    assert [(s.k, s.n) for s in shapes] == [(4096, 14336), (7168, 2048), (4096, 1536)]
    assert topk == 2  # the first model's
    sz = prof.sizes_for(False, True, None, None, shapes, topk)
    assert (sz.gemm_k, sz.gemm_n) == (4096, 14336)  # the dense GEMM at the first shape
    assert (sz.permute_topk, sz.permute_hidden) == (2, 4096)
    assert sz.expert_shapes == shapes


def test_unknown_model_is_one_clean_line(tmp_path):
    with pytest.raises(SystemExit, match="--models: model 'nope'"):
        prof.main(["--raw-out", str(tmp_path / "r.json"), "--models", "nope"])


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
    capsys.readouterr()
    code = main(["calibrate", "--fit", str(header), "--cluster", str(prof_yaml), "--out",
                 str(fitted), "--params", "gemm_efficiency", "--run", pair])  # fmt: skip
    if code == 2:  # a busy machine (tests beside it) can leave the run far off its profile
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "'cpu-measured' does not describe the machine" in err[0]
        assert "re-measure it with 'piper profile'" in err[0] and not fitted.exists()
        return
    assert code == 0
    fitted_cluster = load_cluster(str(fitted))
    assert fitted_cluster.name == "cpu-measured-fitted"
    assert dict(fitted_cluster.calibration)["runs"] == "1"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_benchmarks_bf16():
    """On a GPU: bf16 GEMM throughput grows with M and is a sane fraction of any GPU's peak;
    the grouped GEMM gains from 16 to 4,096 tokens per expert; permutes stream below the
    copy bandwidth."""
    dev = torch.device("cuda", 0)
    sz = prof.sizes_for(quick=False, on_gpu=True, hidden=4096, ffn=4096)
    sz = prof.ProfileSizes(
        **{**sz.__dict__, "gemm_tokens": (64, 8192), "expert_tokens": (16, 4096), "iters": 5}
    )
    (small, large), _ = prof.bench_gemm(sz, torch.bfloat16, dev)
    assert 1.0 < large < 5000.0 and large > 2 * small
    grouped = prof.bench_expert_gemm(sz, torch.bfloat16, dev)["grouped"]
    assert 1.0 < grouped[1] < 5000.0 and grouped[1] > 2 * grouped[0]
    copy = prof.bench_membw(sz, dev)[-1]
    assert 50.0 < copy < 20000.0
    perm, unperm = prof.bench_permute(sz, torch.bfloat16, dev)
    assert 0 < max(perm + unperm) < 1.5 * copy


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


def _host_body(rank: int, world: int):
    from runtime.bench.host_time import measure_layers

    return measure_layers(CPU, iters=1)


def test_host_time_rows_per_layer_kind(run_distributed):
    """Each rank times one layer of each kind of the host model alone (its own one-rank
    dispatcher group), and every rank gets the same medians."""
    from planner.inputs.models import load_model

    first, second = run_distributed(_host_body, 2, timeout_s=60)
    assert first == second
    kinds = [layer.kind for layer in load_model(first["model"]).layers]
    assert [(r["kind"], r["count"]) for r in first["rows"]] == [
        (k, kinds.count(k)) for k in dict.fromkeys(kinds)
    ]
    assert all(r["fwd_s"] > 0 and r["bwd_s"] > 0 for r in first["rows"])
