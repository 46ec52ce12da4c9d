"""The communication-library environment of the Slurm job, and what a plan may add to it.

`comm_env(cluster)` is a starting point by platform plus the plan's own `cluster.env`, whose
names pass the allow-list of planner.plan.env_names (check_env: communication-library and
threading tuning variables only, none that names code, a path or a file to load), which
reading the plan already applied.
"""

from __future__ import annotations

from planner.plan.env_names import check_env
from planner.plan.schema import ClusterEntry

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
    """NCCL/RCCL variables for the plan's cluster (by name and device), plus its own `env`
    (checked by planner.plan.env_names.check_env)."""
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
    env.update(check_env(cluster.profile.get("env")))
    return env
