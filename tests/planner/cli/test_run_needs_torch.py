"""`piper run` and `piper profile` on a Python without torch (the README's `pip install -e .`):
one line naming the install that fixes it, exit code 2, nothing started or written."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from planner.inputs.models import load_model, model_config
from planner.plan import ModelEntry
from planner.run.options import TORCH_INSTALL
from tests.hardening_cli import REPO
from tests.runtime.tiny_plans import hand_plan
from tests.test_readme_cpu_loop import HEADING

CODE = "import sys; from planner.cli import main; sys.exit(main())"


def piper_without_torch(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    """`piper ARGV` in a process where torch cannot be imported: a sitecustomize on PYTHONPATH
    (children inherit it) marks the module missing."""
    blocker = tmp_path / "no_torch"
    blocker.mkdir(exist_ok=True)
    (blocker / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{blocker}{os.pathsep}{REPO}"}
    return subprocess.run(
        [sys.executable, "-c", CODE, *argv],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_piper_run_without_torch_names_the_install_in_one_line(tmp_path):
    model = load_model("tiny-moe")
    entry = ModelEntry("tiny-moe", model.source, model_config(model))
    plan, out = tmp_path / "plan.json", tmp_path / "run"
    plan.write_text(hand_plan(model, 1, 2, 2, gpus_per_node=2, model_entry=entry).to_json())
    proc = piper_without_torch(tmp_path, "run", str(plan), "--steps", "1", "--out", str(out))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0] == (
        f"piper run: error: PyTorch is not installed for {sys.executable}; "
        f"install it with: {TORCH_INSTALL}"
    )
    assert proc.stdout == "" and not out.exists()


def test_piper_profile_without_torch_names_the_install_in_one_line(tmp_path):
    out = tmp_path / "measured.yaml"
    proc = piper_without_torch(tmp_path, "profile", "--quick", "--out", str(out))
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert lines[0].startswith("piper profile: error: PyTorch is not installed for ")
    assert lines[0].endswith(f"; install it with: {TORCH_INSTALL}")
    assert not out.exists()


def test_the_install_line_installs_the_runtime_extra_s_torch():
    """TORCH_INSTALL pins the torch that pyproject.toml's `runtime` extra asks for."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (torch,) = [d for d in project["optional-dependencies"]["runtime"] if d.startswith("torch")]
    runtime = "python3 -m pip install -e '.[runtime]'"
    assert TORCH_INSTALL == f"python3 -m pip install {torch} && {runtime}"


def test_the_readme_s_cpu_loop_starts_with_that_install():
    block = (REPO / "README.md").read_text().split(HEADING, 1)[1].split("```bash\n", 1)[1]
    assert block.splitlines()[0] == TORCH_INSTALL
