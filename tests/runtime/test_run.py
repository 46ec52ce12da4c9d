"""`piper run`: plan checks that fail fast with exit code 2, and one end-to-end torchrun launch
of a plan written as `piper plan` writes it (scaled down)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from planner.calibrate.metrics import load_metrics
from planner.cli import main
from planner.inputs.models import load_model, model_config
from planner.migration.trace import load_trace
from planner.plan import ClusterEntry, ModelEntry, ParallelPlan, RankPlan, load_plan
from planner.run.scale import keep_layers
from planner.run.spec import run_spec_from_plan
from planner.specs import SpecError
from tests.runtime.tiny_plans import hand_plan

ROOT = Path(__file__).resolve().parents[2]


def _write_plan(tmp_path, pp=2, dp=1, ep=1, **changes):
    model = load_model("tiny-moe")
    entry = ModelEntry("tiny-moe", model.source, model_config(model))
    plan = hand_plan(
        model,
        pp,
        dp,
        ep,
        micro_batch=2,
        num_microbatches=2,
        seq_len=64,
        gpus_per_node=2,
        model_entry=entry,
    )
    plan = replace(plan, **changes)
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    return path, plan


def test_changed_model_is_refused_unless_forced(tmp_path, capsys):
    path, plan = _write_plan(tmp_path)
    cfg = dict(plan.model.config, hidden_size=96)  # the model file "changed" since
    path.write_text(replace(plan, model=replace(plan.model, config=cfg)).to_json())
    assert main(["run", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "model 'tiny-moe' changed since planning" in err and "--force" in err
    assert "\n" not in err.strip()  # one line


def test_changed_cluster_is_refused_and_force_passes_the_check(tmp_path, capsys):
    from planner.cli.run import changed_inputs
    from planner.inputs.clusters import cluster_to_dict, load_cluster

    recorded = {**cluster_to_dict(load_cluster("cpu-gloo")), "gpus": 2}
    path, plan = _write_plan(tmp_path, cluster=ClusterEntry.from_dict(recorded))
    assert changed_inputs(plan) == []  # as planned
    stale = replace(plan, cluster=ClusterEntry.from_dict({**recorded, "nic_gbps": 99.0}))
    assert changed_inputs(stale) == ["cluster 'cpu-gloo' (nic_gbps)"]
    path.write_text(stale.to_json())
    assert main(["run", str(path), "--steps", "1"]) == 2
    assert "cluster 'cpu-gloo' (nic_gbps) changed since planning" in capsys.readouterr().err
    # --force skips this check; the launch then fails on the bad --nproc instead
    assert main(["run", str(path), "--force", "--nproc", "5"]) == 2
    assert "use --nproc 2" in capsys.readouterr().err


def test_a_measured_profile_with_full_precision_floats_is_unchanged_after_planning(tmp_path):
    """`piper profile` writes floats to 16-17 digits and plan.json stores 9: the check compares
    them as plan.json stores them, so a profile planned with is not 'changed'."""
    from planner.cli.run import changed_inputs
    from planner.inputs.clusters import cluster_to_dict, load_cluster
    from planner.plan import load_plan

    text = (ROOT / "profiles/clusters/cpu-gloo.yaml").read_text()
    assert "attention_efficiency: 0.3\n" in text
    profile = tmp_path / "my-cpu.yaml"
    profile.write_text(
        text.replace("attention_efficiency: 0.3\n", "attention_efficiency: 0.31234567890123456\n")
    )
    recorded = {**cluster_to_dict(load_cluster(str(profile))), "gpus": 2, "source": str(profile)}
    path, _ = _write_plan(tmp_path, cluster=ClusterEntry.from_dict(recorded))
    plan = load_plan(path)
    assert plan.cluster.profile["attention_efficiency"] == 0.312345679  # as stored
    assert changed_inputs(plan) == []
    profile.write_text(
        text.replace("attention_efficiency: 0.3\n", "attention_efficiency: 0.3123457\n")
    )
    assert changed_inputs(plan) == [f"cluster '{profile}' (attention_efficiency)"]


def test_memory_check_counts_torch_and_each_ranks_model_state(tmp_path, capsys, monkeypatch):
    """Each process: PROCESS_GIB plus its stage's parameters at 18 B (the embedding on the
    first stage, the head on the last); the run is refused, one line and exit 2, when
    torchrun plus the processes exceed MEMORY_SHARE of the memory available."""
    import planner.cli.run as run_cli
    from planner.resources.params import layer_params
    from planner.run.options import RunOptions, add_run_arguments
    from planner.run.spec import checked_spec

    path, _ = _write_plan(tmp_path, pp=2, dp=1, ep=1)
    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    spec = checked_spec(RunOptions.from_args(parser.parse_args([str(path), "--steps", "1"])))
    model = spec.model
    states = run_cli.rank_state_gib(spec)
    params = sum(layer_params(model, ly).total for ly in model.layers)
    params += 2 * model.vocab_size * model.hidden_size  # embedding, head
    assert len(states) == 2 and sum(states) * 2**30 == pytest.approx(18 * params, rel=1e-12)
    need = run_cli.LAUNCHER_GIB + 2 * run_cli.PROCESS_GIB + sum(states)
    monkeypatch.setattr(run_cli, "_available_gib", lambda: need / run_cli.MEMORY_SHARE * 1.001)
    run_cli._check_memory(spec)  # fits, just
    monkeypatch.setattr(run_cli, "_available_gib", lambda: need / run_cli.MEMORY_SHARE * 0.999)
    assert main(["run", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "2 processes need about" in err and "--force" in err and "\n" not in err


def test_migration_priced_from_a_cluster_that_cannot_load_is_one_line(tmp_path, capsys):
    """--migrate-every prices moves from the plan's cluster before any process starts."""
    path, plan = _write_plan(tmp_path, ep=2, dp=2, cluster=ClusterEntry("no-such-cluster"))
    assert main(["run", str(path), "--force", "--migrate-every", "2", "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert str(path) in err and "no-such-cluster" in err and "\n" not in err


@pytest.mark.parametrize(
    "args, tp, msg",
    [
        (["--nproc", "3"], 1, "use --nproc 2"),
        ([], 3, "tp=3 does not divide layer 0's num_kv_heads"),
        (["--scale", "1.5"], 1, "--scale"),
        (["--nproc", "0"], 1, "--nproc must be >= 1"),
        (["--ranks-per-node", "0"], 1, "--ranks-per-node must be >= 1"),
        (["--lr", "-1"], 1, "--lr must be a positive"),
        (
            ["--resume"],
            1,
            "--checkpoint-every, --resume and --max-restarts need --checkpoint-dir D",
        ),
        (["--checkpoint-dir", "no-ckpt", "--resume"], 1, "--resume: no intact checkpoint in"),
        (["--data", "no-such.bin"], 1, "--data: no-such.bin not found; give a token .bin"),
    ],
)
def test_bad_runs_exit_2_with_one_line(tmp_path, capsys, args, tp, msg):
    changes = {}
    if tp == 3:  # one data-parallel rank of three tensor-parallel ranks: 3 splits no heads
        changes = {
            "parallel": ParallelPlan(1, 1, 3, 1, 3, 2, 2, "none"),
            "ranks": tuple(RankPlan(r, r // 2, r % 2, 0, 0, r, 0) for r in range(3)),
        }
    path, _ = _write_plan(tmp_path, pp=1 if tp == 3 else 2, **changes)
    assert main(["run", str(path), "--steps", "1", *args]) == 2
    assert msg in capsys.readouterr().err


def test_context_parallel_is_refused_in_one_line_naming_the_megatron_export(tmp_path, capsys):
    path, plan = _write_plan(tmp_path, pp=1, dp=2)
    par = replace(plan.parallel, dp=1, cp=2)  # 2 ranks: one data-parallel rank of two cp
    ranks = tuple(RankPlan(r, 0, r, 0, 0, 0, 0, cp=r) for r in range(2))
    path.write_text(replace(plan, parallel=par, ranks=ranks).to_json())
    assert main(["run", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert "cp=2 (context parallel) does not run on this runtime" in err
    assert "'piper export PLAN --to megatron'" in err and "\n" not in err


def test_interleaved_stages_take_their_chunk_sizes_in_virtual_order():
    model = load_model("mixtral-8x7b")  # 32 layers
    plan = hand_plan(model, pp=4, dp=1, ep=1, num_microbatches=8, vp=2)  # 8 layers a rank
    spec = run_spec_from_plan(plan, model, 1.0, 4)
    assert spec.chunks(1) == ((1, (4, 5, 6, 7)), (5, (20, 21, 22, 23)))
    assert spec.stage_layers[1] == (4, 5, 6, 7, 20, 21, 22, 23)
    # uneven stages: rank s runs its stage's layer count, chunk c the size of chunk c of
    # stage s (virtual_chunks: earlier chunks take the extra layer)
    runs = [range(0, 5), range(5, 12), range(12, 21), range(21, 32)]
    uneven = replace(plan, stages=tuple(
        replace(s, layers=tuple(r)) for s, r in zip(plan.stages, runs, strict=True)))  # fmt: skip
    spec = run_spec_from_plan(uneven, model, 1.0, 4)
    sizes = [len(layers) for layers in spec.chunk_layers]
    assert sizes == [3, 4, 5, 6, 2, 3, 4, 5]  # in virtual order k = c * pp + s
    assert [i for c in spec.chunk_layers for i in c] == list(range(32))
    assert [len(s) for s in spec.stage_layers] == [5, 7, 9, 11]
    # scaled: one layer per virtual stage, micro-batches a multiple of pp
    small = run_spec_from_plan(plan, model, 0.25, 4)
    assert [len(c) for c in small.chunk_layers] == [1] * 8 and small.num_microbatches == 4
    assert small.source_layers == (0, 4, 8, 12, 16, 20, 24, 28)
    assert small.chunks(0) == ((0, (0,)), (4, (4,)))  # plan layers 0 and 16
    one = [range(0, 1), range(1, 12), *runs[2:]]  # stage 0: one layer for two chunks
    lone = replace(plan, stages=tuple(
        replace(s, layers=tuple(r)) for s, r in zip(plan.stages, one, strict=True)))  # fmt: skip
    with pytest.raises(SpecError, match="stage 0 holds 1 layers for vp=2 chunks.*--to megatron"):
        run_spec_from_plan(lone, model, 1.0, 4)


def test_one_run_options_builds_both_parsers_and_the_torchrun_line():
    """Every launcher flag round-trips through piper run's parser and to_launch_argv; the
    cli_only flags exist only in piper run."""
    import argparse

    from planner.cli.run import _launch_cmd
    from planner.run.options import RunOptions, add_run_arguments

    cli, launcher = argparse.ArgumentParser(), argparse.ArgumentParser()
    add_run_arguments(cli)
    add_run_arguments(launcher, launcher=True)
    argv = ["p.json", "--steps", "7", "--ranks-per-node", "4", "--scale", "0.25"]
    argv += ["--dispatcher", "flat", "--migrate-every", "3", "--out", "o", "--seed", "5"]
    argv += ["--lr", "0.01", "--trace-every", "2", "--halo-direct-below-bytes", "0"]
    argv += ["--router-bias-rate", "0.5", "--nproc", "8", "--force"]
    argv += ["--checkpoint-dir", "ck", "--checkpoint-every", "5", "--resume"]
    argv += ["--expert-gemm", "loop", "--precision", "plan", "--data", "t.bin"]
    options = RunOptions.from_args(cli.parse_args(argv))
    assert (options.plan, options.steps, options.nproc, options.force) == ("p.json", 7, 8, True)
    cmd = _launch_cmd(options, 8)
    assert cmd[cmd.index("--nproc-per-node") + 1] == "8"
    launch_argv = options.to_launch_argv()
    assert cmd[-len(launch_argv) :] == launch_argv and launch_argv[:2] == ["-m", "runtime.launch"]
    assert "--nproc" not in launch_argv and "--force" not in launch_argv
    relaunched = RunOptions.from_args(launcher.parse_args(launch_argv[2:]))
    assert relaunched == replace(options, nproc=None, force=False)
    with pytest.raises(SystemExit):  # the launcher has no cli_only flags
        launcher.parse_args(["--plan", "p.json", "--nproc", "8"])
    defaults = RunOptions.from_args(cli.parse_args(["p.json"]))
    assert defaults == RunOptions("p.json")
    # no --dispatcher: the launcher takes the plan's too; --precision plan: the plan's dtype
    want = "--plan p.json --steps 30 --scale 1.0 --migrate-every 0 --seed 0"
    want += " --lr 0.003 --trace-every 1 --halo-direct-below-bytes -1 --router-bias-rate 0.0"
    want += " --expert-gemm grouped --precision plan --checkpoint-every 0"
    assert defaults.to_launch_argv() == ["-m", "runtime.launch", *want.split()]
    assert str(defaults.out_dir).endswith("/run") and options.out_dir.name == "o"


def _priced(tmp_path, dispatcher: str, dtype: str):
    """A plan priced with `dispatcher` (plan.json extra.dispatcher) in `dtype`."""
    _, plan = _write_plan(tmp_path, ep=2, dp=2)
    priced = replace(
        plan,
        training={**plan.training, "dtype": dtype},
        extra={**plan.extra, "dispatcher": dispatcher},
    )
    path = tmp_path / "plan.json"
    path.write_text(priced.to_json())
    return str(path)


@pytest.mark.parametrize(
    "dispatcher, dtype, ran",
    [("halo", "bf16", ("halo", "bf16")), ("flat", "fp32", ("flat", "fp32")),
     ("halo-dedup", "bf16", ("halo-dedup", "bf16")),
     ("deepep", "bf16", ("flat", "bf16"))],  # DeepEP: only a --scale'd rehearsal runs it
)  # fmt: skip
def test_without_flags_piper_run_runs_the_priced_dispatcher_and_precision(
    tmp_path, dispatcher, dtype, ran
):
    from planner.run.options import RunOptions
    from planner.run.spec import checked_spec

    path = _priced(tmp_path, dispatcher, dtype)
    scale = 0.5 if dispatcher == "deepep" else 1.0
    options = RunOptions(path, scale=scale)
    spec = checked_spec(options)
    assert (spec.dispatcher, options.compute_dtype(load_plan(path).training)) == ran
    if dispatcher == "deepep":  # at full size the DeepEP plan is another engine's
        with pytest.raises(SpecError, match="deepep dispatcher.*--target piper"):
            checked_spec(RunOptions(path))


@pytest.mark.parametrize(
    "priced, flags, msg",
    [
        (("flat", "bf16"), ["--dispatcher", "halo"],
         "--dispatcher halo: the plan was priced with the flat dispatcher; leave the flag out "
         "to run flat, re-plan with --dispatcher halo, or rehearse with --scale < 1"),
        (("halo", "bf16"), ["--dispatcher", "flat"], "priced with the halo dispatcher"),
        (("flat", "bf16"), ["--dispatcher", "halo-dedup"],
         "re-plan with --dispatcher halo-dedup,"),
        # priced apart: a deduplicated run moves other bytes than the plan priced
        (("halo", "bf16"), ["--dispatcher", "halo-dedup"], "priced with the halo dispatcher"),
        (("halo-dedup", "bf16"), ["--dispatcher", "halo"],
         "priced with the halo-dedup dispatcher"),
        (("flat", "bf16"), ["--precision", "fp32"],
         "--precision fp32: the plan was priced in bf16, which runs in bf16 here; leave the "
         "flag out (or --precision plan), re-plan with --dtype fp32, or rehearse with --scale"),
        (("flat", "fp32"), ["--precision", "bf16"], "priced in fp32, which runs in fp32 here"),
    ],
)  # fmt: skip
def test_a_flag_that_changes_a_priced_setting_is_refused_at_full_size(
    tmp_path, capsys, monkeypatch, priced, flags, msg
):
    import planner.cli.run as run_cli

    path = _priced(tmp_path, *priced)
    launched = []
    monkeypatch.setattr(run_cli.subprocess, "run", _record_launch(launched, run_cli.subprocess.run))
    assert main(["run", path, "--steps", "1", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"piper run: error: {path}: ") and msg in err and "\n" not in err
    assert launched == []  # torchrun never started


@pytest.mark.parametrize(
    "priced, flags, ran",
    [
        (("halo-dedup", "bf16"), ["--dispatcher", "halo-dedup"], ("halo-dedup", 1.0)),
        (("halo", "bf16"), ["--dispatcher", "halo", "--precision", "bf16"], ("halo", 1.0)),
        (("flat", "bf16"), ["--precision", "plan"], ("flat", 1.0)),
        # a --scale'd rehearsal may change them
        (("flat", "bf16"), ["--dispatcher", "halo", "--precision", "fp32", "--scale", "0.5"],
         ("halo", 0.5)),
    ],
)  # fmt: skip
def test_flags_that_keep_the_priced_settings_or_rehearse_are_taken(tmp_path, priced, flags, ran):
    import argparse

    from planner.run.options import RunOptions, add_run_arguments
    from planner.run.spec import checked_spec

    parser = argparse.ArgumentParser()
    add_run_arguments(parser)
    options = RunOptions.from_args(parser.parse_args([_priced(tmp_path, *priced), *flags]))
    assert (checked_spec(options).dispatcher, options.scale) == ran


def test_scale_keeps_structure():
    model = load_model("mixtral-8x7b")  # 32 layers, 8 experts top-2
    plan = hand_plan(model, pp=4, dp=4, ep=4, num_microbatches=16, seq_len=4096)
    spec = run_spec_from_plan(plan, model, 0.125, 2)
    assert (spec.pp, spec.dp, spec.ep, spec.edp) == (4, 4, 4, 1)
    assert [len(s) for s in spec.stage_layers] == [1, 1, 1, 1]  # 8 layers per stage * 1/8
    assert spec.source_layers == (0, 8, 16, 24)
    assert spec.model.num_experts == 8 and spec.model.top_k == 2
    assert spec.model.hidden_size == 512 and spec.seq_len == 512
    assert spec.model.layers[0].moe.expert_ffn == 14336 // 8
    att = spec.model.layers[0].attention
    assert (att.num_heads // att.num_kv_heads, att.num_kv_heads) == (4, 1)  # 32/8 ratio kept
    assert spec.num_microbatches == 4 and spec.model.vocab_size == 256
    assert [p for _, p in spec.placements] == [plan.experts[0].rank_of_expert] * 4
    # a stage keeps an MoE layer even when its evenly spaced pick is a dense one
    ds = load_model("deepseek-v2-lite")  # layer 0 dense, then MoE
    kept = keep_layers([tuple(range(0, 3)), tuple(range(3, ds.num_layers))], ds, 0.1)
    assert kept[0] == (2,) and all(ds.layers[i].kind == "moe" for s in kept for i in s)


def test_halo_cost_comes_from_the_plans_cluster():
    from planner.inputs.clusters import cluster_to_dict, load_cluster
    from planner.run.spec import halo_cost_of as halo_cost_of_entry

    def halo_cost_of(section: dict) -> tuple[float, ...]:
        return halo_cost_of_entry(ClusterEntry.from_dict(section))

    frontier = cluster_to_dict(load_cluster("frontier"))
    # 1 us per message; inside a node the slowest level is Infinity Fabric between packages
    # (50 GB/s per GCD); 4 NICs x 25 GB/s leave a node
    assert halo_cost_of(frontier) == (pytest.approx(1e-6), 50.0, 100.0)
    assert halo_cost_of({**frontier, "msg_overhead_us": 4.0})[0] == pytest.approx(4e-6)
    assert halo_cost_of({"name": "hand-made"}) == ()  # an old plan without the fields


@pytest.mark.slow
def test_piper_run_end_to_end_through_torchrun(tmp_path, capsys):
    """What a new user does: `piper plan` (2 CPU ranks, pp=2), then `piper run --scale`."""
    plan_dir, out = tmp_path / "plan", tmp_path / "run"
    assert (
        main(
            [
                "plan",
                "--model",
                "tiny-moe",
                "--cluster",
                "cpu-gloo",
                "--gpus",
                "2",
                "--tp",
                "1",
                "--pp",
                "2",
                "--seq-len",
                "64",
                "--global-batch",
                "4",
                "--out",
                str(plan_dir),
            ]
        )
        == 0
    )
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--checkpoint-every", "2"]
    plan = str(plan_dir / "plan.json")
    rc = main(["run", plan, "--steps", "4", "--scale", "0.5", "--out", str(out), *ckpt])
    assert rc == 0, capsys.readouterr().err
    lines = load_metrics(out / "metrics.jsonl")
    assert len(lines) == 4 and lines[-1]["loss"] < lines[0]["loss"]
    assert load_trace(out / "trace.csv").tokens_ILE.sum() > 0
    assert (out / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    run = json.loads((out / "run.json").read_text())
    assert (run["pp"], run["hidden_size"], run["seq_len"], run["backend"]) == (2, 32, 32, "gloo")
    printed = capsys.readouterr().out
    assert "4 steps: loss" in printed
    tokens = run["dp"] * run["micro_batch"] * run["num_microbatches"] * run["seq_len"]
    assert f"seq=32, {tokens:,} tokens per step" in printed  # the size of a step, up front
    priced = load_plan(plan)  # no flags: the dispatcher and precision it was priced with
    dispatcher, dtype = priced.extra["dispatcher"], priced.training["dtype"]
    assert f"tokens per step, {dispatcher} dispatcher, {dtype} compute" in printed
    assert run["dispatcher"] == dispatcher
    assert f"; checkpoint {tmp_path / 'ckpt' / 'step-000004'}; wrote" in printed
    # two more steps from the checkpoint after step 4: metrics.jsonl holds all six
    more = ["run", plan, "--steps", "6", "--scale", "0.5", "--out", str(tmp_path / "more")]
    assert main([*more, *ckpt, "--resume"]) == 0, capsys.readouterr().err
    resumed = load_metrics(tmp_path / "more" / "metrics.jsonl")
    assert [d["loss"] for d in resumed[:4]] == [d["loss"] for d in lines]
    assert len(resumed) == 6 and "resuming from" in capsys.readouterr().out


@pytest.mark.slow
def test_piper_run_trains_a_vp2_fsdp_plan_like_the_oracle(tmp_path, capsys):
    """`piper run` on a plan with interleaved 1F1B (pp=2 x vp=2) and FSDP over dp=2."""
    from runtime.data import load_corpus
    from tests.runtime.tiny_plans import reference_losses

    model = load_model("tiny-moe")  # 4 layers: one per virtual stage
    entry = ModelEntry("tiny-moe", model.source, model_config(model))
    plan = hand_plan(model, 2, 2, 2, micro_batch=2, num_microbatches=2, seq_len=32,
                     gpus_per_node=2, model_entry=entry, vp=2, fsdp=True)  # fmt: skip
    plan = replace(plan, extra={**plan.extra, "dispatcher": "halo"})  # run as priced: HALO
    path, out = tmp_path / "plan.json", tmp_path / "run"
    path.write_text(plan.to_json())
    rc = main(["run", str(path), "--steps", "3", "--out", str(out), "--force"])
    assert rc == 0, capsys.readouterr().err
    run = json.loads((out / "run.json").read_text())
    assert (run["pp"], run["vp"], run["fsdp"], run["chunk_layers"]) == (
        2,
        2,
        True,
        [[0], [1], [2], [3]],
    )
    assert run["dispatcher"] == "halo"
    load_corpus()
    spec = run_spec_from_plan(plan, model, 1.0, 2, steps=3)
    losses = [d["loss"] for d in load_metrics(out / "metrics.jsonl")]
    assert losses == pytest.approx(reference_losses(spec), rel=2e-3, abs=2e-3)


def test_more_processes_than_memory_holds_are_refused(tmp_path, capsys, monkeypatch):
    import planner.cli.run as run_cli

    path, _ = _write_plan(tmp_path)  # 2 processes
    monkeypatch.setattr(run_cli, "_available_gib", lambda: 0.5)
    launched = []
    monkeypatch.setattr(run_cli.subprocess, "run", _record_launch(launched, run_cli.subprocess.run))
    assert main(["run", str(path), "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "2 processes need about 1.1 GiB on this machine" in err
    assert "but 0.5 GiB is available" in err and "--force" in err
    assert launched == []  # torchrun never started


def _record_launch(launched: list, real_run):
    """subprocess.run that records torchrun launches and runs everything else."""

    def fake(cmd, *args, **kwargs):
        if "torch.distributed.run" in cmd:
            launched.append(cmd)
            raise AssertionError("torchrun must not start")
        return real_run(cmd, *args, **kwargs)

    return fake


def test_available_memory_is_read_from_proc():
    from planner.cli.run import _available_gib

    gib = _available_gib()
    assert gib is None or 0 < gib < 1 << 20


def test_the_run_summary_counts_migrations_their_copies_and_bytes(tmp_path):
    """The last line of `piper run`: steps, loss, and what migration moved (metrics.jsonl)."""
    from planner.cli.run import _summary

    def line(step, loss, moved, migrate_bytes):
        kinds = {"dispatch_intra": 10, "migrate_intra": migrate_bytes, "migrate_inter": 1}
        return {
            "step": step, "loss": loss, "tokens_per_s": 100.0 * (step + 1),
            "bytes_intra_node": 1000, "bytes_inter_node": 2000,
            "migrated_experts": moved, "bytes_by_kind": kinds if moved else {"p2p_intra": 5},
        }  # fmt: skip

    lines = [line(0, 5.5, 0, 0), line(1, 5.0, 16, 4096), line(2, 4.5, 0, 0), line(3, 4.0, 8, 904)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    text = _summary(tmp_path, checkpoint="ckpt/step-000004")
    assert text.startswith("4 steps: loss 5.500 -> 4.000; median 300 tokens/s;")
    assert "2 migrations moved 24 expert copies (5,002 B)" in text
    assert "checkpoint ckpt/step-000004" in text and "\n" not in text
    still = [{**x, "migrated_experts": 0, "bytes_by_kind": {}} for x in lines]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in still))
    assert "; 0 migrations moved 0 expert copies (0 B); wrote " in _summary(tmp_path)


def test_a_sigterm_to_piper_run_stops_torchrun_and_its_processes(tmp_path):
    """`kill PID` of `piper run` alone (a scheduler's SIGTERM) reaches torchrun, which stops
    its processes; the handler is put back afterwards."""
    import os
    import signal
    import sys
    import threading

    import planner.cli.run as run_cli

    child = tmp_path / "torchrun_stand_in.py"
    child.write_text(
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    open(sys.argv[1], 'w').write('stopped')\n"
        "    sys.exit(3)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "open(sys.argv[1] + '.ready', 'w').write('')\n"
        "time.sleep(60)\n"
    )
    marker = tmp_path / "marker"
    before = signal.getsignal(signal.SIGTERM)

    def send_when_ready():
        for _ in range(200):  # the stand-in's handler is installed before it says ready
            if (tmp_path / "marker.ready").exists():
                break
            threading.Event().wait(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=send_when_ready, daemon=True).start()
    code, stopped = run_cli._train(
        [sys.executable, str(child), str(marker)], dict(os.environ), tmp_path, 1
    )
    assert stopped and code == 3 and marker.read_text() == "stopped"
    assert signal.getsignal(signal.SIGTERM) == before
