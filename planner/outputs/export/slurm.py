"""An sbatch script that runs a plan with the rank-to-node order the rank IP chose.

At job start the script runs `piper place PLAN --nodelist "$SLURM_JOB_NODELIST"` (the rank
IP on the nodes Slurm allocated, within PIPER_PLACE_TIME_LIMIT_S, default 30 s; Slurm's
topology file from PIPER_TOPOLOGY) and uses its hostfile and local ranks. If placement fails,
or with PIPER_PLACE=0, it prints a warning and falls back to the plan's order: rank r on the
`ranks[r].node`-th host Slurm lists. It points SLURM_HOSTFILE at the hostfile and starts one
task per rank with `srun --distribution=arbitrary`; each task gets the torchrun-style
environment (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR = rank 0's host, MASTER_PORT). Outside
an allocation (no SLURM_JOB_NODELIST), or with `PIPER_DRY_RUN=1`, it writes the hostfile
(placeholder host names outside an allocation, where it prints the `piper place` command it
would run) and prints the srun command instead of running it.

Trainers: Piper's runtime (`python -m runtime.launch --plan PLAN`), Megatron-LM (the script
sources the Megatron export, whose MEGATRON_ARGS and CUDA_DEVICE_MAX_CONNECTIONS it needs) or
torchtitan (sources the torchtitan export). Files are referred to by absolute paths.
"""

from __future__ import annotations

import shlex
from typing import Literal

from planner.outputs.export.megatron import megatron_env
from planner.outputs.export.shell import comment, env_name, export_lines
from planner.plan.schema import ClusterEntry, Plan
from planner.specs import SpecError

Trainer = Literal["piper", "megatron", "torchtitan"]
TRAINERS: tuple[Trainer, ...] = ("piper", "megatron", "torchtitan")
# The command each trainer runs per rank; ARGS_FILE defines the array it expands.
TRAINER_COMMANDS = {
    "megatron": 'python "${MEGATRON_LM:-.}/pretrain_gpt.py" "${MEGATRON_ARGS[@]}"',
    "torchtitan": 'python -m torchtitan.train "${TORCHTITAN_ARGS[@]}"',
}

# Communication-library environment by platform; a plan's cluster entry may add `env: {...}`.
ENV_RCCL_SLINGSHOT = {  # OLCF's guidance for RCCL + aws-ofi-rccl on Frontier's Slingshot
    "NCCL_SOCKET_IFNAME": "hsn0",
    "NCCL_NET_GDR_LEVEL": "3",
    "NCCL_CROSS_NIC": "1",
    "FI_CXI_ATS": "0",
    "FI_MR_CACHE_MONITOR": "userfaultfd",
}
ENV_NCCL_IB = {  # rail-optimized InfiniBand: stay on the local rail, GPUDirect RDMA on
    "NCCL_IB_HCA": "mlx5",
    "NCCL_CROSS_NIC": "0",
    "NCCL_NET_GDR_LEVEL": "PHB",
}
ENV_NCCL_MNNVL = {**ENV_NCCL_IB, "NCCL_MNNVL_ENABLE": "1", "NCCL_NVLS_ENABLE": "1"}
ENV_GLOO = {"OMP_NUM_THREADS": "1"}


def comm_env(cluster: ClusterEntry) -> dict[str, str]:
    """NCCL/RCCL variables for the plan's cluster (by name and device), plus its own `env`."""
    name = cluster.name.lower()
    device = cluster.profile.get("device")
    device_name = str(device.get("name", "") if isinstance(device, dict) else device or "").lower()
    if "frontier" in name or "mi250" in device_name or "mi300" in device_name:
        env = dict(ENV_RCCL_SLINGSHOT)
    elif "nvl72" in name or "gb200" in name:
        env = dict(ENV_NCCL_MNNVL)
    elif "cpu" in name or "gloo" in name:
        env = dict(ENV_GLOO)
    else:
        env = dict(ENV_NCCL_IB)
    extra = cluster.profile.get("env") or {}
    if not isinstance(extra, dict):
        raise SpecError("plan.json: cluster.env must be a mapping of variable to value")
    for key, value in extra.items():
        if isinstance(value, dict | list) or value is None:
            raise SpecError(f"plan.json: cluster.env.{env_name(key, 'plan.json: cluster.env')} "
                            "must be a string or number; fix the value")  # fmt: skip
        env[env_name(key, "plan.json: cluster.env")] = str(value)
    return env


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


# The fixed part of the script: hosts (the job's, or placeholders outside an allocation),
# the placement at job start (`piper place`, falling back to the plan's order), the rank
# environment, srun.
_HOSTS = (
    'DRY_RUN="${PIPER_DRY_RUN:-0}"',
    'if [[ -n "${SLURM_JOB_NODELIST:-}" ]]; then',
    '  mapfile -t HOSTS < <(scontrol show hostnames "$SLURM_JOB_NODELIST")',
    "else",
    '  echo "piper: not inside a Slurm allocation: dry run with placeholder hosts" >&2',
    "  DRY_RUN=1",
    "  HOSTS=()",
    '  for ((n = 0; n < NUM_NODES; n++)); do HOSTS+=("node$n"); done',
    "fi",
    "if (( ${#HOSTS[@]} < NUM_NODES )); then",
    '  echo "piper: the plan needs $NUM_NODES nodes, the job has ${#HOSTS[@]}" >&2; exit 1',
    "fi",
    'HOSTFILE="${PIPER_HOSTFILE:-${SLURM_SUBMIT_DIR:-$PWD}/piper_hostfile.${SLURM_JOB_ID:-0}}"',
)
# `piper place` on the job's nodes, within PIPER_PLACE_TIME_LIMIT_S (the rank IP's budget;
# the whole command gets 60 s more); PIPER_TOPOLOGY names Slurm's topology.conf/.yaml.
_PLACE = (
    'PLACE_DIR="$HOSTFILE.placement"',
    'PLACE_LIMIT_S="${PIPER_PLACE_TIME_LIMIT_S:-30}"',
    'if [[ ! "$PLACE_LIMIT_S" =~ ^[0-9]+([.][0-9]+)?$ ]]; then',
    '  echo "piper: WARNING: PIPER_PLACE_TIME_LIMIT_S=$PLACE_LIMIT_S is not a number of '
    'seconds; using 30" >&2',
    "  PLACE_LIMIT_S=30",
    "fi",
    'PLACE=("${PIPER:-piper}" place "$PLAN" --nodelist "${SLURM_JOB_NODELIST:-}" '
    '--out "$PLACE_DIR" --time-limit-s "$PLACE_LIMIT_S")',
    'if [[ -n "${PIPER_TOPOLOGY:-}" ]]; then PLACE+=(--topology "$PIPER_TOPOLOGY"); fi',
    "PLACED=0",
    'if [[ -z "${SLURM_JOB_NODELIST:-}" ]]; then',
    '  echo "piper: inside an allocation this runs: $(printf "%q " "${PLACE[@]:0:4}")'
    '\\"\\$SLURM_JOB_NODELIST\\" $(printf "%q " "${PLACE[@]:5}")" >&2',
    '  echo "piper: and uses its hostfile; here ranks follow the plan\'s order" >&2',
    'elif [[ "${PIPER_PLACE:-1}" == 0 ]]; then',
    '  echo "piper: PIPER_PLACE=0: ranks follow the plan\'s order on the Slurm node list" >&2',
    'elif timeout "$((${PLACE_LIMIT_S%.*} + 60))" "${PLACE[@]}" >&2 '
    '&& mapfile -t PLACED_HOSTS < "$PLACE_DIR/hostfile" '
    '&& read -r -a PLACED_LOCAL < "$PLACE_DIR/local_ranks" '
    "&& (( ${#PLACED_HOSTS[@]} == WORLD_SIZE && ${#PLACED_LOCAL[@]} == WORLD_SIZE )); then",
    "  PLACED=1",
    "else",
    "  echo \"piper: WARNING: placement failed (see above); ranks follow the plan's order on "
    'the Slurm node list" >&2',
    "fi",
    'if [[ "$PLACED" == 1 ]]; then',
    '  cp "$PLACE_DIR/hostfile" "$HOSTFILE"',
    '  RANK_LOCAL=("${PLACED_LOCAL[@]}")',
    "else",
    '  : > "$HOSTFILE"',
    '  for node in "${RANK_NODE[@]}"; do echo "${HOSTS[$node]}" >> "$HOSTFILE"; done',
    "fi",
    'mapfile -t RANK_HOST < "$HOSTFILE"',
    'export SLURM_HOSTFILE="$HOSTFILE"',
    'export MASTER_ADDR="${RANK_HOST[0]}"',
    'export MASTER_PORT="${MASTER_PORT:-29500}"',
    "export WORLD_SIZE",
    'export PIPER_RANK_LOCAL="${RANK_LOCAL[*]}"',
)
_LAUNCH = (
    "# one task per rank; RANK = task id, LOCAL_RANK = the plan's device index",
    "# shellcheck disable=SC2016  # expanded by each task's bash, not here",
    'TASK=\'read -r -a L <<< "$PIPER_RANK_LOCAL"; export RANK=$SLURM_PROCID '
    'LOCAL_RANK=${L[$SLURM_PROCID]}; exec "$@"\'',
    'SRUN=(srun --ntasks="$WORLD_SIZE" --distribution=arbitrary bash -c "$TASK" piper-rank)',
)
_RUN = (
    'if [[ "$DRY_RUN" == 1 ]]; then',
    '  printf "%q " "${SRUN[@]}" "${CMD[@]}"; echo',
    "else",
    '  exec "${SRUN[@]}" "${CMD[@]}"',
    "fi",
)


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
        "# job start (PIPER_PLACE=0: the plan's rank-to-node order on Slurm's node list)",
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


def _trainer_lines(
    plan: Plan, trainer: Trainer, plan_path: str, args_file: str | None, command: str | None
) -> list[str]:
    """The trainer's environment, its sourced args file and CMD."""
    if trainer == "piper":
        # the dispatcher and precision the plan was priced with, spelled out (the launcher
        # defaults to the plan's too; at full size it refuses any other)
        dispatcher = str(plan.extra.get("dispatcher", "flat"))
        cmd = command or shlex.join(
            ["python", "-m", "runtime.launch", "--plan", plan_path, "--out", "results/run",
             "--dispatcher", dispatcher, "--precision", "plan"]
        )  # fmt: skip
        return [f"CMD=({cmd})"]
    if not args_file:
        raise SpecError(f"export: the {trainer} trainer needs the path of its args file")
    export = shlex.join(["piper", "export", plan_path, "--to", trainer, "--out", args_file])
    lines = [
        f"ARGS_FILE={shlex.quote(args_file)}",
        'if [[ ! -f "$ARGS_FILE" ]]; then',
        f'  echo "piper: $ARGS_FILE is missing; write it with:" {shlex.quote(export)} >&2; exit 1',
        "fi",
        "# shellcheck source=/dev/null",
        'source "$ARGS_FILE"',
    ]
    if trainer == "megatron":  # also set by the args file; here so --command keeps it
        lines += [f"export {k}={shlex.quote(v)}" for k, v in megatron_env(plan)]
    return [*lines, f"CMD=({command or TRAINER_COMMANDS[trainer]})"]


def slurm_script(
    plan: Plan,
    plan_path: str,
    command: str | None,
    trainer: Trainer = "piper",
    args_file: str | None = None,
) -> tuple[str, tuple[str, ...]]:
    """The sbatch script text and its notes (see the module docstring).

    Args:
        plan: a loaded plan.json.
        plan_path: the plan file as the script names it (the CLI passes an absolute path).
        command: the per-rank trainer command (default: the trainer's own).
        trainer: piper | megatron | torchtitan.
        args_file: the Megatron or torchtitan export the script sources.
    """
    if trainer not in TRAINERS:
        raise SpecError(f"export: unknown trainer '{trainer}'; use one of {', '.join(TRAINERS)}")
    node_of, local_of, num_nodes, per_node = rank_layout(plan)
    gpus = plan.cluster.gpus_per_node or per_node
    notes = []
    if per_node < gpus:
        notes.append(f"the plan uses {per_node} of {gpus} devices on its busiest node")
    if trainer == "megatron" and not command:
        notes.append("add your tokenizer and data flags to CMD; MEGATRON_LM is your checkout")
    env = comm_env(plan.cluster)
    lines = [
        *_header(plan, notes, num_nodes, per_node, gpus),
        f"WORLD_SIZE={len(node_of)}",
        f"NUM_NODES={num_nodes}",
        "# allocation node (0-based, in the order Slurm lists the job's nodes) of each rank",
        f"RANK_NODE=({' '.join(map(str, node_of))})",
        "# device index inside its node of each rank",
        f"RANK_LOCAL=({' '.join(map(str, local_of))})",
        f"PLAN={shlex.quote(plan_path)}",
        *_HOSTS,
        *_PLACE,
        "# communication library settings for this cluster",
        *export_lines(env, "plan.json: cluster.env"),
        "",
        *_trainer_lines(plan, trainer, plan_path, args_file, command),
        *_LAUNCH,
        *_RUN,
    ]
    return "\n".join(lines) + "\n", tuple(notes)
