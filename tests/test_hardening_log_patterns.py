"""Training logs are parsed in time linear in their size (planner/HARDENING.md, "Hostile
files"): long runs of spaces or digits cannot make a field pattern backtrack, lines are
matched cut to MAX_LINE_CHARS, and a log that is not a bounded regular file is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from planner.calibrate import logs
from planner.calibrate.logs import parse_log, read_log
from planner.specs import SpecError
from tests.hardening_cli import REPO
from tests.planner.calibrate.engine_logs import megatron_log, titan_log

ARGS_END = "-------------------- end of arguments ---------------------"


def _padded_megatron_log(spaces: int, lines: int = 5) -> str:
    """A three-iteration Megatron-LM log with `lines` lines of `spaces` spaces in its arguments
    block (the shape that made `piper calibrate` take minutes)."""
    out = megatron_log([1.0, 1.1, 1.2]).splitlines()
    end = out.index(ARGS_END)
    out[end:end] = [" " * spaces] * lines
    return "\n".join(out) + "\n"


def test_five_lines_of_40000_spaces_parse_in_a_child_within_seconds():
    """Before the patterns were linear this took minutes (0.55 s for one line of 4,000
    spaces, growing with the square); the child is given 20 s, most of it start-up."""
    script = textwrap.dedent("""
        import json
        from planner.calibrate.logs import parse_log
        from tests.test_hardening_log_patterns import _padded_megatron_log
        log = parse_log(_padded_megatron_log(40_000), "train.log")
        print(json.dumps([dict(log.layout), [s.step_time_s for s in log.steps]]))
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=20, cwd=REPO, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    layout, times = json.loads(proc.stdout)
    assert layout == {"tp": 1, "pp": 2, "vp": 1, "cp": 1, "ep": 2, "etp": 1, "dp": 2,
                      "world": 4, "micro_batch": 1, "global_batch": 8, "seq_len": 64}  # fmt: skip
    assert times == pytest.approx([1.0, 1.1, 1.2])


def test_padding_inside_an_iteration_line_keeps_its_fields():
    text = megatron_log([1.0, 1.5]).replace(" | loss scale", " | " + " " * 5000 + "| loss scale")
    log = parse_log(text, "train.log")
    assert [s.step_time_s for s in log.steps] == pytest.approx([1.0, 1.5])
    assert [s.tflops_per_gpu for s in log.steps] == pytest.approx([12.5, 12.5])


def test_an_iteration_line_past_the_line_bound_is_one_line():
    pad = " " * logs.MAX_LINE_CHARS
    text = megatron_log([1.0, 1.5]).replace(" | loss scale", " | " + pad + "| loss scale")
    with pytest.raises(SpecError, match=f"longer than {logs.MAX_LINE_CHARS:,} characters"):
        parse_log(text, "train.log")


def test_memory_reports_and_oom_counts_with_long_runs_stay_linear():
    """Many '[Rank N] ' starts and a line of digits: each pattern scans the line once."""
    base = megatron_log([1.0, 1.5])
    noisy = base + "[Rank 0] " * 1500 + "\n" + "7" * 12_000 + "\n"
    log = parse_log(noisy, "train.log")
    assert log.peak_gib == pytest.approx(1536.0 / 1024)
    titan = titan_log([100.0, 110.0], [1.0, 2.0]) + "1" * 12_000 + " CUDA\n"
    assert [s.tokens_per_s_per_gpu for s in parse_log(titan, "t.log").steps] == [100.0, 110.0]


def test_a_log_that_is_a_fifo_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "train.log"
    os.mkfifo(fifo)
    with pytest.raises(SpecError, match="a FIFO"):
        read_log(fifo)
