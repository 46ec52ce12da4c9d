"""Files other tools and runs pass around are read only from regular files (planner/HARDENING.md,
"Hostile files"): a FIFO named as metrics.jsonl, RUNS.csv, run.json, a token file, its sidecar
or Megatron index, or a checkpoint's manifest or state is refused in one line instead of
waiting for a writer. Each reader runs in a child process with a timeout, so a reader that
blocks fails the test instead of hanging the suite."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from planner.calibrate import metrics
from planner.calibrate.metrics import load_metrics
from planner.specs import SpecError
from tests.hardening_cli import REPO, run_piper_process
from tests.planner.outputs.export_plans import make_plan

TIMEOUT_S = 60.0  # a child that imports planner and refuses the file takes about a second


def _refused_in_a_child(call: str, tmp_path: Path) -> str:
    """Run `call` (Python, with `tmp` the test's folder) in a child; it must raise SpecError
    within TIMEOUT_S. Returns the error's one line."""
    code = textwrap.dedent(f"""
        import sys
        from pathlib import Path
        from planner.specs import SpecError
        tmp = Path(sys.argv[1])
        try:
            {call}
        except SpecError as exc:
            print(exc, file=sys.stderr)
            sys.exit(2)
        print("read without an error", file=sys.stderr)
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)],
        capture_output=True, text=True, timeout=TIMEOUT_S, cwd=REPO, env=env,
    )  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    return lines[0]


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _tokens(path: Path, n: int = 64) -> None:
    np.arange(n, dtype=np.uint16).tofile(path)


def _checkpoint(tmp_path: Path, fifo_name: str) -> Path:
    """A step folder whose `fifo_name` (manifest.json or state.json) is a FIFO."""
    folder = tmp_path / "ckpt" / "step-000001"
    folder.mkdir(parents=True)
    if fifo_name != "manifest.json":
        (folder / "manifest.json").write_text(json.dumps({"step": 1, "files": {}}))
    _fifo(folder / fifo_name)
    return folder


# (id, the files to make in tmp (FIFO last), the reader's call, a word the line must hold)
CASES = [
    (
        "metrics.jsonl",
        lambda tmp: _fifo(tmp / "metrics.jsonl"),
        "from planner.calibrate.metrics import load_metrics; load_metrics(tmp / 'metrics.jsonl')",
        "metrics.jsonl: is a FIFO",
    ),
    (
        "RUNS.csv",
        lambda tmp: _fifo(tmp / "RUNS.csv"),
        "from planner.calibrate.runs import load_runs; load_runs(tmp / 'RUNS.csv')",
        "RUNS.csv: is a FIFO",
    ),
    (
        "run.json",
        lambda tmp: _fifo(tmp / "run.json"),
        "from planner.calibrate.run_settings import load_run_info; "
        "load_run_info(tmp / 'metrics.jsonl')",
        "run.json: is a FIFO",
    ),
    (
        "token-bin",
        lambda tmp: _fifo(tmp / "tokens.bin"),
        "from planner.run.token_data import open_token_file; open_token_file(str(tmp / 'tokens'))",
        "tokens.bin: is a FIFO",
    ),
    (
        "token-sidecar",
        lambda tmp: (_tokens(tmp / "tokens.bin"), _fifo(tmp / "tokens.json")),
        "from planner.run.token_data import open_token_file; open_token_file(str(tmp / 'tokens'))",
        "tokens.json: is a FIFO",
    ),
    (
        "megatron-index",
        lambda tmp: (_tokens(tmp / "tokens.bin"), _fifo(tmp / "tokens.idx")),
        "from planner.run.token_data import open_token_file; open_token_file(str(tmp / 'tokens'))",
        "tokens.idx: is a FIFO",
    ),
    (
        "checkpoint-manifest",
        lambda tmp: _checkpoint(tmp, "manifest.json"),
        "from planner.run.checkpoint_dir import problem; "
        "raise SpecError(problem(tmp / 'ckpt' / 'step-000001'))",
        "manifest.json missing or unreadable",
    ),
    (
        "checkpoint-state",
        lambda tmp: _checkpoint(tmp, "state.json"),
        "from planner.run.checkpoint_dir import read_state; "
        "read_state(tmp / 'ckpt' / 'step-000001')",
        "state.json: is a FIFO",
    ),
]


@pytest.mark.parametrize(
    ("make", "call", "expected"), [pytest.param(m, c, e, id=i) for i, m, c, e in CASES]
)
def test_a_fifo_named_as_a_run_file_is_refused_without_waiting(tmp_path, make, call, expected):
    make(tmp_path)
    assert expected in _refused_in_a_child(call, tmp_path)


def test_pruning_reads_no_fifo_state(tmp_path):
    """A checkpoint of the folder whose state.json is a FIFO has no run id for the pruning
    (it is another run's, kept), read without waiting."""
    _checkpoint(tmp_path, "state.json")
    line = _refused_in_a_child(
        "from planner.run.checkpoint_dir import _run_id; "
        "raise SpecError(repr(_run_id(tmp / 'ckpt' / 'step-000001')))",
        tmp_path,
    )
    assert line == "None"


def test_the_corpus_skips_a_fifo_among_its_sources(tmp_path):
    """The training corpus reads regular *.py files only: a FIFO among them is skipped."""
    (tmp_path / "src").mkdir()
    _fifo(tmp_path / "src" / "a.py")
    (tmp_path / "src" / "b.py").write_bytes(b"print('b')\n" * 10)
    line = _refused_in_a_child(
        "from runtime.data import corpus_bytes; "
        "raise SpecError(repr(corpus_bytes(tmp / 'src', 25)))",
        tmp_path,
    )
    assert line == repr((b"print('b')\n" * 10)[:25])


@pytest.mark.parametrize("which", ["metrics", "runs"])
def test_piper_calibrate_on_a_fifo_ends_in_one_line(tmp_path, which):
    (tmp_path / "plan.json").write_text(make_plan().to_json())
    fifo = _fifo(tmp_path / ("metrics.jsonl" if which == "metrics" else "RUNS.csv"))
    if which == "metrics":
        argv = ["calibrate", str(tmp_path / "plan.json"), str(fifo)]
    else:
        argv = ["calibrate", "--fit", str(fifo), "--cluster", "cpu-gloo", "--out",
                str(tmp_path / "fitted.yaml")]  # fmt: skip
    result = run_piper_process(argv, timeout_s=TIMEOUT_S)
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [line] = result.err_lines
    assert line.startswith("piper calibrate: error: ") and f"{fifo}: is a FIFO" in line
    assert not (tmp_path / "fitted.yaml").exists()


def test_a_metrics_line_past_the_bound_is_refused_unparsed(tmp_path, monkeypatch):
    """metrics.jsonl is streamed line by line; a line longer than MAX_LINE_BYTES (64 MiB:
    a 1,024-rank step is ~0.95 MB) is refused by number, the file never read whole."""
    assert metrics.MAX_LINE_BYTES == 64 * 2**20
    monkeypatch.setattr(metrics, "MAX_LINE_BYTES", 1000)
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n" + "x" * 5000 + "\n")
    with pytest.raises(SpecError, match=r"metrics.jsonl line 2: longer than 0 MiB"):
        load_metrics(path)
