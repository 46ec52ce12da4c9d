"""The processes of `piper run` live and die together: kill -9 of torchrun or of `piper run`
leaves no training process behind, a SIGTERM stops the run with Piper's line alone, and after
a Ctrl-C `piper run` lets torchrun finish its stop before it exits.

Real processes (2 gloo ranks, tiny-moe), found by the unique --out path in their command
lines; every wait is bounded and anything left is killed in a finally.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import planner.cli.run as run_cli
from planner.inputs.models import load_model, model_config
from planner.plan import ModelEntry
from planner.run.options import TORCHRUN_MODULE
from tests.hardening_cli import REPO
from tests.runtime.tiny_plans import hand_plan

CODE = "import sys; from planner.cli import main; sys.exit(main())"
START_S = 120.0  # for the first step: torch imports on a shared 2-core machine
GONE_S = 20.0  # for killed processes to disappear


@pytest.fixture(scope="module")
def plan_path(tmp_path_factory) -> Path:
    """A 2-process plan of tiny-moe (dp = ep = 2, one emulated node)."""
    model = load_model("tiny-moe")
    entry = ModelEntry("tiny-moe", model.source, model_config(model))
    plan = hand_plan(model, 1, 2, 2, 2, 2, seq_len=64, gpus_per_node=2, model_entry=entry)
    path = tmp_path_factory.mktemp("lifetime") / "plan.json"
    path.write_text(plan.to_json())
    return path


def live_processes(marker: str, role: str = "") -> dict[int, str]:
    """pid -> command line of the live (not zombie) processes whose command line holds
    `marker` and `role`."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue  # gone meanwhile
        if state != "Z" and marker in cmdline and role in cmdline:
            found[int(entry.name)] = cmdline
    return found


def workers(marker: str) -> dict[int, str]:
    """The training processes of the run (torchrun's command line names their module too)."""
    launched = live_processes(marker, "runtime.launch")
    return {pid: c for pid, c in launched.items() if TORCHRUN_MODULE not in c}


def wait_gone(find, timeout_s: float = GONE_S) -> dict[int, str]:
    """What `find()` still finds after `timeout_s` ({} as soon as it finds nothing)."""
    end = time.monotonic() + timeout_s
    while (left := find()) and time.monotonic() < end:
        time.sleep(0.2)
    return left


@contextlib.contextmanager
def training(plan: Path, out: Path):
    """`piper run PLAN --out OUT` as a process, yielded (with its stderr file) once rank 0
    has printed a step; afterwards every process of the run is SIGKILLed."""
    err = out.parent / "stderr.txt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    argv = [sys.executable, "-c", CODE, "run", str(plan), "--steps", "100000", "--out", str(out)]
    with open(err, "wb") as stderr:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO)
    try:
        end = time.monotonic() + START_S
        while b"step_time" not in err.read_bytes():
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < end, f"no step in {START_S} s: {err.read_text()}"
            time.sleep(0.2)
        yield proc, err
    finally:
        for pid in live_processes(str(out)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=GONE_S)


@pytest.mark.slow
def test_kill_9_of_torchrun_leaves_no_training_process(plan_path, tmp_path):
    out = tmp_path / "run"
    with training(plan_path, out) as (proc, err):
        assert len(workers(str(out))) == 2
        (torchrun,) = live_processes(str(out), TORCHRUN_MODULE)
        os.kill(torchrun, signal.SIGKILL)
        assert wait_gone(lambda: workers(str(out))) == {}
        assert proc.wait(timeout=GONE_S) == 1
        assert "piper run: training failed (torchrun exit -9)" in err.read_text()


@pytest.mark.slow
def test_kill_9_of_piper_run_leaves_neither_torchrun_nor_a_training_process(plan_path, tmp_path):
    out = tmp_path / "run"
    with training(plan_path, out) as (proc, _):
        assert len(live_processes(str(out), TORCHRUN_MODULE)) == 1
        proc.kill()
        assert proc.wait(timeout=GONE_S) == -signal.SIGKILL
        assert wait_gone(lambda: live_processes(str(out))) == {}


@pytest.mark.slow
def test_a_sigterm_stops_the_run_with_piper_s_line_alone(plan_path, tmp_path):
    """torchrun's traceback and warnings of the stop are not printed (rank 0's own lines
    are); Piper's line ends the output; nothing is left."""
    out = tmp_path / "run"
    with training(plan_path, out) as (proc, err):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 128 + signal.SIGTERM
        assert wait_gone(lambda: live_processes(str(out))) == {}
    printed = err.read_text()
    for torchrun_says in ("Traceback", "SignalException", "death signal", "closing signal"):
        assert torchrun_says not in printed
    assert printed.splitlines()[-1].startswith("piper run: stopped by SIGTERM after ")


def test_a_process_whose_parent_is_already_gone_ends_at_once():
    """The race: the parent died before the request to die with it took hold."""
    code = "from planner.run.options import die_with_parent; die_with_parent(1); print('alive')"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert (proc.returncode, proc.stdout) == (128 + signal.SIGKILL, "")


def test_a_process_dies_with_its_parent_killed_by_sigkill(tmp_path):
    """die_with_parent in a child of a child: kill -9 of the middle one ends the last."""
    ready, marker = tmp_path / "ready", f"lifetime-{tmp_path.name}"
    child = (
        "import os, sys, time; from planner.run.options import die_with_parent; "
        "die_with_parent(os.getppid()); open(sys.argv[1], 'w').close(); time.sleep(60)"
    )
    parent = "import subprocess, sys, time; subprocess.Popen(sys.argv[1:]); time.sleep(60)"
    argv = [sys.executable, "-c", parent, sys.executable, "-c", child, str(ready), marker]
    proc = subprocess.Popen(argv, cwd=REPO)
    try:
        end = time.monotonic() + 30
        while not ready.exists():
            assert time.monotonic() < end and proc.poll() is None
            time.sleep(0.05)
        proc.kill()
        proc.wait(timeout=GONE_S)
        assert wait_gone(lambda: live_processes(marker, "die_with_parent")) == {}
    finally:
        for pid in live_processes(marker):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
        proc.wait(timeout=GONE_S)


def test_after_a_ctrl_c_piper_run_waits_for_torchrun_to_stop_its_processes(tmp_path):
    """Ctrl-C reaches torchrun and `piper run` (one process group); `piper run` raises only
    once torchrun has stopped: torchrun dies with it, and would cut its stop short."""
    child = tmp_path / "torchrun_stand_in.py"
    child.write_text(
        "import signal, sys, time\n"
        "def stop(*_):\n"
        "    time.sleep(1)\n"
        "    open(sys.argv[1], 'w').write('stopped')\n"
        "    sys.exit(130)\n"
        "signal.signal(signal.SIGINT, stop)\n"
        "open(sys.argv[1] + '.ready', 'w').write('')\n"
        "time.sleep(60)\n"
    )
    marker = tmp_path / "marker"
    cmd = [sys.executable, str(child), str(marker)]

    def ctrl_c_when_ready():
        for _ in range(400):  # the stand-in's handler is installed before it says ready
            if (tmp_path / "marker.ready").exists():
                break
            time.sleep(0.05)
        (pid,) = live_processes(str(marker), "torchrun_stand_in")
        os.kill(pid, signal.SIGINT)
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=ctrl_c_when_ready, daemon=True).start()
    with pytest.raises(KeyboardInterrupt):
        run_cli._train(cmd, dict(os.environ), tmp_path, 1)
    assert marker.read_text() == "stopped"
    assert live_processes(str(marker)) == {}
