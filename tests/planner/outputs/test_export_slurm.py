"""The Slurm export checked by bash and shellcheck, run against stub scontrol/srun and outside
an allocation (its dry run), for Piper's runtime and for Megatron-LM."""

from __future__ import annotations

import os
import shlex
import shutil
import stat
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from planner.cli import main
from planner.outputs.export import export_plan
from planner.outputs.export.job_env import comm_env
from planner.outputs.trials import trainer_command
from planner.plan import ClusterEntry, load_plan
from planner.specs import SpecError
from tests.planner.outputs.export_plans import (
    LOCAL_OF_RANK,
    NODE_OF_RANK,
    bash_array,
    make_plan,
    priced_for,
)


def _priced(plan, engine: str):
    """`plan` as `piper plan --target ENGINE` prices it (torchtitan shards with FSDP)."""
    if engine == "torchtitan":
        plan = replace(plan, training={**plan.training, "fsdp": True})
    return priced_for(plan, engine)


def _fake_slurm_bin(tmp_path: Path, hosts: list[str]) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "scontrol": "#!/bin/bash\n" + "".join(f"echo {h}\n" for h in hosts),
        # run every task in turn with its SLURM_PROCID, after dropping srun's options
        "srun": "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        'for ((i = 0; i < WORLD_SIZE; i++)); do SLURM_PROCID=$i "$@"; done\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


def _outside_allocation() -> dict[str, str]:
    """This process's environment without any Slurm job variable."""
    return {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}


def test_slurm_script_hostfile_and_task_environment(tmp_path):
    plan = make_plan()
    cmd = "sh -c 'echo task $RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR'"
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(plan.to_json())
    text = export_plan(plan, "slurm", plan_path=str(plan_path), command=cmd).text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    sbatch = dict(line[len("#SBATCH --"):].split("=", 1) for line in text.splitlines()
                  if line.startswith("#SBATCH --") and "=" in line)  # fmt: skip
    assert (sbatch["nodes"], sbatch["ntasks"], sbatch["ntasks-per-node"]) == ("4", "8", "2")
    hosts = ["h-a", "h-b", "h-c", "h-d"]
    bin_dir = _fake_slurm_bin(tmp_path, hosts)
    env = {
        **_outside_allocation(),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "h-[a-d]",
        "PIPER_HOSTFILE": str(tmp_path / "hostfile"),
        "PIPER_PLACE": "0",  # the plan's order (placement: tests/planner/cli/test_place.py)
    }
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    hostfile = (tmp_path / "hostfile").read_text().splitlines()
    assert hostfile == [hosts[r.node] for r in sorted(plan.ranks, key=lambda r: r.rank)]
    tasks = [line.split() for line in out.stdout.splitlines()]
    master = hosts[NODE_OF_RANK[0]]
    assert tasks == [["task", str(r), str(LOCAL_OF_RANK[r]), "8", master] for r in range(8)]


def test_slurm_dry_run_outside_an_allocation(tmp_path):
    """`bash piper.sbatch` with no job (no SLURM_JOB_NODELIST, no scontrol): placeholder hosts,
    the hostfile, and the srun line printed; nothing is launched."""
    plan_path = tmp_path / "my plan.json"
    plan_path.write_text(make_plan().to_json())
    text = export_plan(make_plan(), "slurm", plan_path=str(plan_path)).text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {**_outside_allocation(), "PIPER_HOSTFILE": str(tmp_path / "h"), "PATH": "/usr/bin:/bin"}
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True)
    assert "not inside a Slurm allocation" in out.stderr
    words = shlex.split(out.stdout)
    assert words[0] == "srun" and "--distribution=arbitrary" in words
    # the runtime runs the dispatcher and precision the plan was priced with
    assert words[-9:] == ["runtime.launch", "--plan", str(plan_path), "--out", "results/run",
                          "--dispatcher", "flat", "--precision", "plan"]  # fmt: skip
    hosts = (tmp_path / "h").read_text().split()
    assert hosts == [f"node{n}" for n in NODE_OF_RANK]


def test_slurm_megatron_trainer_sources_the_args_file(tmp_path):
    """The Megatron trainer's CMD expands the sourced MEGATRON_ARGS, with Megatron's env."""
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(priced_for(make_plan(), "megatron").to_json())
    args_file = tmp_path / "megatron_args.sh"
    script = tmp_path / "job.sbatch"
    assert main(["export", str(plan_path), "--to", "megatron", "--out", str(args_file)]) == 0
    cmd = 'sh -c \'echo "$CUDA_DEVICE_MAX_CONNECTIONS $#"\' megatron "${MEGATRON_ARGS[@]}"'
    argv = ["export", str(plan_path), "--to", "slurm", "--trainer", "megatron", "--command", cmd,
            "--out", str(script)]  # fmt: skip
    assert main(argv) == 0
    assert f"ARGS_FILE={args_file}" in script.read_text()
    env = {
        **_outside_allocation(),
        "PATH": f"{_fake_slurm_bin(tmp_path, ['a', 'b', 'c', 'd'])}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "a-d",
        "PIPER_HOSTFILE": str(tmp_path / "h"),
        "PIPER_PLACE": "0",
    }
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    n_args = len(bash_array(args_file.read_text(), "MEGATRON_ARGS"))
    assert out.stdout.split("\n")[:8] == [f"1 {n_args}"] * 8  # every rank got every flag
    args_file.unlink()
    missing = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True)
    assert missing.returncode == 1
    assert f"{args_file} is missing; write it with: piper export" in missing.stderr


def test_slurm_default_megatron_command_and_plan_path_resolved(tmp_path, monkeypatch):
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(make_plan().to_json())
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "out" / "job.sbatch"
    assert main(["export", "plan.json", "--to", "slurm", "--out", str(script)]) == 0
    assert f"--plan {plan_path}" in script.read_text()  # absolute: the job may run elsewhere
    plan_path.write_text(_priced(make_plan(), "megatron").to_json())
    assert main(["export", "plan.json", "--to", "slurm", "--trainer", "megatron", "--out",
                 str(script)]) == 0  # fmt: skip
    text = script.read_text()
    assert f"ARGS_FILE={tmp_path / 'out' / 'megatron_args.sh'}" in text
    assert ('CMD=(python "${MEGATRON_LM:-.}/pretrain_gpt.py" "${MEGATRON_ARGS[@]}" '
            '"${DATA_ARGV[@]}")') in text  # fmt: skip
    # without --trainer, the script runs the engine the plan was made for
    script.unlink()
    assert main(["export", "plan.json", "--to", "slurm", "--out", str(script)]) == 0
    assert script.read_text() == text
    plan_path.write_text(_priced(make_plan(), "torchtitan").to_json())
    assert main(["export", "plan.json", "--to", "slurm", "--out", str(script)]) == 0
    assert "python -m torchtitan.train" in script.read_text()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
@pytest.mark.parametrize("trainer", ["piper", "megatron", "torchtitan"])
@pytest.mark.parametrize("trial", [False, True])
def test_slurm_script_passes_shellcheck(trainer, trial, tmp_path):
    """The job as exported, and as a trial job (a --command naming the args arrays)."""
    args_file = None if trainer == "piper" else str(tmp_path / "args.sh")
    plan = make_plan() if trainer == "piper" else _priced(make_plan(), trainer)
    command = trainer_command(trainer, 30) if trial and trainer != "piper" else None
    text = export_plan(plan, "slurm", "/p/plan.json", command, trainer, args_file).text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    out = subprocess.run(["shellcheck", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_comm_env_by_cluster():
    def env(section: dict) -> dict[str, str]:
        return comm_env(ClusterEntry.from_dict(section))

    assert env({"name": "frontier"})["NCCL_SOCKET_IFNAME"] == "hsn0"
    assert env({"name": "gb200-nvl72"})["NCCL_MNNVL_ENABLE"] == "1"
    assert env({"name": "h100"})["NCCL_IB_HCA"] == "mlx5"
    assert env({"name": "h100", "env": {"NCCL_IB_HCA": "mlx5_0"}})["NCCL_IB_HCA"] == "mlx5_0"


def test_slurm_rejects_incomplete_ranks_table():
    plan = make_plan()
    broken = replace(plan, ranks=plan.ranks[:-1])
    with pytest.raises(SpecError, match="ranks 0..7"):
        export_plan(broken, "slurm")


def test_cli_export_round_trip(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(make_plan().to_json())
    assert load_plan(path).parallel.pp == 4
    out = tmp_path / "tt.sh"
    path.write_text(_priced(make_plan(), "torchtitan").to_json())
    assert main(["export", str(path), "--to", "torchtitan", "--out", str(out)]) == 0
    args = bash_array(out.read_text(), "TORCHTITAN_ARGS")
    assert args[args.index("--parallelism.pipeline_parallel_degree") + 1] == "4"
    path.write_text(priced_for(make_plan(), "megatron").to_json())
    assert main(["export", str(path), "--to", "megatron"]) == 0
    assert "MEGATRON_ARGS=(" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "missing.json"), "--to", "slurm"]) == 2


def test_end_to_end_piper_plan_then_every_export(tmp_path):
    out = tmp_path / "run"
    sizes = ["--pp", "2", "--dp", "4", "--tp", "1", "--ep", "2", "--micro-batch", "2"]
    argv = ["plan", "--model", "tiny-moe-deep", "--cluster", "cpu-gloo", "--gpus", "8",
            "--seq-len", "64", "--global-batch", "16", *sizes, "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    plan = load_plan(out / "plan.json")
    p = plan.parallel
    mega = bash_array(export_plan(priced_for(plan, "megatron"), "megatron").text, "MEGATRON_ARGS")
    assert mega[mega.index("--pipeline-model-parallel-size") + 1] == str(p.pp)
    assert mega[mega.index("--global-batch-size") + 1] == str(
        p.dp * p.micro_batch * p.num_microbatches
    )
    titan = bash_array(export_plan(_priced(plan, "torchtitan"), "torchtitan").text,
                       "TORCHTITAN_ARGS")  # fmt: skip
    assert titan[titan.index("--parallelism.expert_parallel_degree") + 1] == str(p.ep)
    script = tmp_path / "job.sbatch"
    script.write_text(export_plan(plan, "slurm", plan_path=str(out / "plan.json")).text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    nodes = {r.node for r in plan.ranks}
    assert f"#SBATCH --nodes={len(nodes)}" in script.read_text()
