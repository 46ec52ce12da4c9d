"""planner/CLUSTERS.md's worked example as a user runs it: every `piper ...` line of the block
under "Worked example", in order, in a fresh folder, with tiny-moe in place of mixtral-8x7b and
no plots (a few seconds). The commands are read out of CLUSTERS.md, so the test breaks when the
document drifts from what the commands do."""

from __future__ import annotations

import json
import shlex

from planner.inputs.clusters import load_cluster
from tests.hardening_cli import REPO, run_piper

HEADING = "## Worked example: 64 nodes of B200"


def example_commands() -> list[list[str]]:
    """argv (after `piper`) of each command in the first bash block after HEADING."""
    text = (REPO / "planner" / "CLUSTERS.md").read_text()
    assert HEADING in text, f"planner/CLUSTERS.md has no '{HEADING}'"
    block = text.split(HEADING, 1)[1].split("```bash\n", 1)[1].split("```", 1)[0]
    joined = block.replace("\\\n", " ")
    return [shlex.split(line)[1:] for line in joined.splitlines() if line.startswith("piper ")]


def _quick(argv: list[str]) -> list[str]:
    argv = ["tiny-moe" if a == "mixtral-8x7b" else a for a in argv]
    return argv + ["--no-plots"] if argv[0] == "plan" else argv


def test_the_worked_example_describes_and_plans_64_b200_nodes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    commands = example_commands()
    assert [c[:2] for c in commands] == [["cluster", "init"], ["plan", "--model"],
                                         ["plan", "--model"]]  # fmt: skip
    init, plan, cross = (run_piper(_quick(c)) for c in commands)
    assert init.code == 0, init.stderr
    cluster = load_cluster("b200-64n.yaml")
    assert (cluster.num_nodes, cluster.total_gpus) == (64, 512)
    assert [(lv.devices, lv.bw_gbps) for lv in cluster.levels] == [(8, 900.0), (512, 50.0)]
    assert cluster.device == load_cluster("b200").device
    assert (tmp_path / "b200-64n.yaml").read_text().count("  # GUESS:") == 14  # as it says
    assert plan.code == 0, plan.stderr
    assert "tiny-moe on 512 GPUs of b200 (64 nodes)" in plan.stdout  # all of it, no --gpus
    assert json.loads((tmp_path / "results/b200-64n/plan.json").read_text())["ranks"]
    assert cross.code == 0, cross.stderr
    rows = [line.split()[0] for line in cross.stdout.splitlines()[3:] if line[:1].strip()]
    assert rows[:-1] == ["b200-64n", "64", "gb200-nvl72", "64", "mi355x", "64"]
    for sub in ("b200-64n", "gb200-nvl72", "mi355x"):
        assert (tmp_path / "results/cross" / sub / "plan.json").exists()
