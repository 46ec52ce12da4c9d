"""`piper plan` as a new user meets it: progress in logs, abbreviated flags, layouts that
cannot run as given, output that fits a terminal."""

from __future__ import annotations

import io
import time

import pytest

from planner.cli import main
from planner.outputs.console import Phases
from tests.hardening_cli import run_piper_process

TINY = ["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "8", "--seq-len", "128",
        "--global-batch", "16", "--time-limit-s", "2"]  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--gpu", "8"],
        ["estimate", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--glob", "8"],
    ],
)
def test_an_abbreviated_flag_is_refused(argv, capsys):
    with pytest.raises(SystemExit) as done:
        main(argv)
    err = capsys.readouterr().err
    assert done.value.code == 2 and len(err.splitlines()) == 1
    assert f"unrecognized arguments: {argv[-2]}" in err


def test_plan_on_a_pipe_prints_one_line_per_phase(tmp_path):
    """stderr is a pipe (a log): each phase is a line, in order, with its start time."""
    done = run_piper_process([*TINY, "--out", str(tmp_path / "out")])
    assert done.code == 0, done.stderr
    lines = [line for line in done.err_lines if line.startswith("piper plan: ")]
    labels = [line.removeprefix("piper plan: ").split(" (at ")[0] for line in lines]
    assert labels[0] == "search: candidates solved"  # reading the inputs prints no line
    assert "baselines: scoring the reference layouts" in labels
    assert "writing plan.json, tables and plots" in labels
    assert all(" (at " in line and line.endswith(" s)") for line in lines)


def test_plan_verbose_logs_the_search_counter(tmp_path):
    done = run_piper_process([*TINY[:1], "-v", *TINY[1:], "--out", str(tmp_path / "out")])
    assert done.code == 0, done.stderr
    counts = [line for line in done.err_lines if "planner.progress" in line]
    assert counts, done.stderr
    last = counts[-1].rsplit(": ", 1)[1]
    assert last.split("/")[0] == last.split("/")[1]  # the counter ends at its total


def test_a_long_phase_has_a_heartbeat():
    """A small heartbeat interval stands in for ~5 s: a phase running past it says so, with
    its counter; a phase shorter than it does not."""
    stream = io.StringIO()
    clock = Phases(None, stream, "piper plan", heartbeat_s=0.05)
    clock.start("search", "search")
    clock.update(3, 7)
    time.sleep(0.3)
    clock.close()
    lines = stream.getvalue().splitlines()
    assert lines[0].startswith("piper plan: search (at ")
    beats = [line for line in lines if "still running" in line]
    assert beats and all(
        line.startswith("piper plan: search: still running, 3/7, ") for line in beats
    )
    quiet = io.StringIO()
    clock = Phases(None, quiet, "piper plan", heartbeat_s=60.0)
    clock.start("inputs", "inputs")
    clock.close()
    assert "still running" not in quiet.getvalue()


@pytest.fixture(scope="module")
def default_plan(tmp_path_factory):
    """`piper plan` with no flags (mixtral-8x7b on 64 GCDs of frontier), stdout a pipe."""
    out = tmp_path_factory.mktemp("default")
    done = run_piper_process(["plan", "--no-plots", "--out", str(out)])
    assert done.code == 0, done.stderr
    return done.stdout, out


def test_the_default_plan_prints_no_line_over_100_columns(default_plan):
    stdout, _ = default_plan
    assert max(len(line) for line in stdout.splitlines()) <= 100
    assert "vs baselines" in stdout and "Piper" in stdout  # the baseline table, as a table


def test_the_summary_names_sequence_and_global_batch(default_plan):
    stdout, _ = default_plan
    lines = stdout.splitlines()
    assert lines[2] == (
        "  sequence 4,096 tokens, global batch 1,024 sequences (4,194,304 tokens per step), bf16"
    )


def test_no_plots_writes_every_file_but_the_plots(default_plan):
    stdout, out = default_plan
    names = {p.name for p in out.iterdir()}
    assert {"plan.json", "candidates.csv", "summary.md", "timings.json"} <= names
    assert not [n for n in names if n.endswith(".png")]
    assert f"wrote {out}/ (plan.json, candidates.csv, summary.md)" in stdout


def test_mfu_is_against_the_bf16_peak_with_the_fp8_figure_labelled():
    from planner.outputs.lines import mfu_text

    peaks = {"bf16": 989.0, "fp8": 1979.0}
    assert mfu_text(296.7, 296.7 / 1979.0, "fp8", peaks) == (
        "MFU 30.0% of the BF16 peak, 15.0% of the FP8 peak"
    )
    assert mfu_text(296.7, 0.3, "bf16", peaks) == "MFU 30.0%"


def test_a_table_too_wide_for_its_columns_prints_a_block_per_row(capsys, monkeypatch):
    from planner.outputs import console

    monkeypatch.setattr(console, "TABLE_WIDTH", 50)  # the columns need 58
    rows = [["best uniform split", "pp=2 dp=16 tp=2 ep=8 mb=1 m=64 recompute=none", "1.00x",
             "at the estimate (80% interval: may not)"]]  # fmt: skip
    console.print_table("vs baselines", ("baseline", "layout", "speedup", "note"), rows)
    lines = capsys.readouterr().out.splitlines()
    assert lines == [
        "vs baselines",
        "best uniform split",
        "  layout: pp=2 dp=16 tp=2 ep=8 mb=1 m=64",
        "    recompute=none",
        "  speedup: 1.00x",
        "  note: at the estimate (80% interval: may not)",
    ]


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("tiny")
    assert main([*TINY, "--no-plots", "--out", str(out)]) == 0
    return out / "plan.json"


def test_estimate_a_plan_reprices_it_as_planned(tiny_plan, capsys):
    """No flags: the plan's own layout, split and settings, its prediction again."""
    import json

    capsys.readouterr()
    assert main(["estimate", str(tiny_plan), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    predicted = json.loads(tiny_plan.read_text())["predicted"]
    assert d["tokens_per_s"] == pytest.approx(predicted["tokens_per_s"], rel=1e-6)
    assert d["step_time_s"] == pytest.approx(predicted["step_time_s"], rel=1e-6)
    assert "plan_predicted" not in d


def test_estimate_a_plan_with_changed_flags_shows_the_plan_beside_it(tiny_plan, capsys):
    import json

    plan = json.loads(tiny_plan.read_text())
    capsys.readouterr()
    assert main(["estimate", str(tiny_plan), "--tp", "2", "--dp", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["parallel"]["tp"], d["parallel"]["dp"]) == (2, 4)
    assert d["parallel"]["ep"] == plan["parallel"]["ep"]  # the rest is the plan's
    assert d["training"]["global_batch"] == plan["training"]["global_batch"]
    assert d["plan_predicted"]["tokens_per_s"] == pytest.approx(
        plan["predicted"]["tokens_per_s"], rel=1e-6
    )
    assert main(["estimate", str(tiny_plan), "--tp", "2", "--dp", "4"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("re-priced with --dp 4 --tp 2: the plan's prediction beside it")
    assert lines[at + 1].split() == ["plan", "now"]
    was, now = plan["predicted"]["tokens_per_s"], d["tokens_per_s"]
    assert lines[at + 2].split()[-1] == f"({now / was:.2f}x)"


def test_estimate_without_a_plan_needs_model_and_cluster(capsys):
    assert main(["estimate", "--model", "tiny-moe"]) == 2
    assert capsys.readouterr().err == (
        "piper estimate: error: estimate: --cluster missing; name the model and the cluster, "
        "or give a PLAN.json to re-price\n"
    )


def test_a_resized_cluster_is_named_plainly():
    from planner.inputs.clusters import load_cluster, with_nodes
    from planner.outputs.lines import cluster_label

    twice = with_nodes(with_nodes(load_cluster("h100"), 64), 32)
    assert twice.name == "h100-32n"  # the suffix replaced, not h100-64n-32n
    assert cluster_label(twice.name) == "h100 (32 nodes)"
    assert cluster_label("gb200-nvl72") == "gb200-nvl72"


def test_partial_nodes_are_warned_with_the_whole_node_counts():
    """100 GPUs on 8-GPU nodes: 12 full nodes and 4 GPUs of a 13th (mixtral-8x7b took
    pp 25 there without a word)."""
    import argparse

    from planner.cli.plan_warnings import plan_warnings

    args = argparse.Namespace(gpus=100, tp=None, ep=None)
    assert plan_warnings(args, 8) == [
        "--gpus 100 fills 12 nodes of 8 GPUs and 4 of one more, whose other 4 GPUs stay idle; "
        "use --gpus 96 or 104 for whole nodes"
    ]
    assert plan_warnings(argparse.Namespace(gpus=96, tp=None, ep=None), 8) == []
    assert plan_warnings(argparse.Namespace(gpus=4, tp=None, ep=None), 8) == []  # one node


def test_a_tp_group_across_nodes_is_warned(tmp_path):
    """--tp 4 on cpu-gloo's 2-GPU nodes: planned, and stderr says the group crosses nodes."""
    done = run_piper_process([*TINY, "--tp", "4", "--no-plots", "--out", str(tmp_path / "o")])
    assert done.code == 0, done.stderr
    assert done.err_lines[-1] == (
        "piper plan: warning: --tp 4: each TP group spans 2 nodes of 2 GPUs, so its all-reduces "
        "cross the network every layer; layouts with TP inside a node exist: drop --tp to let "
        "the search weigh them"
    )


def test_replanning_over_exports_of_another_plan_warns(tmp_path, capsys):
    out = tmp_path / "run"
    base = [*TINY, "--target", "megatron", "--no-plots", "--out", str(out)]
    assert main(base) == 0
    assert main(["export", str(out / "plan.json"), "--to", "megatron", "--out",
                 str(out / "megatron_args.sh")]) == 0  # fmt: skip
    capsys.readouterr()
    assert main([*base, "--seq-len", "256"]) == 0  # the last --seq-len wins: another plan
    assert (
        capsys.readouterr()
        .err.splitlines()[-1]
        .startswith(
            f"piper plan: WARNING: megatron_args.sh in {out} were exported from another plan"
        )
    )
