"""The communication-library environment of the Slurm job, and what a plan may add to it.

`comm_env(cluster)` is a starting point by platform plus the plan's own `cluster.env`. A
plan is a file people pass around, and bash, the dynamic loader and the libraries a job runs
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
SCRIPT, SO (and their plurals). Anything else is refused in one line naming the variable.
"""

from __future__ import annotations

from planner.outputs.export.shell import env_name
from planner.plan.schema import ClusterEntry
from planner.specs import SpecError

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
        f"{where}.{key}: refused: {why} (planner/EXPORT.md, 'Slurm'); remove it from "
        "plan.json and set it in the job's environment yourself if your site needs it"
    )


def comm_env(cluster: ClusterEntry) -> dict[str, str]:
    """NCCL/RCCL variables for the plan's cluster (by name and device), plus its own `env`
    (each name checked by check_env_name)."""
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
        raise SpecError(f"{WHERE} must be a mapping of variable to value")
    for key, value in extra.items():
        if isinstance(value, dict | list) or value is None:
            raise SpecError(f"{WHERE}.{env_name(key, WHERE)} must be a string or number; "
                            "fix the value")  # fmt: skip
        env[check_env_name(key)] = str(value)
    return env
