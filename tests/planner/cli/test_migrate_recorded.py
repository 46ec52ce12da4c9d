"""`piper migrate` on a run's trace: ep and tokens from --plan, intervals from the run.json
`piper run` writes beside trace.csv; flags and traces that contradict them are refused."""

from __future__ import annotations

import json

import numpy as np
import pytest

from planner.cli import main
from planner.migration.trace import interval_trace, load_trace, trace_to_csv
from tests.planner.cli.test_migrate import _plan as hand_plan
from tests.planner.migration.conftest import write_csv

LAYERS, E, STEPS, EVERY = (1, 2, 3), 8, 20, 5


def _run_dir(tmp_path, steps=STEPS, rows=STEPS, seed=1, **settings):
    """A run folder: a per-step trace of `rows` rows and the run.json of an ep=4 run."""
    rng = np.random.default_rng(seed)
    share = np.array([8, 4, 2, 1, 1, 1, 1, 1]) / 19
    rows_ = [
        (t, layer, e, int(n))
        for t in range(rows)
        for layer in LAYERS
        for e, n in enumerate(rng.multinomial(400, share))
    ]
    run = tmp_path / "run"
    run.mkdir()
    record = {"ep": 4, "steps": steps, "migrate_every": EVERY, "trace_every": 1, **settings}
    (run / "run.json").write_text(json.dumps(record))
    return write_csv(run / "trace.csv", rows_)


def _migrate(capsys, *args):
    code = main(["migrate", *args, "--no-plots"])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_plan_and_run_json_give_every_setting(tmp_path, capsys):
    trace, plan = _run_dir(tmp_path), hand_plan(tmp_path)
    code, printed, _ = _migrate(
        capsys, "--trace", trace, "--plan", plan, "--out", str(tmp_path / "a")
    )
    assert code == 0
    # 20 steps / 5 per interval; 128 tokens x 1 sequence x 2 micro-batches per rank and step
    assert "4 EP ranks, 4 intervals of 5 steps x 256 tokens per rank (5 trace rows each" in printed
    spelled = ["--ep", "4", "--rows-per-interval", "5", "--steps-per-interval", "5",
               "--tokens-per-step", "256", "--model", "tiny-moe",
               "--cluster", "cpu-gloo"]  # fmt: skip
    code, _, _ = _migrate(
        capsys, "--trace", trace, "--plan", plan, *spelled, "--out", str(tmp_path / "b")
    )
    assert code == 0
    for name in ("summary.json", "placements.csv", "migrations.csv"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert 0 < summary[0]["total_cost_s"] < 1  # 5 steps per interval, not 100 x 32768 tokens


def test_run_json_without_plan_gives_ep_intervals_and_tokens(tmp_path, capsys):
    shape = {"seq_len": 64, "micro_batch": 2, "num_microbatches": 3}
    trace = _run_dir(tmp_path, **shape)
    args = ["--trace", trace, "--model", "tiny-moe", "--out", str(tmp_path / "o")]
    code, printed, _ = _migrate(capsys, *args)
    assert code == 0 and "4 EP ranks, 4 intervals of 5 steps x 384 tokens per rank" in printed
    code, _, err = _migrate(capsys, *args, "--tokens-per-step", "999")
    assert code == 2 and "--tokens-per-step 999 contradicts" in err and "(384)" in err


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--ep", "2"], ["--ep 2 contradicts", "run.json", "pass --ep 4"]),
        (["--rows-per-interval", "1"], ["--rows-per-interval 1", "migrate_every 5", "(5)"]),
        (["--steps-per-interval", "100"], ["--steps-per-interval 100", "(5)"]),
    ],
)
def test_flags_that_contradict_the_run_are_one_line(tmp_path, capsys, flags, words):
    out = tmp_path / "o"
    code, _, err = _migrate(capsys, "--trace", _run_dir(tmp_path), *flags, "--out", str(out))
    assert code == 2 and len(err.strip().splitlines()) == 1 and not out.exists()
    assert all(w in err for w in words), err


@pytest.mark.parametrize(
    "flags, words",
    [
        (["--ep", "2"], ["--ep 2 contradicts", "plan.json's ep", "pass --ep 4"]),
        (["--tokens-per-step", "999"], ["--tokens-per-step 999", "(256)"]),
        (["--model", "mixtral-8x7b"], ["--model mixtral-8x7b contradicts", "tiny-moe"]),
        (["--cluster", "h100"], ["--cluster h100 contradicts", "cpu-gloo"]),
    ],
)
def test_flags_that_contradict_the_plan_are_one_line(tmp_path, capsys, flags, words):
    out = tmp_path / "o"
    plan = hand_plan(tmp_path)
    code, _, err = _migrate(
        capsys, "--trace", _run_dir(tmp_path), "--plan", plan, *flags, "--out", str(out)
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and not out.exists()
    assert all(w in err for w in words), err


@pytest.mark.parametrize(
    "run, words",
    [
        ({"ep": 2}, ["had ep=2", "has ep=4", "pass the plan that run trained"]),
        ({"steps": 25}, ["20 rows", "records 25 steps", "pass that run's trace"]),
        ({"migrate_every": 4, "trace_every": 3, "rows": 7}, ["migrate_every 4", "--trace-every"]),
        ({"trace_every": "x"}, ["run.json: field 'trace_every'", "rerun 'piper run'"]),
    ],
)
def test_a_trace_that_contradicts_its_run_is_one_line(tmp_path, capsys, run, words):
    out = tmp_path / "o"
    rows = run.pop("rows", STEPS)
    trace = _run_dir(tmp_path, rows=rows, **run)
    code, _, err = _migrate(
        capsys, "--trace", trace, "--plan", hand_plan(tmp_path), "--out", str(out)
    )
    assert code == 2 and len(err.strip().splitlines()) == 1 and not out.exists()
    assert all(w in err for w in words), err


def test_trace_layers_must_be_the_plans_moe_layers(tmp_path, capsys):
    rows = [(t, 7, e, 10 + e) for t in range(4) for e in range(E)]
    trace = write_csv(tmp_path / "t.csv", rows)
    code, _, err = _migrate(
        capsys, "--trace", trace, "--plan", hand_plan(tmp_path), "--out", str(tmp_path / "o")
    )
    assert code == 2 and "layer 7 is not an MoE layer" in err


def test_ep_is_needed_without_plan_or_run(tmp_path, capsys):
    trace = write_csv(tmp_path / "t.csv", [(t, 1, e, 10 + e) for t in range(4) for e in range(E)])
    code, _, err = _migrate(capsys, "--trace", trace, "--out", str(tmp_path / "o"))
    assert code == 2 and "--ep is needed" in err


def test_partial_last_interval_is_left_out_with_a_warning(tmp_path, capsys, caplog):
    trace = _run_dir(tmp_path, steps=22, rows=22)
    code, printed, _ = _migrate(
        capsys, "--trace", trace, "--plan", hand_plan(tmp_path), "--out", str(tmp_path / "o")
    )
    assert code == 0 and "4 intervals of 5 steps" in printed
    assert "replaying the first 20 of 22 rows" in caplog.text


def test_a_run_without_migration_takes_the_users_intervals(tmp_path, capsys):
    trace = _run_dir(tmp_path, migrate_every=0, trace_every=2, steps=40)
    args = ["--trace", trace, "--plan", hand_plan(tmp_path), "--out", str(tmp_path / "o")]
    code, printed, _ = _migrate(capsys, *args, "--rows-per-interval", "4")
    assert code == 0 and "5 intervals of 8 steps" in printed  # 4 rows of 2 steps each


def test_policies_see_the_rows_the_runs_policy_saw(tmp_path, capsys):
    """A 40-step interval: the run's policy saw 20 rows of 2 steps (run.json's
    migrate_rows_per_interval), so the replay sums the per-step trace in pairs."""
    record = {"migrate_every": 40, "migrate_rows_per_interval": 20}
    trace = _run_dir(tmp_path, steps=160, rows=160, seed=0, **record)
    plan = hand_plan(tmp_path)
    code, printed, _ = _migrate(
        capsys, "--trace", trace, "--plan", plan, "--out", str(tmp_path / "a")
    )
    assert code == 0 and "4 intervals of 40 steps x 256 tokens per rank (40 trace rows" in printed
    # the same replays without a run.json: the trace summed in pairs, and per step
    for name, pair in (("pairs", 2), ("steps", 1)):
        (tmp_path / name).mkdir()
        path = tmp_path / name / "trace.csv"
        path.write_text(trace_to_csv(interval_trace(load_trace(trace), pair)))
        flags = ["--rows-per-interval", str(40 // pair), "--steps-per-interval", "40"]
        args = ["--trace", str(path), "--plan", plan, *flags, "--out", str(tmp_path / name / "o")]
        assert _migrate(capsys, *args)[0] == 0
    placements = {
        name: (tmp_path / name / "placements.csv").read_bytes()
        for name in ("a", "pairs/o", "steps/o")
    }
    assert placements["a"] == placements["pairs/o"] != placements["steps/o"]


@pytest.mark.parametrize(
    "text, needle",
    [
        ('{"ep": 2, "ep": 4}', "key 'ep' is given twice"),
        ("[" * 100_000, "not the run.json 'piper run' writes (too deep or long)"),
        ('{"ep": 1' + "0" * 5000 + "}", "not the run.json 'piper run' writes (too deep or long)"),
    ],
)
def test_a_run_json_that_json_cannot_hold_is_one_line(tmp_path, text, needle):
    from planner.migration.recorded import load_run_record
    from planner.specs import SpecError

    (tmp_path / "run.json").write_text(text)
    with pytest.raises(SpecError) as err:
        load_run_record(str(tmp_path / "trace.csv"))
    assert needle in str(err.value) and "\n" not in str(err.value)
