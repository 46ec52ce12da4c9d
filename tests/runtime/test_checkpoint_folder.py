"""The checkpoint folder belongs to one run: only `step-NNNNNN` folders are checkpoints,
pruning deletes only the run's own, a second run is locked out, a fresh run does not take
over another run's folder without --force, a symbolic link is refused (nothing outside the
folder is written), and --resume refuses a checkpoint of another model config, --data or
--seed, naming what differs, while another layout of the same model resumes."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from planner.run.checkpoint_dir import (
    check_folder,
    checkpoints,
    finish,
    layout_of,
    lock_folder,
    model_of,
    prepare_folder,
    resume_point,
    run_record,
    step_dir,
    tmp_dir,
)
from planner.specs import SpecError
from tests.runtime.tiny_plans import tiny_spec


def _spec(steps: int = 10, **changes):
    return tiny_spec(pp=1, dp=2, ep=2, ranks_per_node=2, steps=steps, layers=3, **changes)


def _fake(root, step: int, run_id: str, spec=None, data=None):
    """A finished checkpoint (manifest, state.json) of run `run_id` with a stand-in index."""
    spec = spec or _spec()
    tmp = tmp_dir(root, step)
    tmp.mkdir(parents=True)
    (tmp / ".metadata").write_bytes(b"index")
    state = {"step": step, "model": model_of(spec), "layout": layout_of(spec)}
    return finish(tmp, step_dir(root, step), {**state, "run": run_record(spec, data, run_id)})


def test_only_exact_step_folders_count_and_pruning_keeps_other_runs(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    root = tmp_path / "ckpt"
    _fake(root, 2, "theirs")
    for name in ("step-best", "step-1", "step-0000010", "step-000009.bak"):
        (root / name).mkdir()
    (root / "step-000099").symlink_to(outside, target_is_directory=True)
    assert checkpoints(root) == [step_dir(root, 2)]
    for step in (4, 6, 8):
        _fake(root, step, "mine")
    # the newest two of this run; the other run's step 2 and every non-checkpoint stay
    assert checkpoints(root) == [step_dir(root, 8), step_dir(root, 6), step_dir(root, 2)]
    assert (root / "step-best").is_dir() and outside.is_dir()


def test_a_second_run_on_the_folder_is_locked_out(tmp_path):
    first = lock_folder(tmp_path)
    with pytest.raises(SpecError) as err:
        lock_folder(tmp_path)
    assert str(err.value) == (
        f"--checkpoint-dir {tmp_path} is in use by another run (it holds {tmp_path}/.lock); "
        "wait for it to end or use another folder"
    )
    _fake(tmp_path, 2, "running")
    with pytest.raises(SpecError, match="is in use by another run"):
        prepare_folder(tmp_path, resume=False, force=True)  # force takes nothing from it
    assert checkpoints(tmp_path) == [step_dir(tmp_path, 2)]
    os.close(first)
    os.close(lock_folder(tmp_path))  # free again once the first run let go


def test_a_fresh_run_refuses_another_runs_checkpoints_unless_forced(tmp_path):
    _fake(tmp_path, 4, "theirs")
    assert check_folder(tmp_path, resume=True, force=False) == []
    with pytest.raises(SpecError, match="holds checkpoints of another run .step-000004, 1 in all"):
        check_folder(tmp_path, resume=False, force=False)
    assert check_folder(tmp_path, resume=False, force=True) == [
        f"checkpoint {step_dir(tmp_path, 4)} of another run set aside as "
        f"{tmp_path / 'replaced-step-000004'}"
    ]
    assert checkpoints(tmp_path) == [] and (tmp_path / "replaced-step-000004").is_dir()


def test_a_symbolic_link_in_the_folder_is_refused_and_its_target_untouched(tmp_path):
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "keep.txt").write_text("mine")
    root = tmp_path / "ckpt"
    root.mkdir()
    tmp_dir(root, 2).symlink_to(victim, target_is_directory=True)
    for resume in (False, True):
        with pytest.raises(SpecError, match="holds a symbolic link .tmp-step-000002; remove it"):
            check_folder(root, resume=resume, force=True)
    assert [p.name for p in victim.iterdir()] == ["keep.txt"]


def test_resume_refuses_another_model_config_data_or_seed_naming_it(tmp_path):
    data = tmp_path / "tokens.bin"
    data.write_bytes(b"\0" * 64)
    _fake(tmp_path, 4, "run", _spec(), str(data))
    path = step_dir(tmp_path, 4)
    assert resume_point(str(tmp_path), _spec(), str(data))[:2] == (path, 4)
    # another layout of the same model: dp = 2, ep = 1
    other = tiny_spec(pp=1, dp=2, ep=1, ranks_per_node=2, steps=10, layers=3)
    assert resume_point(str(tmp_path), other, str(data))[:2] == (path, 4)
    spec = _spec()
    layers = list(spec.model.layers)
    layers[1] = replace(layers[1], moe=replace(layers[1].moe, top_k=1))
    top1 = replace(spec, model=replace(spec.model, layers=tuple(layers)))
    cases = [
        (_spec(seed=1), str(data), "seed 0 (this run: 1)"),
        (_spec(), None, f"data {{'bytes': 64, 'path': '{data}'}} (this run: None)"),
        (top1, str(data), "model config layers[1].moe.top_k 2 (this run: 1)"),
    ]
    for run, run_data, what in cases:
        with pytest.raises(SpecError) as err:
            resume_point(str(tmp_path), run, run_data)
        assert str(err.value).startswith(f"--resume: checkpoint {path} was written with {what}")
    data.write_bytes(b"\0" * 65)  # the same path, other contents
    with pytest.raises(SpecError, match="was written with data .'bytes': 64"):
        resume_point(str(tmp_path), _spec(), str(data))
    assert checkpoints(tmp_path) == [path]  # a refused resume renames nothing
