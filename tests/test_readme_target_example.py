"""The README's quickstart example with `--target`, as a new user runs it: the `piper ...`
commands of the block under "Plan for the engine you train with", in order, in a fresh folder;
the plan is made for the engine it names and its export carries every priced setting."""

from __future__ import annotations

import json
import shlex

import pytest

from planner.cli import main
from tests.hardening_cli import REPO

HEADING = "Plan for the engine you train with"


def target_example_commands() -> list[list[str]]:
    readme = (REPO / "README.md").read_text()
    assert HEADING in readme, f"README.md has no '{HEADING}' example"
    block = readme.split(HEADING, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    out = []
    for part in block.replace("\\\n", " ").replace("&&", "\n").splitlines():
        words = shlex.split(part)
        if words and words[0] == "piper":
            out.append(words[1:])
    return out


@pytest.mark.slow
def test_the_readme_target_example_plans_and_exports(tmp_path, monkeypatch, capsys):
    commands = target_example_commands()
    assert [c[0] for c in commands] == ["plan", "export"]
    target = commands[0][commands[0].index("--target") + 1]
    monkeypatch.chdir(tmp_path)
    for argv in commands:
        assert main(argv) == 0, argv
    plan_path = commands[1][1]
    plan = json.loads((tmp_path / plan_path).read_text())
    assert plan["extra"]["target"] == target
    export = tmp_path / commands[1][commands[1].index("--out") + 1]
    assert export.is_file() and "Traceback" not in capsys.readouterr().err
