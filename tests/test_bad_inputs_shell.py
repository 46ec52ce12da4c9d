"""A shared plan.json must not run commands (issue 27, item 8): names that reach a shell are
checked and refused in one line (exit 2, nothing written); values, paths and flags are quoted,
so running or sourcing an export never executes what a plan or a path carries."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from planner.outputs.export.megatron import megatron_script
from planner.outputs.export.slurm import slurm_script
from planner.outputs.export.torchtitan import torchtitan_script
from planner.plan import load_plan
from tests.hardening_cli import run_piper
from tests.planner.outputs.export_plans import make_plan

PWNED = "touch PWNED"


def _plan_file(folder: Path, change) -> Path:
    data = json.loads(make_plan().to_json())
    change(data)
    path = folder / "plan.json"
    path.write_text(json.dumps(data))
    return path


def _set_env(env: dict):
    return lambda d: d["cluster"].update(env=env)


def _set_model_name(name: str):
    return lambda d: d["model"].update(name=name)


def _no_slurm_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


# (id, change to plan.json, targets that read it, text the error line must name)
REFUSED = [
    ("env-key-semicolon", _set_env({f"X;{PWNED}": "1"}), ["slurm"], "cluster.env"),
    ("env-key-subshell", _set_env({f"$({PWNED})": "1"}), ["slurm"], "cluster.env"),
    ("env-key-space", _set_env({"A B": "1"}), ["slurm"], "cluster.env"),
    ("env-key-digit", _set_env({"1X": "1"}), ["slurm"], "cluster.env"),
    ("env-key-empty", _set_env({"": "1"}), ["slurm"], "cluster.env"),
    ("env-value-nul", _set_env({"NCCL_X": "a\x00b"}), ["slurm"], "cluster.env.NCCL_X"),
    ("env-value-mapping", _set_env({"NCCL_X": {"a": 1}}), ["slurm"], "cluster.env.NCCL_X"),
    (
        "model-name-newline",
        _set_model_name(f"m\n{PWNED}\n"),
        ["megatron", "torchtitan", "slurm"],
        "model.name",
    ),
    (
        "model-source-newline",
        lambda d: d["model"].update(source=f"s\r\n{PWNED}"),
        ["megatron", "torchtitan", "slurm"],
        "model.source",
    ),
    (
        "cluster-name-newline",
        lambda d: d["cluster"].update(name=f"c\n{PWNED}"),
        ["megatron", "torchtitan", "slurm"],
        "cluster.name",
    ),
]


@pytest.mark.parametrize(
    ("change", "target", "field"),
    [pytest.param(c, t, f, id=f"{i}-{t}") for i, c, targets, f in REFUSED for t in targets],
)
def test_a_plan_name_that_would_reach_a_shell_is_refused(change, target, field, tmp_path):
    plan = _plan_file(tmp_path, change)
    out = tmp_path / "out" / "script.sh"
    result = run_piper(["export", str(plan), "--to", target, "--out", str(out)])
    assert "Traceback" not in result.stderr
    assert result.code == 2, result.stderr
    assert len(result.err_lines) == 1, result.stderr
    line = result.err_lines[0]
    assert line.startswith("piper export: error: plan.json: "), line
    assert field in line, line
    assert not out.parent.exists()


def test_env_values_are_quoted_and_the_dry_run_runs_nothing(tmp_path):
    """A value full of shell syntax is exported verbatim; the dry run creates no file."""
    value = f"$({PWNED}); `{PWNED}` '\"; {PWNED} $HOME"
    plan = _plan_file(tmp_path, _set_env({"NCCL_DEBUG_SUBSYS": value, "NCCL_X": 3}))
    script = tmp_path / "job.sbatch"
    assert run_piper(["export", str(plan), "--to", "slurm", "--out", str(script)]).code == 0
    work = tmp_path / "work"
    work.mkdir()
    env = {**_no_slurm_env(), "PIPER_HOSTFILE": str(work / "h"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in work.iterdir()) == ["h"]
    exports = "\n".join(ln for ln in script.read_text().splitlines() if ln.startswith("export N"))
    shown = subprocess.run(["bash", "-c", f'{exports}\nprintf %s "$NCCL_DEBUG_SUBSYS|$NCCL_X"'],
                           cwd=work, capture_output=True, text=True, check=True)  # fmt: skip
    assert shown.stdout == f"{value}|3"
    assert sorted(p.name for p in work.iterdir()) == ["h"]


def test_paths_with_shell_syntax_stay_text(tmp_path):
    """The plan path and the args-file path are quoted in every line that names them: the
    'args file is missing' message prints them and runs nothing."""
    folder = tmp_path / f"$({PWNED})"
    folder.mkdir()
    plan = folder / "plan.json"
    script = tmp_path / "job.sbatch"
    text, _ = slurm_script(make_plan(), str(plan), None, "megatron", str(folder / "args.sh"))
    script.write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    env = {**_no_slurm_env(), "PIPER_HOSTFILE": str(work / "h"), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True)
    assert run.returncode == 1
    assert f"write it with: piper export '{plan}' --to megatron" in run.stderr
    assert not (work / "PWNED").exists() and not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("target", ["megatron", "torchtitan"])
def test_sourcing_an_args_file_runs_nothing(target, tmp_path):
    """Every word of the Megatron and torchtitan files is quoted: a model name that becomes
    torchtitan's --module and a title full of shell syntax stay text when sourced."""
    source = f"x';{PWNED};'$({PWNED})"
    plan = load_plan(
        _plan_file(tmp_path, lambda d: d["model"].update(name=f"$({PWNED})", source=source))
    )
    render = megatron_script if target == "megatron" else torchtitan_script
    out = tmp_path / "args.sh"
    rendered = render(plan, plan.model_spec())
    out.write_text(rendered[0])
    if target == "torchtitan":  # the config module the args file names, written beside it
        for name, text in rendered[2].items():
            (tmp_path / name).write_text(text)
    work = tmp_path / "work"
    work.mkdir()
    array = "MEGATRON_ARGS" if target == "megatron" else "TORCHTITAN_ARGS"
    shown = subprocess.run(["bash", "-c", f'source {out}; printf "%s\\n" "${{{array}[@]}}"'],
                           cwd=work, capture_output=True, text=True, check=True)  # fmt: skip
    assert list(work.iterdir()) == []
    if target == "torchtitan":
        words = shown.stdout.splitlines()
        assert words[words.index("--module") + 1] == "piper_titan_touch_pwned"
