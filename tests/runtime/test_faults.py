"""A rank SIGKILLed mid-run under torchrun's restart policy (`piper run --max-restarts 1`):
the restarted processes resume from the newest intact checkpoint and finish with the
single-device oracle's losses, every step recorded once."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from planner.calibrate.metrics import load_metrics
from planner.cli import main
from planner.inputs.models import load_model, model_config
from planner.plan import ModelEntry
from planner.run.checkpoint_dir import read_state, step_dir
from planner.run.spec import run_spec_from_plan
from runtime.data import load_corpus
from tests.runtime.tiny_plans import hand_plan, reference_losses


def _rank_pids(plan: str, rank: int) -> list[int]:
    """Pids of this test's runtime.launch processes (their command line names `plan`) that
    run process RANK `rank`."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if b"runtime.launch" in cmd and plan.encode() in cmd and f"RANK={rank}".encode() in env:
            found.append(int(proc.name))
    return found


def _kill_rank_once(plan: str, ready: Path, killed: list, timeout_s: float = 180.0) -> None:
    """Once checkpoint `ready` exists, SIGKILL process RANK 1 of the run of `plan`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready.is_dir():
            for pid in _rank_pids(plan, 1):
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            if killed:
                return
        time.sleep(0.05)


@pytest.mark.slow
def test_a_killed_rank_comes_back_from_the_last_checkpoint(tmp_path, capsys):
    load_corpus()
    model = load_model("tiny-moe")
    entry = ModelEntry("tiny-moe", model.source, model_config(model))
    plan = hand_plan(model, 1, 2, 2, micro_batch=2, num_microbatches=2, seq_len=32,
                     gpus_per_node=2, model_entry=entry)  # fmt: skip
    path, out, ckpt = tmp_path / "plan.json", tmp_path / "run", tmp_path / "ckpt"
    path.write_text(plan.to_json())
    killed: list[int] = []
    # step 2's checkpoint is renamed into place when step 4's starts: the kill lands a few
    # steps before the end, and the restart redoes the steps after the newest intact one
    killer = threading.Thread(target=_kill_rank_once, args=(str(path), step_dir(ckpt, 2), killed))
    killer.start()
    args = ["run", str(path), "--steps", "10", "--out", str(out), "--force"]
    args += ["--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--max-restarts", "1"]
    rc = main(args)
    killer.join()
    assert rc == 0, capsys.readouterr().err
    assert len(killed) == 1  # one process was killed, and the run still finished
    lines = load_metrics(out / "metrics.jsonl")
    assert [d["step"] for d in lines] == list(range(10))  # each step once
    spec = run_spec_from_plan(plan, model, 1.0, 2, steps=10)
    assert [d["loss"] for d in lines] == pytest.approx(reference_losses(spec), rel=1e-4, abs=1e-4)
    assert read_state(step_dir(ckpt, 10))["step"] == 10
