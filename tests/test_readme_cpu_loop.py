"""The README's CPU loop as a new user runs it: every `piper ...` line of the block under "The
whole loop on a CPU", in order, in a fresh folder. The test reads the commands out of
README.md, so it breaks when the README drifts from what the commands do."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hardening_cli import REPO

CODE = "import sys; from planner.cli import main; sys.exit(main())"
HEADING = "The whole loop on a CPU"


def cpu_loop_commands(readme: str) -> list[list[str]]:
    """argv (after `piper`) of each command in the first bash block after HEADING."""
    if HEADING not in readme:
        raise AssertionError(f"README.md has no '{HEADING}' block")
    block = readme.split(HEADING, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in joined.splitlines() if line.startswith("piper ")]


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _run_dir(run_argv: list[str]) -> Path:
    """Where `piper run PLAN` writes: --out, else <plan dir>/run."""
    return Path(_flag(run_argv, "--out") or Path(run_argv[1]).parent / "run")


def _check_migrate(cwd: Path, argv: list[str], printed: str, run_argv: list[str]) -> None:
    """The replay prices the run's intervals and makes the moves the run made."""
    run_dir = cwd / _run_dir(run_argv)
    settings = json.loads((run_dir / "run.json").read_text())
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    run_moves = sum(line["migrated_experts"] for line in lines)
    intervals = settings["steps"] // settings["migrate_every"]
    assert settings["migrate_every"] > 0 and run_moves > 0, "the loop's run must migrate"
    if settings["migrate_every"] <= 20:  # the policy sees one row per step (runtime/train.py)
        assert settings["migrate_rows_per_interval"] == settings["migrate_every"]
    assert f"{settings['ep']} EP ranks, {intervals} intervals of " in printed
    assert f"of {settings['migrate_every']} steps" in printed
    out = cwd / _flag(argv, "--out")
    summary = {row["policy"]: row for row in json.loads((out / "summary.json").read_text())}
    assert summary["piper"]["experts_moved"] == run_moves
    assert len((out / "migrations.csv").read_text().splitlines()) == 1 + run_moves


def test_commands_are_read_from_the_readme():
    readme = "x\nThe whole loop on a CPU:\n\n```bash\npiper plan --a 1 \\\n  --b 2\necho no\n" \
        "piper run p.json\n```\n```bash\npiper export q\n```\n"  # fmt: skip
    assert cpu_loop_commands(readme) == [["plan", "--a", "1", "--b", "2"], ["run", "p.json"]]
    names = [c[0] for c in cpu_loop_commands((REPO / "README.md").read_text())]
    assert {"plan", "run", "migrate", "calibrate", "export"} <= set(names)
    assert names.index("run") < names.index("migrate")


@pytest.mark.slow
def test_readme_cpu_loop_runs_and_its_replay_matches_the_run(tmp_path):
    commands = cpu_loop_commands((REPO / "README.md").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    runs: dict[Path, list[str]] = {}  # run directory -> the `piper run` that wrote it
    checked = 0
    for argv in commands:
        proc = subprocess.run(
            [sys.executable, "-c", CODE, *argv], cwd=tmp_path, env=env, capture_output=True,
            text=True, timeout=900,
        )  # fmt: skip
        assert proc.returncode == 0, (argv, proc.stderr[-2000:])
        assert "Traceback" not in proc.stderr, (argv, proc.stderr[-2000:])
        if argv[0] == "plan":
            assert (tmp_path / _flag(argv, "--out") / "plan.json").is_file()
        elif argv[0] == "run":
            runs[_run_dir(argv)] = argv
            steps = int(_flag(argv, "--steps"))
            lines = (tmp_path / _run_dir(argv) / "metrics.jsonl").read_text().splitlines()
            assert len(lines) >= steps
            # the EP group spans emulated nodes: HALO's inter-node exchange runs
            assert any(json.loads(x)["bytes_by_kind"].get("dispatch_inter", 0) > 0 for x in lines)
        elif argv[0] == "migrate":
            trace_dir = Path(_flag(argv, "--trace")).parent  # the run that wrote the trace
            _check_migrate(tmp_path, argv, proc.stdout, runs[trace_dir])
            checked += 1
        elif argv[0] == "calibrate":
            assert any((tmp_path / _flag(argv, "--out")).iterdir())
        elif argv[0] == "export":
            assert proc.stdout.strip() or proc.stderr.strip()
    assert checked == 1
