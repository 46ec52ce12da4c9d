"""Helpers for the hardening tests (issue 9): run `piper` in-process or as a process, and
make faulty copies of real input files (tiny-moe config, cpu-gloo cluster, a plan.json).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from planner.cli import build_parser, main
from planner.inputs.paths import CLUSTERS_DIR, MODELS_DIR

REPO = Path(__file__).resolve().parent.parent
BASE_MODEL = "tiny-moe"
BASE_CLUSTER = "cpu-gloo"


@dataclass(frozen=True)
class CliResult:
    code: int
    stdout: str
    stderr: str

    @property
    def err_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line.strip()]


def run_piper(argv: list[str]) -> CliResult:
    """`piper ARGV` in this process (fast); exceptions other than SystemExit propagate."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse errors
            code = exc.code if isinstance(exc.code, int) else 2
    return CliResult(int(code), out.getvalue(), err.getvalue())


def run_piper_process(argv: list[str], timeout_s: float = 120.0) -> CliResult:
    """`piper ARGV` as a child process (the real exit code, stdout and stderr)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", "import sys; from planner.cli import main; sys.exit(main())", *argv],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO,
        env=env,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def has_command(name: str) -> bool:
    """True when the `piper` CLI in this tree registers subcommand `name`."""
    parser = build_parser()
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    return any(name in a.choices for a in subs)


def base_model_config() -> dict[str, Any]:
    return json.loads((MODELS_DIR / f"{BASE_MODEL}.json").read_text())


def base_cluster_dict() -> dict[str, Any]:
    return yaml.safe_load((CLUSTERS_DIR / f"{BASE_CLUSTER}.yaml").read_text())


def mutated(base: dict[str, Any], change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    d = copy.deepcopy(base)
    change(d)
    return d


def snapshot(path: Path) -> dict[str, bytes] | None:
    """Every file under `path` with its bytes (None when `path` does not exist)."""
    if not path.exists():
        return None
    return {
        str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()
    }


def tmp_leftovers(path: Path) -> list[str]:
    """Temporary files an atomic write would leave behind if it were interrupted."""
    if not path.exists():
        return []
    return sorted(str(p) for p in path.rglob("*") if p.name.endswith(".tmp"))
