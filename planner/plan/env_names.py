"""What a plan's `cluster.env` may set in the job that runs it: the allow-list of variables.

A plan is a file people pass around, and bash, the dynamic loader and the libraries a job runs
read some variables as code to run or load (BASH_ENV runs a file at every bash start,
LD_PRELOAD loads a library into every process, NCCL_NET_PLUGIN loads a network plugin,
OMP_TOOL_LIBRARIES a tool) or as files to read or write (NCCL_CONF_FILE, NCCL_DEBUG_FILE). So
`cluster.env` may set only the tuning variables of the communication libraries and the
threading runtime, by this allow-list (planner/EXPORT.md gives the reason per family):

- families, by prefix: NCCL_, RCCL_, TORCH_NCCL_, NVSHMEM_, FI_ (libfabric), UCX_, GLOO_,
  HSA_ (the ROCm runtime under RCCL);
- single names: OMP_NUM_THREADS, OMP_PROC_BIND, OMP_PLACES, MKL_NUM_THREADS,
  OPENBLAS_NUM_THREADS, CUDA_DEVICE_MAX_CONNECTIONS;

and within a family no name with a word (between '_') that names code, a path or a file:
PLUGIN, PATH, LIB, LIBRARY, FILE, DIR, CONF, PRELOAD, MODULE, COMMAND, CMD, EXEC, HOOK,
SCRIPT, SO (and their plurals). Each value is a string without a NUL byte or a number.
Anything else is refused in one line naming the variable. `check_env` runs when a plan is read
(planner.plan.check) and again when the Slurm export writes the job
(planner.outputs.export.job_env), so a plan that names a refused variable is refused by every
command that reads it.
"""

from __future__ import annotations

import re
from typing import Any

from planner.inputs.shown import shown, shown_text
from planner.specs import SpecError

# POSIX shell variable names (IEEE Std 1003.1, XBD 3.235 "Name"); bash's `export` takes these.
ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
ALLOWED_PREFIXES = ("NCCL_", "RCCL_", "TORCH_NCCL_", "NVSHMEM_", "FI_", "UCX_", "GLOO_", "HSA_")
ALLOWED_NAMES = frozenset({
    "OMP_NUM_THREADS", "OMP_PROC_BIND", "OMP_PLACES", "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS", "CUDA_DEVICE_MAX_CONNECTIONS",
})  # fmt: skip
# words of a variable name that make it load code or name a path or file
LOADING_WORDS = frozenset({
    "PLUGIN", "PLUGINS", "PATH", "PATHS", "LIB", "LIBS", "LIBRARY", "LIBRARIES", "LIBPATH",
    "LIBDIR", "FILE", "FILES", "FILENAME", "DIR", "DIRS", "DIRECTORY", "CONF", "PRELOAD",
    "MODULE", "MODULES", "COMMAND", "CMD", "EXEC", "HOOK", "HOOKS", "SCRIPT", "SO",
})  # fmt: skip
WHERE = "plan.json: cluster.env"


def env_name(name: object, where: str) -> str:
    """`name` if it is a valid environment variable name, else a SpecError naming `where`."""
    if not isinstance(name, str) or not ENV_NAME.match(name):
        raise SpecError(
            f"{where}: {shown(name)} is not an environment variable name (letters, digits and "
            "'_', not starting with a digit); rename or remove it"
        )
    return name


def check_env_name(name: object, where: str = WHERE) -> str:
    """`name` if a plan may set it in the job (module docstring), else a one-line SpecError."""
    key = env_name(name, where)
    loading = sorted(LOADING_WORDS.intersection(key.split("_")))
    if key in ALLOWED_NAMES or (key.startswith(ALLOWED_PREFIXES) and not loading):
        return key
    if key.startswith(ALLOWED_PREFIXES):
        why = f"it names code or a file to load ({loading[0]})"
    else:
        why = "only communication-library and threading variables may be set from a plan"
    raise SpecError(
        f"{where}.{shown_text(key)}: refused: {why} (planner/EXPORT.md, 'Slurm'); remove it "
        "from plan.json and set it in the job's environment yourself if your site needs it"
    )


def check_env(env: Any, where: str = WHERE) -> dict[str, str]:
    """A plan's `cluster.env` (None: empty) as the variables it sets, each name allowed by
    check_env_name and each value a string without a NUL byte or a number, as text; anything
    else is a one-line SpecError naming the variable."""
    if not isinstance(env, dict | None):
        raise SpecError(f"{where} must be a mapping of variable to value; fix the plan")
    out = {}
    for name, value in (env or {}).items():
        key = check_env_name(name, where)
        if isinstance(value, dict | list) or value is None:
            raise SpecError(f"{where}.{key} must be a string or number; fix the value")
        if "\x00" in str(value):
            raise SpecError(f"{where}.{key}: the value holds a NUL byte; remove it")
        out[key] = str(value)
    return out
