"""Optimizer state in host memory: the host's share of the optimizer step.

With Megatron's --optimizer-cpu-offload --optimizer-offload-fraction F
--overlap-cpu-optimizer-d2h-h2d (HybridDeviceOptimizer, `megatron/core/optimizer/
cpu_offloading/hybrid_optimizer.py`), the first F of each rank's optimizer parameters (by count)
are updated by the CPU: their gradients go device -> host, torch's fused CPU Adam updates an fp32
copy and its moments in pinned host memory, and the updated weights go host -> device. With
the overlap flag the three run concurrently per parameter group, so the step pays the slowest:

    host_s = P_host x max(grad B / link, ADAM_HOST_BYTES / host memory, weight B / link)

P_host = F x the rank's optimizer parameters (sharded over the data-parallel group with the
distributed optimizer). Adam is memory-bound on the host: it reads the fp32 parameter,
gradient and both moments and writes the parameter and moments, 28 B per parameter
(ADAM_HOST_BYTES). Per-GPU bandwidths come from the device name (HOST_LINKS; spec-sheet peaks,
so this is a lower bound on the time).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.parallel import ParallelConfig
from planner.resources.memory import grad_bytes_per_param, weight_bytes_per_param
from planner.specs import ClusterSpec, TrainingSpec

ADAM_HOST_BYTES = 4 * 4 + 3 * 4  # read p, g, m, v; write p, m, v (fp32)


@dataclass(frozen=True)
class HostLink:
    """Per-GPU host bandwidths (GB/s): the GPU-host link, one direction, and the host DRAM
    share of one GPU (the node's DRAM bandwidth over the GPUs that share it)."""

    link_gbps: float
    dram_gbps: float
    source: str


HOST_LINKS = {
    # PCIe Gen5 x16 per GPU (NVIDIA H100 datasheet: 128 GB/s bidirectional); DGX H100: two
    # Xeon 8480C, 8 x DDR5-4800 channels each (2 x 307 GB/s) for 8 GPUs
    "H100": HostLink(64.0, 76.8, "PCIe Gen5 x16; DGX H100 DDR5 / 8 GPUs"),
    "H200": HostLink(64.0, 76.8, "PCIe Gen5 x16; DGX H200 DDR5 / 8 GPUs"),
    # GB200 superchip: NVLink-C2C 900 GB/s bidirectional between one Grace and two B200s,
    # Grace LPDDR5X up to 512 GB/s (NVIDIA GB200 NVL72 datasheet), each shared by two GPUs
    "GB200": HostLink(225.0, 256.0, "NVLink-C2C 900 GB/s / 2 directions / 2 GPUs; LPDDR5X / 2"),
    # MI250X GCD: 36 GB/s Infinity Fabric to the EPYC host, DDR4 205 GB/s for 8 GCDs (Frontier)
    "MI250X": HostLink(36.0, 25.6, "Infinity Fabric CPU-GCD; Frontier node DDR4 / 8 GCDs"),
}
DEFAULT_HOST = "H100"  # a device not named above: a PCIe Gen5 host


def host_link(cluster: ClusterSpec) -> HostLink:
    """The HOST_LINKS entry whose key the device name contains (DEFAULT_HOST otherwise)."""
    name = cluster.device.name.upper()
    for key in sorted(HOST_LINKS, key=len, reverse=True):
        if key in name:
            return HOST_LINKS[key]
    return HOST_LINKS[DEFAULT_HOST]


def host_optimizer_s(
    held_per_stage: Sequence[tuple[float, float]],
    cluster: ClusterSpec,
    training: TrainingSpec,
    parallel: ParallelConfig,
) -> float:
    """Seconds the optimizer step waits for the host (module docstring): the slowest stage.

    Args:
        held_per_stage: (dense, expert) parameters one rank of each stage holds (dense already
            divided by tp, expert by ep x etp).
    Returns:
        0.0 without offload; else max over stages of P_host x the slowest per-parameter cost.
    """
    f = training.optimizer_offload_fraction
    if f <= 0.0:
        return 0.0
    link = host_link(cluster)
    per_param_s = max(
        grad_bytes_per_param(training) / (link.link_gbps * 1e9),
        ADAM_HOST_BYTES / (link.dram_gbps * 1e9),
        weight_bytes_per_param(training) / (link.link_gbps * 1e9),
    )
    worst = 0.0
    for dense, expert in held_per_stage:
        params = dense + expert
        if training.zero:
            params = dense / (parallel.dp * parallel.cp) + expert / parallel.edp
        worst = max(worst, f * params * per_param_s)
    return worst
