"""`piper plan --cluster a,b`: the same model and global batch planned on each cluster into its
own folder, and one row per cluster side by side (planner/outputs/cross.py)."""

from __future__ import annotations

import json

import pytest

from planner.outputs.cross import cluster_names, cross_cells, failed_row, folder
from planner.specs import SpecError
from tests.hardening_cli import run_piper

TINY = ["--model", "tiny-moe", "--gpus", "4", "--seq-len", "128", "--global-batch", "16",
        "--no-plots"]  # fmt: skip


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A one-node H100 cluster file written by `piper cluster init`."""
    path = tmp_path_factory.mktemp("lab") / "lab.yaml"
    res = run_piper(["cluster", "init", "--gpu", "H100", "--nodes", "1", "--name", "lab",
                     "--out", str(path)])  # fmt: skip
    assert res.code == 0, res.stderr
    return path


def test_json_has_one_row_per_cluster_with_its_own_plan(tmp_path, lab):
    res = run_piper(["plan", *TINY, "--cluster", f"cpu-gloo,{lab}", "--out", str(tmp_path),
                     "--json"])  # fmt: skip
    assert res.code == 0, res.stderr
    rows = json.loads(res.stdout)
    assert [r["cluster"] for r in rows] == ["cpu-gloo", str(lab)]
    for row, sub, gpn in zip(rows, ("cpu-gloo", "lab"), (2, 8), strict=True):
        assert row["out"] == f"{tmp_path}/{sub}" and (tmp_path / sub / "plan.json").exists()
        plan = json.loads((tmp_path / sub / "plan.json").read_text())
        tokens = row["tokens_per_s"]
        assert tokens["mid"] == pytest.approx(plan["predicted"]["tokens_per_s"], rel=1e-6)
        assert tokens["lo"] < tokens["mid"] < tokens["hi"]
        assert (row["gpus"], row["gpus_per_node"]) == (4, gpn)
        assert row["tokens_per_s_per_gpu"]["mid"] == pytest.approx(tokens["mid"] / 4)
        assert row["tokens_per_s_per_node"]["hi"] == pytest.approx(tokens["hi"] / 4 * gpn)
        memory = max(plan["predicted"]["memory_gib_per_stage"])
        assert row["memory_gib"]["mid"] == pytest.approx(memory, rel=1e-6)
        assert row["layout"].startswith(f"pp={plan['parallel']['pp']} ")
    # the same model and batch on both: the H100 out-runs the CPU emulation
    assert rows[1]["tokens_per_s"]["mid"] > 10 * rows[0]["tokens_per_s"]["mid"]


def test_the_table_has_one_row_per_cluster_within_100_columns(tmp_path, lab):
    res = run_piper(["plan", *TINY, "--cluster", f"cpu-gloo,{lab}", "--out", str(tmp_path)])
    assert res.code == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "tiny-moe side by side: each figure predicted, its 80% interval in brackets"
    assert lines[1].split() == ["cluster", "tokens/s", "per", "GPU", "per", "node", "memory",
                                "GiB", "layout"]  # fmt: skip
    firsts = [line.split()[0] for line in lines[3:-1] if line[:1].strip()]
    assert firsts == ["cpu-gloo", "4", "lab", "4"]  # a row: the cluster, then its GPUs below
    assert all(len(line) <= 100 for line in lines)
    assert lines[-1] == f"wrote {tmp_path}/ (cpu-gloo, lab)"


def test_a_cluster_without_a_plan_keeps_its_row_with_the_reason():
    cells = cross_cells([failed_row("h100", "out/h100", "plan: x cannot fit on 8 GPUs")])
    assert cells == [["h100", "", "", "", "", "no plan: plan: x cannot fit on 8 GPUs"]]


def test_an_unknown_cluster_is_refused_before_any_plan(tmp_path):
    res = run_piper(["plan", *TINY, "--cluster", "cpu-gloo,nosuch", "--out", str(tmp_path)])
    assert res.code == 2 and len(res.err_lines) == 1 and "'nosuch'" in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_cluster_lists():
    assert cluster_names("b200, gb200-nvl72,x/lab.yaml") == ["b200", "gb200-nvl72", "x/lab.yaml"]
    assert folder("x/lab.yaml") == "lab" and folder("mi355x") == "mi355x"
    with pytest.raises(SpecError, match="lists b200 twice"):
        cluster_names("b200,b200")
    with pytest.raises(SpecError, match="empty name"):
        cluster_names("b200,,h100")
