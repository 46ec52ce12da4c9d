"""The hand-off from a plan to the Slurm job: the job runs only the plan it was exported from
(plan.json, the args file and torchtitan's config module carry its stamp), the plan's
cluster.env passes an allow-list and comes before the job's own variables, the placement step
says plainly when it cannot place, a dry run writes nothing outside a temporary folder, and
every trainer gets $DATA_ARGS."""

from __future__ import annotations

import os
import shlex
import stat
import subprocess
from dataclasses import replace
from pathlib import Path

import pytest

from planner.outputs.export import export_plan
from planner.outputs.export.stamp import plan_stamp, stale_exports, stale_warning, stamp_of
from planner.plan import ClusterEntry, load_plan
from tests.hardening_cli import run_piper
from tests.planner.outputs.export_plans import make_plan, priced_for


def _engine_plan(engine: str, micro_batch: int = 2):
    plan = make_plan()
    plan = replace(plan, parallel=replace(plan.parallel, micro_batch=micro_batch))
    if engine == "torchtitan":
        plan = replace(plan, training={**plan.training, "fsdp": True})
    return priced_for(plan, engine) if engine != "piper" else plan


def _no_slurm() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "PIPER_"))}
    return {**env, "PATH": "/usr/bin:/bin"}


def _dry_run(script: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """The job run outside an allocation (its dry run), temporary files under cwd/tmp."""
    (cwd / "tmp").mkdir(exist_ok=True)
    env = {**_no_slurm(), "TMPDIR": str(cwd / "tmp"), **env}
    return subprocess.run(["bash", str(script)], cwd=cwd, env=env, capture_output=True, text=True)


def _export_job(folder: Path, plan, trainer: str) -> Path:
    (folder / "plan.json").write_text(plan.to_json())
    job = folder / "job.sbatch"
    argv = ["export", str(folder / "plan.json"), "--to", "slurm", "--trainer", trainer, "--out",
            str(job)]  # fmt: skip
    result = run_piper(argv)
    assert result.code == 0, result.stderr
    return job


@pytest.mark.parametrize("engine", ["megatron", "torchtitan"])
def test_job_and_engine_args_are_written_together_with_one_stamp(tmp_path, engine):
    job = _export_job(tmp_path, _engine_plan(engine), engine)
    args_file = tmp_path / f"{engine}_args.sh"
    plan = load_plan(tmp_path / "plan.json")
    stamp = plan_stamp(plan, (tmp_path / "plan.json").read_bytes())
    written = [job, args_file, *tmp_path.glob("piper_titan_*.py")]
    assert len(written) == (3 if engine == "torchtitan" else 2)
    assert all(stamp_of(f.read_text()) == stamp for f in written)
    assert job.read_text().splitlines()[1] == stamp.line  # after the shebang
    # the args file is exactly what `piper export --to ENGINE` writes
    alone = tmp_path / "alone.sh"
    assert run_piper(["export", str(tmp_path / "plan.json"), "--to", engine, "--out",
                      str(alone)]).code == 0  # fmt: skip
    assert alone.read_text() == args_file.read_text()
    assert _dry_run(job, tmp_path).returncode == 0


@pytest.mark.parametrize("engine", ["megatron", "torchtitan"])
def test_job_refuses_args_of_another_plan_in_one_line(tmp_path, engine):
    """A re-plan (here: another micro-batch) exported over the args file alone: the job that
    still names the first plan stops before it starts anything, naming the fix."""
    job = _export_job(tmp_path, _engine_plan(engine), engine)
    args_file = tmp_path / f"{engine}_args.sh"
    other = tmp_path / "other"
    other.mkdir()
    (other / "plan.json").write_text(_engine_plan(engine, micro_batch=1).to_json())
    assert run_piper(["export", str(other / "plan.json"), "--to", engine, "--out",
                      str(args_file)]).code == 0  # fmt: skip
    run = _dry_run(job, tmp_path)
    assert run.returncode == 1 and run.stdout == ""
    assert run.stderr.splitlines() == [
        f"piper: {args_file} was written for another plan than {tmp_path / 'plan.json'} (or "
        f"another version of it); rewrite it with: piper export {tmp_path / 'plan.json'} --to "
        f"{engine} --out {args_file}"
    ]


def test_job_refuses_a_config_module_of_another_plan(tmp_path):
    job = _export_job(tmp_path, _engine_plan("torchtitan"), "torchtitan")
    [module] = tmp_path.glob("piper_titan_*.py")
    stamp = stamp_of(module.read_text())
    assert stamp is not None
    module.write_text(module.read_text().replace(stamp.sha256, "0" * 64))  # another plan's
    run = _dry_run(job, tmp_path)
    assert run.returncode == 1
    [line] = run.stderr.splitlines()
    assert line.startswith(f"piper: {module} was written for another plan")


def test_job_refuses_a_replanned_or_edited_plan(tmp_path):
    job = _export_job(tmp_path, _engine_plan("megatron"), "megatron")
    plan_json = tmp_path / "plan.json"
    plan_json.write_text(_engine_plan("megatron", micro_batch=1).to_json())
    run = _dry_run(job, tmp_path)
    assert run.returncode == 1
    assert run.stderr.splitlines() == [
        f"piper: {plan_json} is not the plan this job was written for (re-planned or edited "
        f"since); rewrite the job with: piper export {plan_json} --to slurm --trainer megatron "
        f"--out {job}"
    ]


def test_args_file_flag_sources_without_writing_and_warns_when_stale(tmp_path):
    (tmp_path / "plan.json").write_text(_engine_plan("megatron").to_json())
    mine = tmp_path / "mine.sh"
    job = tmp_path / "job.sbatch"
    argv = ["export", str(tmp_path / "plan.json"), "--to", "slurm", "--trainer", "megatron",
            "--args-file", str(mine), "--out", str(job)]  # fmt: skip
    result = run_piper(argv)
    assert result.code == 0 and not mine.exists()
    assert f"the job sources {mine}, which is missing" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["job.sbatch", "plan.json"]
    assert run_piper(["export", str(tmp_path / "plan.json"), "--to", "megatron", "--out",
                      str(mine)]).code == 0  # fmt: skip
    result = run_piper(argv)
    assert result.code == 0 and "the job sources" not in result.stderr
    assert _dry_run(job, tmp_path).returncode == 0


def test_stale_exports_names_the_files_of_another_plan(tmp_path):
    _export_job(tmp_path, _engine_plan("torchtitan"), "torchtitan")
    module = next(tmp_path.glob("piper_titan_*.py")).name
    (tmp_path / "notes.txt").write_text("# piper-plan: not a stamp\n")
    first = load_plan(tmp_path / "plan.json")
    assert stale_exports(tmp_path, plan_stamp(first)) == ()
    assert stale_warning(tmp_path, first) is None
    replanned = _engine_plan("torchtitan", micro_batch=1)
    assert stale_exports(tmp_path, plan_stamp(replanned)) == (
        "job.sbatch", module, "torchtitan_args.sh")  # fmt: skip
    line = stale_warning(tmp_path, replanned)
    assert line is not None and "\n" not in line
    assert f"job.sbatch, {module}, torchtitan_args.sh in {tmp_path} were exported from " in line
    assert stale_exports(tmp_path / "missing", plan_stamp(replanned)) == ()


@pytest.mark.parametrize(
    "name",
    ["BASH_ENV", "LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONPATH", "PATH", "NCCL_NET_PLUGIN",
     "NCCL_TUNER_PLUGIN", "NCCL_PROFILER_PLUGIN", "NCCL_CONF_FILE", "NCCL_DEBUG_FILE",
     "FI_PROVIDER_PATH", "HSA_TOOLS_LIB", "UCX_MODULE_DIR", "OMP_TOOL_LIBRARIES", "MASTER_ADDR",
     "SLURM_HOSTFILE", "PIPER_RANK_LOCAL", "MIOPEN_USER_DB_PATH", "CUDA_INJECTION64_PATH"],
)  # fmt: skip
def test_cluster_env_outside_the_allow_list_is_refused(tmp_path, name):
    plan = make_plan()
    cluster = replace(plan.cluster, profile={**plan.cluster.profile, "env": {name: "/x/evil"}})
    (tmp_path / "plan.json").write_text(replace(plan, cluster=cluster).to_json())
    out = tmp_path / "out" / "job.sbatch"
    result = run_piper(["export", str(tmp_path / "plan.json"), "--to", "slurm", "--out", str(out)])
    assert result.code == 2 and "Traceback" not in result.stderr
    [line] = result.err_lines
    assert line.startswith(f"piper export: error: plan.json: cluster.env.{name}: refused: ")
    assert not out.parent.exists()


def test_allowed_env_comes_before_the_jobs_own_variables(tmp_path):
    plan = priced_for(make_plan(), "megatron")
    env = {"NCCL_IB_HCA": "mlx5_0,mlx5_3", "OMP_NUM_THREADS": 4, "TORCH_NCCL_BLOCKING_WAIT": 1}
    cluster = ClusterEntry.from_dict({**plan.cluster.to_dict(), "env": env})
    text = export_plan(replace(plan, cluster=cluster), "slurm", "/p/plan.json", None, "megatron",
                       "/p/megatron_args.sh").text  # fmt: skip
    lines = text.splitlines()
    plan_env = lines.index("export NCCL_IB_HCA=mlx5_0,mlx5_3")
    assert "export OMP_NUM_THREADS=4" in lines and "export TORCH_NCCL_BLOCKING_WAIT=1" in lines
    own = [i for i, ln in enumerate(lines) if ln.startswith("export ") and ln.split("=")[0] in (
        "export SLURM_HOSTFILE", "export MASTER_ADDR", "export MASTER_PORT", "export WORLD_SIZE",
        "export PIPER_RANK_LOCAL")]  # fmt: skip
    assert len(own) == 5 and plan_env < lines.index('source "$ARGS_FILE"') < min(own)


def _fake_allocation(tmp_path: Path) -> dict[str, str]:
    """scontrol listing a-d, an srun that prints its tasks' command, a piper that logs calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "piper-calls"
    fakes = {"scontrol": "#!/bin/bash\nprintf 'a\\nb\\nc\\nd\\n'\n",
             "srun": "#!/bin/bash\necho ran\n",
             "piper": f"#!/bin/bash\necho \"$@\" >> {shlex.quote(str(log))}\nexit 1\n"}  # fmt: skip
    for name, text in fakes.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return {**_no_slurm(), "PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_NODELIST": "a,b,c,d",
            "PIPER_HOSTFILE": str(tmp_path / "h")}  # fmt: skip


def test_without_a_topology_the_job_says_once_why_it_keeps_slurms_order(tmp_path):
    job = _export_job(tmp_path, make_plan(), "piper")
    text = job.read_text()
    assert "# Placement at job start." in text and "export PIPER_TOPOLOGY=" in text
    assert "# - PIPER_PLACE=0 skips placement" in text
    env = _fake_allocation(tmp_path)
    run = subprocess.run(["bash", str(job)], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout == "ran\n", run.stderr
    [line] = run.stderr.splitlines()
    assert line.startswith("piper: ranks follow the plan's order on Slurm's node list, unplaced")
    assert "set PIPER_TOPOLOGY to Slurm's topology.conf" in line
    assert not (tmp_path / "piper-calls").exists()  # piper place was not tried
    nodes = [r.node for r in sorted(make_plan().ranks, key=lambda r: r.rank)]
    assert (tmp_path / "h").read_text().split() == ["abcd"[n] for n in nodes]
    # with a topology it places (here: the stub fails, so one warning)
    run = subprocess.run(["bash", str(job)], env={**env, "PIPER_TOPOLOGY": "/t.conf"},
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0 and "--topology /t.conf" in (tmp_path / "piper-calls").read_text()
    warning = "piper: WARNING: placement failed (see above); ranks follow the plan's order"
    assert run.stderr.splitlines() == [f"{warning} on the Slurm node list"]


@pytest.mark.parametrize("where", ["outside", "inside"])
def test_dry_run_writes_only_under_a_temporary_folder(tmp_path, where):
    job = _export_job(tmp_path, make_plan(), "piper")
    work = tmp_path / "submit"
    work.mkdir()
    env = {} if where == "outside" else {
        **{k: v for k, v in _fake_allocation(tmp_path).items() if k != "PIPER_HOSTFILE"},
        "PIPER_DRY_RUN": "1", "SLURM_SUBMIT_DIR": str(work), "PIPER_PLACE": "0"}  # fmt: skip
    run = _dry_run(job, work, **env)
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in work.iterdir()) == ["tmp"]
    shown = next(ln for ln in run.stderr.splitlines() if "dry run: the hostfile is" in ln)
    hostfile = Path(shown.split("the hostfile is ")[1].split(";")[0])
    assert hostfile.parent.parent == work / "tmp"
    nodes = [r.node for r in sorted(make_plan().ranks, key=lambda r: r.rank)]
    hosts = "abcd" if where == "inside" else [f"node{n}" for n in range(4)]
    assert hostfile.read_text().split() == [hosts[n] for n in nodes]


@pytest.mark.parametrize("trainer", ["piper", "megatron", "torchtitan"])
def test_data_args_reach_every_trainer(tmp_path, trainer):
    job = _export_job(tmp_path, _engine_plan(trainer), trainer)
    run = _dry_run(job, tmp_path, DATA_ARGS="--data '/d/my tokens'  --seed 7")
    assert run.returncode == 0, run.stderr
    words = shlex.split(run.stdout)
    data = ["--data", "'/d/my", "tokens'", "--seed", "7"]  # split at white space, as documented
    if trainer == "torchtitan":  # before the exported arguments, which end with a subcommand
        start = words.index("torchtitan.train") + 1
        assert words[start : start + 5] == data
        assert words[-1].startswith("activation_checkpoint:")
    else:
        assert words[-5:] == data
    assert "DATA_ARGS" in job.read_text()


def test_replanning_into_the_folder_of_a_job_names_it_and_the_job_refuses(tmp_path):
    """`piper plan` again into the folder of an exported job, with another global batch:
    stale_warning names the job, whose dry run stops in one line; a re-export clears both."""
    out = tmp_path / "run"
    plan = ["plan", "--model", "tiny-moe", "--cluster", "cpu-gloo", "--gpus", "2", "--seq-len",
            "64", "--pp", "1", "--dp", "2", "--tp", "1", "--ep", "2", "--micro-batch", "1",
            "--out", str(out)]  # fmt: skip
    assert run_piper([*plan, "--global-batch", "16"]).code == 0
    job = out / "job.sbatch"
    export = ["export", str(out / "plan.json"), "--to", "slurm", "--out", str(job)]
    assert run_piper(export).code == 0
    assert stale_warning(out, load_plan(out / "plan.json")) is None
    assert run_piper([*plan, "--global-batch", "32"]).code == 0
    line = stale_warning(out, load_plan(out / "plan.json"))
    assert line is not None and line.startswith(f"piper plan: WARNING: job.sbatch in {out} ")
    run = _dry_run(job, tmp_path)
    assert run.returncode == 1
    [refusal] = run.stderr.splitlines()
    assert "is not the plan this job was written for" in refusal
    assert run_piper(export).code == 0
    assert stale_warning(out, load_plan(out / "plan.json")) is None
    assert _dry_run(job, tmp_path).returncode == 0
