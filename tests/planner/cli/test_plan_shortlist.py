"""`piper plan --shortlist K`: the trial folders, the jobs per engine, the collect script as
the real parsers and bash read it, and the bad inputs."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess

import pytest

from planner.cli import build_parser, main

TINY = ["--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "2", "--seq-len", "64",
        "--global-batch", "8"]  # fmt: skip


def script_commands(path):
    """argv of every `"${PIPER:-piper}" ...` / `sbatch ...` line of a generated script."""
    out = []
    for line in path.read_text().splitlines():
        if line.startswith(('"${PIPER:-piper}"', "sbatch ", "bash ")):
            words = shlex.split(line)
            out.append(words)
    return out


def bash_syntax_ok(path):
    return subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def piper_shortlist(tmp_path_factory):
    out = tmp_path_factory.mktemp("sl") / "it's a plan"  # a quote and a space reach the shell
    assert main(["plan", *TINY, "--shortlist", "3", "--trial-steps", "5", "--out", str(out)]) == 0
    return out


def test_piper_trials_and_collect(piper_shortlist):
    out = piper_shortlist
    folder = out / "shortlist"
    trials = sorted(p for p in folder.iterdir() if p.is_dir())
    assert [p.name.split("-", 1)[0] for p in trials] == ["1", "2", "3"]
    # trial 1 is the plan itself; the others are plans of the other layouts
    assert (trials[0] / "plan.json").read_text() == (out / "plan.json").read_text()
    plans = [json.loads((t / "plan.json").read_text()) for t in trials]
    layouts = {json.dumps([p["parallel"], p["training"]["fsdp"]]) for p in plans}  # FSDP: a knob
    assert len(layouts) == 3
    parser = build_parser()
    for t in trials:
        assert bash_syntax_ok(t / "trial.sh")
        [argv] = script_commands(t / "trial.sh")
        args = parser.parse_args(argv[1:])  # the real `piper run` parser
        assert args.plan == str(t / "plan.json") and args.steps == 5
        assert args.out == str(t / "run")
        assert "--dispatcher" not in argv and "--precision" not in argv  # the plan's
    assert bash_syntax_ok(folder / "run_all.sh") and bash_syntax_ok(folder / "collect.sh")
    assert [w[1] for w in script_commands(folder / "run_all.sh")] == [
        str(t / "trial.sh") for t in trials
    ]
    fit, replan = script_commands(folder / "collect.sh")
    fit_args = parser.parse_args(fit[1:])
    assert fit_args.fit == "" and fit_args.log == [  # --fit without a RUNS.csv
        f"{t / 'plan.json'}:{t / 'run' / 'metrics.jsonl'}" for t in trials
    ]
    assert fit_args.out == str(folder / "fitted.yaml")
    plan_args = parser.parse_args(replan[1:])
    assert plan_args.cluster == str(folder / "fitted.yaml") and plan_args.target == "piper"
    assert (plan_args.model, plan_args.gpus, plan_args.seq_len, plan_args.global_batch) == (
        "tiny-moe", 2, 64, 8)  # fmt: skip
    assert plan_args.shortlist is None and plan_args.out == str(folder / "replan")
    summary = (folder / "shortlist.md").read_text()
    assert all(t.name in summary for t in trials) and "D-optimal" in summary


@pytest.mark.parametrize("engine", ["megatron", "torchtitan"])
def test_engine_trials_are_slurm_jobs(tmp_path, engine):
    out = tmp_path / "plan"
    argv = ["plan", "--model", "tiny-moe", "--cluster", "h100", "--gpus", "8", "--seq-len",
            "256", "--global-batch", "64", "--target", engine, "--shortlist", "2", "--out",
            str(out)]  # fmt: skip
    assert main(argv) == 0
    trials = sorted(p for p in (out / "shortlist").iterdir() if p.is_dir())
    assert len(trials) == 2
    args_file = {"megatron": "megatron_args.sh", "torchtitan": "torchtitan_args.sh"}[engine]
    # torchtitan's exported arguments end with a subcommand, after which tyro refuses a
    # top-level option: the short run's flags go before them
    short = {
        "megatron": 'pretrain_gpt.py" "${MEGATRON_ARGS[@]}" --train-iters 30 --log-interval 1',
        "torchtitan": "torchtitan.train --training.steps 30 --metrics.log_freq 1 "
        '"${DATA_ARGV[@]}" "${TORCHTITAN_ARGS[@]}")',
    }
    for t in trials:
        if engine == "torchtitan":
            last_argument = (t / args_file).read_text().rstrip().splitlines()[-2]
            assert last_argument.startswith("  activation_checkpoint:")
        for name in (args_file, "trial.sbatch", "trial.sh"):
            assert bash_syntax_ok(t / name), name
        sbatch = (t / "trial.sbatch").read_text()
        assert short[engine] in sbatch and f"ARGS_FILE={t / args_file}" in sbatch
        [submit] = script_commands(t / "trial.sh")
        assert submit == ["sbatch", "--output", str(t / "train.log"), str(t / "trial.sbatch")]
    fit, _ = script_commands(out / "shortlist" / "collect.sh")
    assert f"{trials[1] / 'plan.json'}:{trials[1] / 'train.log'}" in fit


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--shortlist", "0"], "--shortlist 0: give a whole number"),
        (["--shortlist", "-2"], "--shortlist -2: give a whole number"),
        (["--shortlist", "x"], "--shortlist x: give a whole number"),
        (["--shortlist", "2.5"], "--shortlist 2.5: give a whole number"),
        (["--shortlist", "2", "--trial-steps", "1"], "--trial-steps 1: give >= 2"),
    ],
)
def test_bad_shortlist_flags_are_one_line_and_write_nothing(tmp_path, capsys, flags, message):
    out = tmp_path / "never"
    assert main(["plan", *TINY, *flags, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and "Traceback" not in err
    assert not out.exists()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck not installed")
def test_shellcheck_is_quiet(piper_shortlist):
    folder = piper_shortlist / "shortlist"
    scripts = [str(p) for p in folder.rglob("*.sh")]
    proc = subprocess.run(["shellcheck", *scripts], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout


@pytest.mark.parametrize(
    "name, message",
    [
        ("a:b", "holds ':' (piper calibrate --log PLAN:LOG splits at it)"),
        ("run%j", "holds '%' (sbatch --output expands it)"),
        ("new\nline", "holds a control character"),
    ],
)
def test_a_shortlist_folder_the_scripts_cannot_name_is_refused(tmp_path, capsys, name, message):
    out = tmp_path / name
    assert main(["plan", *TINY, "--shortlist", "2", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and message in err and not out.exists()
