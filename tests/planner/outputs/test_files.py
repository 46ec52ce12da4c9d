"""planner.outputs.files: a write that fails names the file the user asked for, never the
temporary sibling it goes through, and leaves nothing behind."""

from __future__ import annotations

import pytest

from planner.cli import main
from planner.outputs.files import write_atomic, write_files
from planner.specs import SpecError


def test_write_atomic_to_a_folder_names_the_folder(tmp_path):
    folder = tmp_path / "results"
    folder.mkdir()
    with pytest.raises(SpecError, match=f"{folder}: a folder is in the way"):
        write_atomic(folder, "x")
    assert list(folder.iterdir()) == [] and sorted(p.name for p in tmp_path.iterdir()) == [
        "results"
    ]


def test_write_atomic_where_the_parent_is_a_file_names_the_parent(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(OSError) as err:
        write_atomic(blocker / "out.sh", "x")
    assert err.value.filename == str(blocker)


def test_export_to_a_folder_is_one_line_naming_it(tmp_path, capsys):
    plan = tmp_path / "plan"
    assert main(["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "2",
                 "--seq-len", "64", "--global-batch", "8", "--target", "piper", "--out",
                 str(plan)]) == 0  # fmt: skip
    capsys.readouterr()
    assert main(["export", str(plan / "plan.json"), "--to", "slurm", "--out", str(plan)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (
        f"piper export: error: {plan}: a folder is in the way of the file this command writes; "
        "move it or choose another output path"
    )
    assert not [p for p in plan.iterdir() if p.name.endswith(".tmp")]


def test_a_result_set_with_a_folder_in_the_way_writes_nothing(tmp_path):
    """`piper plan --out o` where o/plan.json is a folder: refused before any file of the set
    is replaced or any temporary is left."""
    out = tmp_path / "o"
    (out / "plan.json").mkdir(parents=True)
    (out / "a.csv").write_text("old")
    with pytest.raises(SpecError, match="plan.json: a folder is in the way"):
        write_files(out, {"a.csv": "new", "plan.json": "{}", "z.csv": "new"})
    assert sorted(p.name for p in out.iterdir()) == ["a.csv", "plan.json"]
    assert (out / "a.csv").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
