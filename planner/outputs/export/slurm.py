"""An sbatch script that runs a plan with the rank-to-node order the rank IP chose.

The job first checks that plan.json is the very file it was exported from and that the args
file it sources (and torchtitan's config module) carries the same plan stamp
(planner.outputs.export.job_checks); then it exports the communication-library environment
(planner.outputs.export.job_env) and sources the trainer's args file. At job start it runs
`piper place PLAN --nodelist "$SLURM_JOB_NODELIST"` (the rank IP on the nodes Slurm allocated,
within PIPER_PLACE_TIME_LIMIT_S, default 30 s; the fabric from PIPER_TOPOLOGY, Slurm's
topology file, or from Frontier's host names) and uses its hostfile and local ranks. Without a
topology on another cluster it says once that it keeps Slurm's order, and why; if placement
fails, or with PIPER_PLACE=0, it falls back to the plan's order: rank r on the
`ranks[r].node`-th host Slurm lists. Then it sets its own variables (after everything the plan
and the args file set): SLURM_HOSTFILE, and per task the torchrun-style environment (RANK,
LOCAL_RANK, WORLD_SIZE, MASTER_ADDR = rank 0's host, MASTER_PORT); it starts one task per rank
with `srun --distribution=arbitrary`. Outside an allocation (no SLURM_JOB_NODELIST), or with
`PIPER_DRY_RUN=1`, it writes the hostfile into a fresh temporary folder (or PIPER_HOSTFILE)
and prints the srun command instead of running it (outside an allocation with placeholder host
names and the `piper place` command it would run).

Trainers: Piper's runtime (`python -m runtime.launch --plan PLAN`), Megatron-LM (the script
sources the Megatron export, whose MEGATRON_ARGS and CUDA_DEVICE_MAX_CONNECTIONS it needs) or
torchtitan (sources the torchtitan export). Each gets the words of $DATA_ARGS (data and
tokenizer flags, given at submission) where it takes options. Files are referred to by absolute
paths.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Literal

from planner.outputs.export.job_checks import args_check_lines, plan_check_lines
from planner.outputs.export.job_env import comm_env
from planner.outputs.export.megatron import megatron_env
from planner.outputs.export.shell import comment, export_lines
from planner.outputs.export.slurm_steps import HOSTS, LAUNCH, OWN, PLACE
from planner.outputs.export.stamp import PlanStamp
from planner.plan.schema import Plan
from planner.specs import SpecError

Trainer = Literal["piper", "megatron", "torchtitan"]
TRAINERS: tuple[Trainer, ...] = ("piper", "megatron", "torchtitan")
# The command each trainer runs per rank: its options, then "{extra}" (flags a caller adds,
# e.g. the trial jobs' short run) and the data flags where the trainer takes them. torchtitan's
# exported arguments end with a subcommand, after which tyro takes no top-level option.
TRAINER_COMMANDS = {
    "megatron": 'python "${{MEGATRON_LM:-.}}/pretrain_gpt.py" "${{MEGATRON_ARGS[@]}}"{extra} '
    '"${{DATA_ARGV[@]}}"',
    "torchtitan": 'python -m torchtitan.train{extra} "${{DATA_ARGV[@]}}" "${{TORCHTITAN_ARGS[@]}}"',
}
# The DATA_ARGS slot: the same variable the trial jobs read (planner.outputs.trials)
_DATA_ARGS = (
    "# DATA_ARGS: the trainer's data and tokenizer flags, given when you submit, e.g.",
    "#   DATA_ARGS='--mock-data --tokenizer-type NullTokenizer --vocab-size 151936' sbatch JOB",
    "# (split at white space; each trainer gets them where it takes options)",
    'read -r -a DATA_ARGV <<< "${DATA_ARGS:-}"',
)


def trainer_command(trainer: Trainer, extra: Sequence[str] = ()) -> str:
    """The per-rank command of `trainer` with `extra` flags (each word quoted) where it takes
    options, and the words of $DATA_ARGS."""
    words = "".join(" " + shlex.quote(w) for w in extra)
    return TRAINER_COMMANDS[trainer].format(extra=words)


def rank_layout(plan: Plan) -> tuple[list[int], list[int], int, int]:
    """(node per rank, local rank per rank, nodes, ranks per node) from the plan's ranks table."""
    ranks = sorted(plan.ranks, key=lambda r: r.rank)
    p = plan.parallel
    world = p.pp * p.dp * p.tp * p.cp
    if [r.rank for r in ranks] != list(range(world)):
        raise SpecError(
            f"plan.json: the ranks table must list ranks 0..{world - 1} once each; "
            "regenerate it with 'piper plan'"
        )
    nodes = sorted({r.node for r in ranks})
    if nodes != list(range(len(nodes))):
        raise SpecError("plan.json: ranks[].node must number the nodes 0..N-1; regenerate it")
    per_node = max(sum(1 for r in ranks if r.node == n) for n in nodes)
    return [r.node for r in ranks], [r.local_rank for r in ranks], len(nodes), per_node


def _header(plan: Plan, notes: list[str], num_nodes: int, per_node: int, gpus: int) -> list[str]:
    """Shebang, description, notes and #SBATCH lines."""
    par = plan.parallel
    model = plan.model.name or "model"
    name = "piper-" + "".join(c if c.isalnum() or c in "-_." else "-" for c in model)
    cpu = "cpu" in plan.cluster.name.lower()
    return [
        "#!/bin/bash",
        comment(
            f"Slurm job for {model} on {plan.cluster.name or '?'}: "
            f"pp {par.pp}, dp {par.dp}, tp {par.tp}, cp {par.cp}, ep {par.ep}"
        ),
        "# generated by 'piper export'; 'piper place' puts the ranks on the job's nodes at",
        "# job start (see 'Placement at job start' below)",
        *[comment(f"NOTE: {n}") for n in notes],
        f"#SBATCH --job-name={name}",
        f"#SBATCH --nodes={num_nodes}",
        f"#SBATCH --ntasks={par.pp * par.dp * par.tp * par.cp}",
        f"#SBATCH --ntasks-per-node={per_node}",
        *([] if cpu else [f"#SBATCH --gpus-per-node={gpus}"]),
        "#SBATCH --exclusive",
        "set -euo pipefail",
        "",
    ]


def _args_checks(trainer: Trainer, plan_path: str, args_file: str | None,
                 modules: Sequence[str], stamp: PlanStamp | None) -> list[str]:  # fmt: skip
    """The checks of the trainer's args file (and the modules beside it)."""
    if trainer == "piper":
        return []
    if not args_file:
        raise SpecError(f"export: the {trainer} trainer needs the path of its args file")
    export = shlex.join(["piper", "export", plan_path, "--to", trainer, "--out", args_file])
    return args_check_lines(args_file, export, modules, stamp)


def _source(plan: Plan, trainer: Trainer) -> list[str]:
    """Sourcing the checked args file, and the environment its trainer needs."""
    if trainer == "piper":
        return []
    lines = ["# shellcheck source=/dev/null", 'source "$ARGS_FILE"']
    if trainer == "megatron":  # also set by the args file; here so --command keeps it
        lines += [f"export {k}={shlex.quote(v)}" for k, v in megatron_env(plan)]
    return lines


def _command(plan: Plan, trainer: Trainer, plan_path: str, command: str | None) -> str:
    """CMD: `command`, else the trainer's own with the words of $DATA_ARGS."""
    if command:
        return f"CMD=({command})"
    if trainer != "piper":
        return f"CMD=({trainer_command(trainer)})"
    # the dispatcher and precision the plan was priced with, spelled out (the launcher
    # defaults to the plan's too; at full size it refuses any other)
    dispatcher = str(plan.extra.get("dispatcher", "flat"))
    launch = shlex.join(
        ["python", "-m", "runtime.launch", "--plan", plan_path, "--out", "results/run",
         "--dispatcher", dispatcher, "--precision", "plan"]
    )  # fmt: skip
    # the launcher's words alone on the CMD line, which tools read as the command
    return f'CMD=({launch})\nCMD+=("${{DATA_ARGV[@]}}")'


def slurm_script(
    plan: Plan,
    plan_path: str,
    command: str | None,
    trainer: Trainer = "piper",
    args_file: str | None = None,
    stamp: PlanStamp | None = None,
    modules: Sequence[str] = (),
    job_path: str = "piper.sbatch",
) -> tuple[str, tuple[str, ...]]:
    """The sbatch script text and its notes (see the module docstring).

    Args:
        plan: a loaded plan.json.
        plan_path: the plan file as the script names it (the CLI passes an absolute path).
        command: the per-rank trainer command (default: the trainer's own).
        trainer: piper | megatron | torchtitan.
        args_file: the Megatron or torchtitan export the script sources.
        stamp: the plan file's stamp; the job checks plan.json and the args file (and
            `modules`) against it before anything else (None: no such check).
        modules: files beside the args file that it loads (torchtitan's config module).
        job_path: where the script is written, for the command its refusals print.
    """
    if trainer not in TRAINERS:
        raise SpecError(f"export: unknown trainer '{trainer}'; use one of {', '.join(TRAINERS)}")
    node_of, local_of, num_nodes, per_node = rank_layout(plan)
    gpus = plan.cluster.gpus_per_node or per_node
    notes = []
    if per_node < gpus:
        notes.append(f"the plan uses {per_node} of {gpus} devices on its busiest node")
    if trainer == "megatron" and not command:
        notes.append("give your tokenizer and data flags in DATA_ARGS when you submit; "
                     "MEGATRON_LM is your checkout")  # fmt: skip
    env = comm_env(plan.cluster)
    rewrite = ["piper", "export", plan_path, "--to", "slurm", "--trainer", trainer]
    rewrite += [*(["--command", command] if command else []), "--out", job_path]
    checks = [] if stamp is None else plan_check_lines(stamp, shlex.join(rewrite))
    by_hostname = int("frontier" in plan.cluster.name.lower())  # planner.inputs.slurm_topology
    lines = [
        *_header(plan, notes, num_nodes, per_node, gpus),
        f"WORLD_SIZE={len(node_of)}",
        f"NUM_NODES={num_nodes}",
        "# allocation node (0-based, in the order Slurm lists the job's nodes) of each rank",
        f"RANK_NODE=({' '.join(map(str, node_of))})",
        "# device index inside its node of each rank",
        f"RANK_LOCAL=({' '.join(map(str, local_of))})",
        f"PLAN={shlex.quote(plan_path)}",
        f"PLACE_BY_HOSTNAME={by_hostname}",
        *checks,
        *_args_checks(trainer, plan_path, args_file, modules, stamp),
        "# communication library settings for this cluster (planner/EXPORT.md, 'Slurm')",
        *export_lines(env, "plan.json: cluster.env"),
        "",
        *_source(plan, trainer),
        *HOSTS,
        *PLACE,
        *OWN,
        *_DATA_ARGS,
        _command(plan, trainer, plan_path, command),
        *LAUNCH,
    ]
    return "\n".join(lines) + "\n", tuple(notes)
