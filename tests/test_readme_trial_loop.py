"""The README's trial loop on a CPU as a new user runs it: every line of the bash block under
"The trial loop on a CPU", in order, in a fresh folder (`piper ...` through a `piper` on PATH,
`bash ...` as written). The loop profiles the machine, then must end with a fitted profile that
names the trial runs and a re-plan made with it, or (a machine busy with other work while it
ran) with collect.sh's one-line refusal and nothing fitted."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from tests.hardening_cli import REPO

HEADING = "The trial loop on a CPU"


def trial_loop_commands(readme: str) -> list[list[str]]:
    """argv of each command line in the first bash block after HEADING."""
    if HEADING not in readme:
        raise AssertionError(f"README.md has no '{HEADING}' block")
    block = readme.split(HEADING, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    return [shlex.split(line) for line in block.replace("\\\n", " ").splitlines() if line]


def _plan_of(commands: list[list[str]]) -> list[str]:
    return next(c for c in commands if c[:2] == ["piper", "plan"])


def test_the_block_is_profile_plan_run_all_collect():
    commands = trial_loop_commands((REPO / "README.md").read_text())
    assert [c[:2] for c in commands[:2]] == [["piper", "profile"], ["piper", "plan"]]
    profile = commands[0][commands[0].index("--out") + 1]
    plan = commands[1]
    assert "--shortlist" in plan and plan[plan.index("--cluster") + 1] == profile
    out = plan[plan.index("--out") + 1]
    assert commands[2:] == [["bash", f"{out}/shortlist/run_all.sh"],
                            ["bash", f"{out}/shortlist/collect.sh"]]  # fmt: skip


@pytest.mark.slow
def test_readme_trial_loop_runs_end_to_end(tmp_path):
    commands = trial_loop_commands((REPO / "README.md").read_text())
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    piper = bin_dir / "piper"  # the checkout's CLI, whatever piper the machine has installed
    code = "import sys; from planner.cli import main; sys.exit(main())"
    piper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(code)} "$@"\n')
    piper.chmod(0o755)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
           "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    work = tmp_path / "work"
    work.mkdir()
    for argv in commands:
        proc = subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True,
                              timeout=900)  # fmt: skip
        assert "Traceback" not in proc.stderr, (argv, proc.stderr[-3000:])
        if proc.returncode != 0 and argv[-1].endswith("collect.sh"):
            refused = proc  # a machine busy with other tests can leave the trials far off
            break
        assert proc.returncode == 0, (argv, proc.stderr[-3000:])
    else:
        refused = None
    plan = _plan_of(commands)
    out = work / plan[plan.index("--out") + 1]
    steps = int(plan[plan.index("--trial-steps") + 1])
    trials = sorted(p for p in (out / "shortlist").iterdir() if p.is_dir() and p.name[0].isdigit())
    k = int(plan[plan.index("--shortlist") + 1])
    assert len(trials) == k
    for t in trials:
        assert len((t / "run" / "metrics.jsonl").read_text().splitlines()) >= steps
    if refused is not None:  # one line naming the measured profile, nothing fitted or planned
        line = refused.stderr.strip().splitlines()[-1]
        assert refused.returncode == 2 and "does not describe the machine" in line, line
        assert "re-measure it with 'piper profile'" in line
        assert not (out / "shortlist" / "fitted.yaml").exists()
        assert not (out / "shortlist" / "replan").exists()
        return
    fitted = yaml.safe_load((out / "shortlist" / "fitted.yaml").read_text())
    logged = [v for key, v in fitted["calibration"].items() if re.fullmatch(r"run_\d+", key)]
    assert len(logged) == k and all(any(t.name in str(v) for v in logged) for t in trials)
    replan = out / "shortlist" / "replan" / "plan.json"
    assert replan.is_file() and "-fitted" in replan.read_text()
