"""`piper export --target`: the engine the export is checked against; a plan priced for another
engine is one line, exit 2, nothing written."""

from __future__ import annotations

from dataclasses import replace

from planner.cli import main
from tests.planner.outputs.export_plans import make_plan, priced_for


def _write(tmp_path, engine):
    path = tmp_path / f"{engine}.json"
    plan = make_plan()
    if engine == "torchtitan":
        plan = replace(plan, training={**plan.training, "fsdp": True})
    path.write_text(priced_for(plan, engine).to_json())
    return path


def test_target_selects_the_slurm_trainer_and_is_checked(tmp_path, capsys):
    mega, titan = _write(tmp_path, "megatron"), _write(tmp_path, "torchtitan")
    out = tmp_path / "job.sbatch"
    assert main(["export", str(mega), "--to", "slurm", "--target", "megatron",
                 "--args-file", "/x/megatron_args.sh", "--out", str(out)]) == 0  # fmt: skip
    assert "/x/megatron_args.sh" in out.read_text()
    assert main(["export", str(titan), "--to", "torchtitan", "--target", "torchtitan",
                 "--out", str(tmp_path / "titan" / "torchtitan_args.sh")]) == 0  # fmt: skip
    capsys.readouterr()
    bad = tmp_path / "bad.sh"
    assert main(["export", str(mega), "--to", "torchtitan", "--out", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "re-plan with --target torchtitan" in err
    assert not bad.exists()
    assert main(["export", str(mega), "--to", "megatron", "--target", "torchtitan"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("give --target megatron or --to torchtitan")
