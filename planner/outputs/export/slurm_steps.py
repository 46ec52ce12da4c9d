"""The fixed steps of the Slurm job in bash: hosts, placement at job start, the script's own
variables, srun (planner.outputs.export.slurm puts the plan's values around them).

The variables these lines expect the script to have set: WORLD_SIZE, NUM_NODES, RANK_NODE,
RANK_LOCAL, PLAN, PLACE_BY_HOSTNAME (1 where the cluster's host names give each node's switch
and group: Frontier) and CMD.
"""

from __future__ import annotations

# The job's hosts (placeholders outside an allocation) and where its hostfile goes: a dry run
# writes only into a fresh temporary folder (or PIPER_HOSTFILE), never into the submit folder.
HOSTS = (
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
    'if [[ -n "${PIPER_HOSTFILE:-}" ]]; then',
    '  HOSTFILE="$PIPER_HOSTFILE"',
    'elif [[ "$DRY_RUN" == 1 ]]; then',
    '  HOSTFILE="$(mktemp -d "${TMPDIR:-/tmp}/piper-dry-run.XXXXXX")/hostfile"',
    "else",
    '  HOSTFILE="${SLURM_SUBMIT_DIR:-$PWD}/piper_hostfile.${SLURM_JOB_ID:-0}"',
    "fi",
)
PLACE = (
    "# Placement at job start. 'piper place' re-solves the rank IP on the nodes Slurm gave",
    "# this job (the plan's layout fixed) and writes the hostfile srun follows. It needs each",
    "# node's place in the fabric (its switch and group):",
    "# - Frontier: its host names give it; nothing to set.",
    "# - elsewhere: export PIPER_TOPOLOGY=<Slurm's topology.conf or topology.yaml> before",
    "#   sbatch ('scontrol show config | grep -i topology' names the plugin; the file lies",
    "#   beside slurm.conf). Without it the job says so in one line and keeps Slurm's order.",
    "# - PIPER_PLACE=0 skips placement: rank r runs on the job's node number ranks[r].node",
    "#   (plan.json) in the order Slurm lists the nodes.",
    "# PIPER_PLACE_TIME_LIMIT_S is the rank IP's budget (default 30 s; the command gets 60 s",
    "# more); PIPER names the piper executable. If placement fails, the job warns once and",
    "# keeps Slurm's order.",
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
    'if [[ "${PIPER_PLACE:-1}" == 0 ]]; then',
    '  echo "piper: PIPER_PLACE=0: ranks follow the plan\'s order on the Slurm node list" >&2',
    'elif [[ -z "${PIPER_TOPOLOGY:-}" && "$PLACE_BY_HOSTNAME" != 1 ]]; then',
    "  echo \"piper: ranks follow the plan's order on Slurm's node list, unplaced: 'piper "
    "place' needs the fabric's switches and groups, which this cluster's host names do not "
    "give; set PIPER_TOPOLOGY to Slurm's topology.conf or topology.yaml to place them, or "
    'PIPER_PLACE=0 to choose this order" >&2',
    'elif [[ -z "${SLURM_JOB_NODELIST:-}" ]]; then',
    '  echo "piper: inside an allocation this runs: $(printf "%q " "${PLACE[@]:0:4}")'
    '\\"\\$SLURM_JOB_NODELIST\\" $(printf "%q " "${PLACE[@]:5}")" >&2',
    '  echo "piper: and uses its hostfile; here ranks follow the plan\'s order" >&2',
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
)
# Set after the plan's environment and the sourced args file, so neither can change them.
OWN = (
    "# the job's own variables, set after everything the plan and the args file set",
    'mapfile -t RANK_HOST < "$HOSTFILE"',
    'export SLURM_HOSTFILE="$HOSTFILE"',
    'export MASTER_ADDR="${RANK_HOST[0]}"',
    'export MASTER_PORT="${MASTER_PORT:-29500}"',
    "export WORLD_SIZE",
    'export PIPER_RANK_LOCAL="${RANK_LOCAL[*]}"',
)
LAUNCH = (
    "# one task per rank; RANK = task id, LOCAL_RANK = the plan's device index",
    "# shellcheck disable=SC2016  # expanded by each task's bash, not here",
    'TASK=\'read -r -a L <<< "$PIPER_RANK_LOCAL"; export RANK=$SLURM_PROCID '
    'LOCAL_RANK=${L[$SLURM_PROCID]}; exec "$@"\'',
    'SRUN=(srun --ntasks="$WORLD_SIZE" --distribution=arbitrary bash -c "$TASK" piper-rank)',
    'if [[ "$DRY_RUN" == 1 ]]; then',
    '  echo "piper: dry run: the hostfile is $HOSTFILE; the srun command:" >&2',
    '  printf "%q " "${SRUN[@]}" "${CMD[@]}"; echo',
    "else",
    '  exec "${SRUN[@]}" "${CMD[@]}"',
    "fi",
)
