"""A checkpoint from elsewhere is data: a crafted `.metadata` runs nothing and is refused and
set aside; a finished save is in place within a step of its write completing, so a run
killed then resumes from it; SIGTERM stops every rank after one step with the save in
flight finished and the metrics kept; a full disk is one line and the run's files are
still written."""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import shutil
import signal
import time

import pytest
import torch
from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StorageInfo
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, MetadataIndex

from planner.run.checkpoint_dir import MANIFEST, checkpoints, problem, step_dir, tmp_dir
from runtime.checkpoint import CheckpointOptions
from runtime.checkpoint_safety import metadata_problem
from runtime.data import load_corpus
from runtime.launch import build_trainer  # imported here, not in each forked rank: fast
from runtime.train import train
from tests.runtime.conftest import run_distributed
from tests.runtime.tiny_plans import tiny_spec

pytestmark = pytest.mark.slow  # 2-rank runs of 4-8 steps, a few seconds each


def _spec(steps: int):
    return tiny_spec(pp=1, dp=2, ep=2, ranks_per_node=2, steps=steps, layers=3)


def _body(rank, world, spec, options, hook=None, metrics=None):
    """Train with checkpoints; (losses, files, newest checkpoint, logged lines)."""
    logged: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: logged.append(record.getMessage())
    logging.getLogger("runtime").addHandler(handler)
    trainer = build_trainer(spec, rank)
    if hook is not None:
        hook(trainer, rank)
    saves = CheckpointOptions(*options)
    r = train(trainer, checkpoints=saves, metrics_path=metrics if rank == 0 else None)
    return r.losses, r.files, str(r.checkpoint), logged


class _Run:
    """Pickles as a call of os.system(cmd): what a crafted checkpoint would run."""

    def __init__(self, cmd: str) -> None:
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


def _reseal(path) -> None:
    """Rewrite the manifest for the folder's files, as whoever crafted them would."""
    manifest = json.loads((path / MANIFEST).read_text())
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name != MANIFEST)
    manifest["files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files}
    (path / MANIFEST).write_text(json.dumps(manifest))


def _craft(path, form: str, marker) -> str:
    """Make the checkpoint at `path` run `touch marker` when read; the expected refusal."""
    meta = path / ".metadata"
    md = pickle.loads(meta.read_bytes())  # our own file: plain pickle is fine here
    if form == "pickle":  # the index itself runs it, then is the real metadata
        md.planner_data["payload"] = _Run(f"touch {marker}")
        why = ".metadata names posix.system, not a checkpoint class"
    else:  # a weight declared as bytes: DCP would torch.load it with weights_only=False
        key = sorted(k for k in md.state_dict_metadata if k.startswith("model."))[0]
        torch.save(_Run(f"touch {marker}"), path / "payload.distcp")
        size = (path / "payload.distcp").stat().st_size
        md.state_dict_metadata[key] = BytesStorageMetadata()
        md.storage_data[MetadataIndex(key)] = _StorageInfo("payload.distcp", 0, size)
        why = f".metadata declares {key} as bytes, not tensor storage"
    meta.write_bytes(pickle.dumps(md))
    _reseal(path)
    return why


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Checkpoints after 2 and 4 steps of a 2-rank run."""
    load_corpus()
    root = tmp_path_factory.mktemp("saved")
    run_distributed(_body, 2, _spec(4), (str(root), 2), timeout_s=120)
    assert [p.name for p in checkpoints(root)] == ["step-000004", "step-000002"]
    return root


@pytest.mark.parametrize("form", ["pickle", "bytes"])
def test_a_crafted_metadata_runs_nothing_and_is_refused_and_set_aside(saved, tmp_path, form):
    root, marker = tmp_path / "ckpt", tmp_path / "marker"
    shutil.copytree(saved, root)
    why = _craft(step_dir(root, 4), form, marker)
    assert problem(step_dir(root, 4)) is None  # the manifest matches: it cannot tell
    assert metadata_problem(step_dir(root, 4)) == why
    if form == "bytes":  # a storage file linked to one outside is no file of the checkpoint
        victim = step_dir(root, 4) / "payload.distcp"
        victim.rename(tmp_path / "payload")
        victim.symlink_to(tmp_path / "payload")
        assert metadata_problem(step_dir(root, 4)) == (
            "payload.distcp is a symbolic link, not a file of the checkpoint"
        )
        victim.unlink()
        (tmp_path / "payload").rename(victim)
    out = run_distributed(_body, 2, _spec(6), (str(root), 0, True), timeout_s=120)
    assert not marker.exists()  # nothing ran, on either rank
    aside = root / "refused-step-000004"
    assert aside.is_dir() and not step_dir(root, 4).exists()
    refusal = f"checkpoint {step_dir(root, 4)} refused: {why}; trying the one before; "
    assert f"{refusal}set aside as {aside}" in out[0][3]
    assert len(out[0][0]) == 4  # resumed from step 2: steps 2..5 were run
    assert checkpoints(root) == [step_dir(root, 6), step_dir(root, 2)]


def _pause_then(at_step: int, wait_for, then):
    """A hook: before step `at_step`, wait until `wait_for` exists, then call `then()`."""

    def hook(trainer, rank):
        step = trainer.step

        def wrapped(i, *args):
            if i == at_step:
                deadline = time.monotonic() + 60
                while not wait_for.exists() and time.monotonic() < deadline:
                    time.sleep(0.01)
                then(rank)
            return step(i, *args)

        trainer.step = wrapped

    return hook


def test_a_written_save_is_in_place_within_a_step_so_a_killed_run_resumes_from_it(tmp_path):
    """Checkpoint every 3 steps, SIGKILL after step 4 (index 4) finished and the step-3
    write completed: step-000003 is in place and intact."""
    load_corpus()
    root = tmp_path / "ckpt"
    written = tmp_dir(root, 3) / ".metadata"
    settle = _pause_then(4, written, lambda rank: time.sleep(0.3))  # the write's last bytes

    def hook(trainer, rank):
        settle(trainer, rank)
        step = trainer.step

        def kill_at_5(i, *args):
            if i == 5:
                os.kill(os.getpid(), signal.SIGKILL)
            return step(i, *args)

        trainer.step = kill_at_5

    with pytest.raises(RuntimeError, match="exited with code -9"):
        run_distributed(_body, 2, _spec(8), (str(root), 3), hook, timeout_s=120)
    assert checkpoints(root) == [step_dir(root, 3)] and problem(step_dir(root, 3)) is None
    assert not tmp_dir(root, 3).exists()
    out = run_distributed(_body, 2, _spec(8), (str(root), 3, True), timeout_s=120)
    assert len(out[0][0]) == 5  # steps 3..7


def test_sigterm_stops_every_rank_after_one_step_with_the_save_finished(tmp_path):
    """SIGTERM to rank 1 alone before step 3 (index 3): both ranks stop after it; the save
    begun after it (every 2) is finished and in place; metrics.jsonl has the 4 steps."""
    load_corpus()
    root, metrics = tmp_path / "ckpt", tmp_path / "out" / "metrics.jsonl"

    def term(rank):
        if rank == 1:
            os.kill(os.getpid(), signal.SIGTERM)

    hook = _pause_then(3, tmp_path, term)
    out = run_distributed(_body, 2, _spec(10), (str(root), 2), hook, metrics, timeout_s=120)
    assert [len(r[0]) for r in out] == [4, 4]
    assert [json.loads(x)["step"] for x in metrics.read_text().splitlines()] == [0, 1, 2, 3]
    assert metrics.read_text() == out[0][1]["metrics.jsonl"]
    assert checkpoints(root) == [step_dir(root, 4), step_dir(root, 2)]
    assert problem(step_dir(root, 4)) is None and out[0][2] == str(step_dir(root, 4))
    assert "stopped by SIGTERM after step 3" in out[0][3]


def test_a_full_disk_is_one_line_at_its_step_and_the_run_still_ends_with_its_files(
    tmp_path, monkeypatch
):
    load_corpus()
    root, metrics = tmp_path / "ckpt", tmp_path / "out" / "metrics.jsonl"

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(FileSystemWriter, "write_data", full)  # inherited by the forked ranks
    out = run_distributed(_body, 2, _spec(4), (str(root), 2), None, metrics, timeout_s=120)
    assert [len(r[0]) for r in out] == [4, 4]  # every step ran
    failed = [x for x in out[0][3] if "failed" in x]
    assert failed == [
        f"checkpoint save to {root} failed at step {n}: No space left on device; training "
        "goes on (newest checkpoint: none)"
        for n in (2, 4)
    ]
    assert out[1][3] == []  # rank 0 alone says it
    assert out[0][2] == "None" and checkpoints(root) == []
    assert not tmp_dir(root, 2).exists() and not tmp_dir(root, 4).exists()
    assert (
        len(out[0][1]["metrics.jsonl"].splitlines()) == 4 == len(metrics.read_text().splitlines())
    )


def test_a_fresh_run_leaves_another_runs_checkpoints_alone_unless_forced(saved, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    with pytest.raises(RuntimeError, match="SystemExit: 2"):
        run_distributed(_body, 2, _spec(4), (str(root), 2), timeout_s=120)
    assert [p.name for p in checkpoints(root)] == ["step-000004", "step-000002"]
    assert all(problem(p) is None for p in checkpoints(root))  # untouched
    out = run_distributed(_body, 2, _spec(2), (str(root), 0, False, True), timeout_s=120)
    aside = [root / "replaced-step-000004", root / "replaced-step-000002"]
    assert [f"checkpoint {step_dir(root, n)} of another run set aside as {a}"
            for n, a in zip((4, 2), aside, strict=True)] == out[0][3][:2]  # fmt: skip
    assert checkpoints(root) == [step_dir(root, 2)] and all(a.is_dir() for a in aside)
