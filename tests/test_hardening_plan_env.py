"""A plan's `cluster.env` is checked against the Slurm job's allow-list when the plan is read
(planner/HARDENING.md, "Hostile files"; planner/plan/env_names.py): a plan that names a
variable the job would run or load (BASH_ENV, LD_PRELOAD, ...) is refused by every command
that reads it, in one line, before anything is written. Also: `piper prepare-data` without
the `tokenizers` package names the install line of the project's `runtime` extra."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from planner.outputs.export import job_env
from planner.plan import env_names, load_plan
from planner.run.options import TORCH_INSTALL
from planner.specs import SpecError
from tests.hardening_cli import run_piper
from tests.planner.outputs.export_plans import make_plan

REFUSED = "plan.json: cluster.env.BASH_ENV: refused: only communication-library and threading"


def _plan_with_env(folder: Path, env) -> Path:
    d = json.loads(make_plan().to_json())
    d["cluster"]["env"] = env
    path = folder / "plan.json"
    path.write_text(json.dumps(d))
    return path


def test_load_plan_refuses_a_variable_outside_the_allow_list(tmp_path):
    with pytest.raises(SpecError) as exc:
        load_plan(_plan_with_env(tmp_path, {"NCCL_IB_HCA": "mlx5", "BASH_ENV": "/x/evil"}))
    assert str(exc.value).startswith(REFUSED) and "\n" not in str(exc.value)


@pytest.mark.parametrize(
    ("env", "problem"),
    [
        ({"NCCL_NET_PLUGIN": "/x/evil.so"}, "NCCL_NET_PLUGIN: refused: it names code or a file"),
        ({"LD_PRELOAD": "/x/evil.so"}, "LD_PRELOAD: refused"),
        ({"X;touch PWNED": "1"}, "is not an environment variable name"),
        ({"NCCL_X": {"a": 1}}, "NCCL_X must be a string or number"),
        ({"NCCL_X": "a\x00b"}, "NCCL_X: the value holds a NUL byte"),
        (["NCCL_X"], "must be a mapping of variable to value"),
    ],
    ids=["plugin", "preload", "shell-syntax", "mapping-value", "nul", "list"],
)
def test_load_plan_refuses_each_kind_of_bad_env(tmp_path, env, problem):
    with pytest.raises(SpecError, match="plan.json: cluster.env") as exc:
        load_plan(_plan_with_env(tmp_path, env))
    assert problem in str(exc.value)


def test_an_allowed_env_is_read_and_exported_as_before(tmp_path):
    env = {"NCCL_IB_HCA": "mlx5_0", "OMP_NUM_THREADS": 4}
    plan = load_plan(_plan_with_env(tmp_path, env))
    assert plan.cluster.profile["env"] == env
    assert job_env.comm_env(plan.cluster)["OMP_NUM_THREADS"] == "4"
    assert job_env.check_env is env_names.check_env  # one allow-list, owned by planner.plan


@pytest.mark.parametrize("command", ["run", "export", "place"])
def test_piper_commands_refuse_the_plan_in_one_line(tmp_path, command):
    plan = _plan_with_env(tmp_path, {"BASH_ENV": "/x/evil"})
    out = tmp_path / "out"
    argv = {
        "run": ["run", str(plan), "--steps", "1", "--nproc", "8", "--out", str(out)],
        "export": ["export", str(plan), "--to", "slurm", "--out", str(out / "job.sbatch")],
        "place": ["place", str(plan), "--nodelist", "n[1-4]", "--out", str(out)],
    }[command]
    result = run_piper(argv)
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [line] = result.err_lines
    assert line.startswith(f"piper {command}: error: {REFUSED}"), line
    assert not out.exists()


def test_prepare_data_without_tokenizers_names_the_runtime_extra(tmp_path, monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "tokenizers" else find_spec(name, *a),
    )
    (tmp_path / "tokenizer.json").write_text("{}")
    (tmp_path / "a.txt").write_text("hello world\n")
    out = tmp_path / "out"
    result = run_piper(["prepare-data", "--tokenizer", str(tmp_path / "tokenizer.json"),
                        "--out", str(out), str(tmp_path / "a.txt")])  # fmt: skip
    assert result.code == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    [line] = result.err_lines
    assert "needs the `tokenizers` package; install it with: " in line
    assert line.endswith(TORCH_INSTALL) and "'.[runtime]'" in TORCH_INSTALL
    assert not out.exists()
