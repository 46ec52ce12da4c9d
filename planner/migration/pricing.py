"""Prices of moving experts and of imbalance, both in seconds, so policies can trade them.

Move: one routed expert carries 16 B per parameter (bf16 weight + bf16 gradient + fp32
master + two fp32 Adam moments; `TrainingSpec.bytes_per_param`). Moving it from EP rank
`src` to `dst` crosses the innermost topology level whose domain holds both devices
(`planner.topology.span_level_index`) and takes

    seconds = bytes / (level.bw_gbps * 1e9) + level.latency_us * 1e-6.

Imbalance: an MoE layer's expert compute runs at the pace of its hottest rank. With
`tokens_per_rank_step` tokens per EP rank and step, each routed to top_k experts, the
balanced expert time of one rank over one interval is

    balanced_s = steps_per_interval * tokens_per_rank_step * top_k * 6 * P_expert
                 / (peak_tflops * 1e12 * gemm_efficiency)

(6 FLOPs per parameter and token: forward 2, backward 4), and an interval whose
placement has imbalance m = max rank load / mean rank load costs m * balanced_s.

Shape letters: L = MoE layers of the trace, R = expert-parallel ranks.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from planner.resources.params import layer_params
from planner.specs import ClusterSpec, ModelSpec, SpecError, TrainingSpec
from planner.topology import span_level_index

FLOPS_PER_PARAM_TOKEN = 6  # forward 2 + backward 4 (weight and input gradients)


@dataclass(frozen=True, eq=False)
class MoveCosts:
    """Everything a policy needs to price a placement change, per MoE layer.

    expert_bytes_L: bytes moved per expert move (bytes per parameter x params of one routed
        expert).
    move_s_LRR: seconds to move one expert of layer l from rank i to rank j (0 on the diagonal).
    level_LRR: topology level index each move crosses (-1 on the diagonal).
    balanced_s_L: expert compute seconds per rank over one interval at perfect balance.
    level_names: names of the cluster's levels, for reports.
    """

    expert_bytes_L: np.ndarray
    move_s_LRR: np.ndarray
    level_LRR: np.ndarray
    balanced_s_L: np.ndarray
    level_names: tuple[str, ...] = ()

    @property
    def num_ranks(self) -> int:
        return int(self.move_s_LRR.shape[1])


def expert_bytes(model: ModelSpec, layer: int, bytes_per_param: int = 16) -> int:
    """Bytes of one routed expert of transformer layer `layer` (its model's first MoE if dense)."""
    layers = model.layers
    spec = layers[layer] if 0 <= layer < len(layers) and layers[layer].moe else None
    if spec is None:
        moe_layers = model.moe_layers
        if not moe_layers:
            raise SpecError(f"model {model.name} has no MoE layer; pick an MoE model with --model")
        spec = layers[moe_layers[0]]
    return bytes_per_param * layer_params(model, spec).expert


def link_matrices(cluster: ClusterSpec, devices_R: Sequence[int]) -> tuple[np.ndarray, ...]:
    """Per rank pair: (level index, bytes/s, latency s) of the link a move crosses."""
    num_r = len(devices_R)
    level_RR = np.full((num_r, num_r), -1, dtype=np.int64)
    bw_RR = np.full((num_r, num_r), np.inf)
    lat_RR = np.zeros((num_r, num_r))
    for i in range(num_r):
        for j in range(num_r):
            if i == j:
                continue
            idx = span_level_index(cluster, [devices_R[i], devices_R[j]])
            level = cluster.levels[idx]
            level_RR[i, j] = idx
            bw_RR[i, j] = level.bw_gbps * 1e9
            lat_RR[i, j] = level.latency_us * 1e-6
    return level_RR, bw_RR, lat_RR


def balanced_expert_s(
    model: ModelSpec,
    cluster: ClusterSpec,
    layer: int,
    steps_per_interval: int,
    tokens_per_rank_step: int,
    dtype: str = "bf16",
) -> float:
    """Expert compute seconds per rank over one interval when loads are perfectly balanced."""
    params = expert_bytes(model, layer, 1)
    top_k = model.top_k
    flops = steps_per_interval * tokens_per_rank_step * top_k * FLOPS_PER_PARAM_TOKEN * params
    rate = cluster.device.peak(dtype) * 1e12 * cluster.gemm_efficiency
    return flops / rate


def build_move_costs(
    model: ModelSpec,
    cluster: ClusterSpec,
    layer_ids: Sequence[int],
    devices_LR: Sequence[Sequence[int]],
    steps_per_interval: int = 100,
    tokens_per_rank_step: int = 32768,
    training: TrainingSpec | None = None,
) -> MoveCosts:
    """Price moves and imbalance for each trace layer.

    Args:
        layer_ids: transformer layer index of each trace layer (length L).
        devices_LR: device id of each EP rank, per trace layer (L lists of R ints).
        steps_per_interval: training steps between two placement decisions.
        tokens_per_rank_step: tokens each EP rank feeds its MoE layers per step.
        training: supplies bytes_per_param (16 or 18) and dtype; defaults to TrainingSpec().
    """
    training = training or TrainingSpec()
    if steps_per_interval <= 0 or tokens_per_rank_step <= 0:
        raise SpecError("--steps-per-interval and --tokens-per-step must be positive")
    bytes_L, move_s, levels, balanced = [], [], [], []
    for layer, devices_R in zip(layer_ids, devices_LR, strict=True):
        nbytes = expert_bytes(model, layer, training.bytes_per_param)
        level_RR, bw_RR, lat_RR = link_matrices(cluster, devices_R)
        bytes_L.append(nbytes)
        move_s.append(np.where(level_RR < 0, 0.0, nbytes / bw_RR + lat_RR))
        levels.append(level_RR)
        balanced.append(
            balanced_expert_s(
                model, cluster, layer, steps_per_interval, tokens_per_rank_step, training.dtype
            )
        )
    return MoveCosts(
        expert_bytes_L=np.asarray(bytes_L, dtype=np.int64),
        move_s_LRR=np.stack(move_s),
        level_LRR=np.stack(levels),
        balanced_s_L=np.asarray(balanced),
        level_names=tuple(level.name for level in cluster.levels),
    )
