"""The terminal output helpers: progress is silent off a terminal, tables print every cell."""

from __future__ import annotations

import os
import pty
import subprocess
import sys

from planner.outputs.console import print_table, progress
from tests.hardening_cli import REPO


def test_progress_is_silent_when_stderr_is_not_a_terminal(capsys):
    with progress("work", total=3) as update:
        for i in range(3):
            update(i + 1)
    out = capsys.readouterr()
    assert out.err == "" and out.out == ""


def test_progress_draws_a_bar_on_a_terminal():
    """With stderr a pseudo-terminal the bar shows its description and done/total."""
    master, slave = pty.openpty()
    code = ("import time; from planner.outputs.console import progress\n"
            "with progress('replaying', total=4) as update:\n"
            "    for i in range(4):\n        update(i + 1); time.sleep(0.2)\n")  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "100"}
    proc = subprocess.run([sys.executable, "-c", code], stderr=slave, env=env, timeout=60)
    os.close(slave)
    err = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        err += chunk
    os.close(master)
    assert proc.returncode == 0
    assert b"replaying" in err and b"/4" in err


def test_print_table_rows_and_alignment(capsys):
    print_table("policies", ("policy", "moved"), [("Piper", "12"), ("greedy swap", "3")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "policies"
    assert "policy" in lines[1] and "moved" in lines[1]
    body = [line for line in lines[3:] if line.strip()]
    assert body[0].startswith("Piper") and body[0].rstrip().endswith("12")
    assert body[1].rstrip().endswith(" 3")  # numbers right-aligned under their header
    assert len(body[0].rstrip()) == len(body[1].rstrip())
