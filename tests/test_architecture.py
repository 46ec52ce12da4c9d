"""The one-way dependency rule: the planner never imports torch or the runtime."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import planner

ROOT = Path(__file__).resolve().parent.parent


def _planner_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(planner.__path__, prefix="planner."))


def test_planner_modules_exist():
    mods = _planner_modules()
    assert "planner.specs" in mods and "planner.plan.schema" in mods


def test_importing_every_planner_module_does_not_import_torch():
    mods = _planner_modules()
    code = (
        "import importlib, sys\n"
        f"for m in {mods!r}:\n"
        "    importlib.import_module(m)\n"
        "bad = sorted(k for k in sys.modules if k == 'torch' or k.startswith('torch.')"
        " or k == 'runtime' or k.startswith('runtime.'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True
    )
    assert out.stdout.strip() == "", f"planner imported: {out.stdout.strip()}"


def test_planner_sources_have_no_torch_import():
    offenders = [
        str(p.relative_to(ROOT))
        for p in (ROOT / "planner").rglob("*.py")
        for line in p.read_text().splitlines()
        if line.strip().startswith(("import torch", "from torch", "import runtime", "from runtime"))
    ]
    assert offenders == []
