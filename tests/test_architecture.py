"""The one-way dependency rule: the planner never imports torch or the runtime."""

from __future__ import annotations

import ast
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


def _imported_roots(path: Path) -> set[str]:
    """Top-level package of every import statement in `path` (the code, not its strings: an
    exporter may write the text of a module that imports torch)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_planner_sources_have_no_torch_import():
    offenders = [
        str(p.relative_to(ROOT))
        for p in sorted((ROOT / "planner").rglob("*.py"))
        if _imported_roots(p) & {"torch", "runtime"}
    ]
    assert offenders == []


def test_the_import_check_reads_code_not_strings(tmp_path):
    code = tmp_path / "m.py"
    code.write_text('TEXT = """\nimport torch\n"""\nif False:\n    from torch import nn\n')
    assert _imported_roots(code) == {"torch"}
    code.write_text('TEXT = """\nimport torch\nfrom runtime import x\n"""\nimport torchtitan\n')
    assert _imported_roots(code) == {"torchtitan"}
