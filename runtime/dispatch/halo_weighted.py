"""Gate-weighted combine for HALO-dedup: the gateway of each node sums a token's rows.

`combine(y_ND, handle, gate_TK)` must return y_TD = sum_k gate_TK[t, k] * y(t, k). With dedup,
the gateway that received a token once for its node also sums that token's gate-weighted
expert outputs from its node, so one row per (token, node) crosses the network back. The
backward sends one gradient row per (token, node) out; the gates' gradients (scalars) come
back from the gateways with Phase III.

Both steps take the frozen HaloPlan, the EPGroup and the pack indices the dedup dispatch
received (`gateway_index`); `reverse_weighted` returns what `backward_weighted` needs.
Shape letters as in runtime/dispatch/base.py (T, K, D, N, P = T * K); R rows of one message.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from runtime.dispatch.base import EPGroup, cat_rows, put_rows, take_rows
from runtime.dispatch.halo_phases import (
    TAG_GATE,
    TAG_II,
    TAG_II_OWN,
    forward,
    post,
    recv,
    regather,
    send,
    start_reverse,
    wait,
)
from runtime.dispatch.halo_plan import HaloPlan


@dataclass(frozen=True)
class WeightedSums:
    """What the backward of a weighted combine needs from its forward.

    Attributes:
      weight_P: gates of my pairs in sorted-pair order [P].
      local_pos: sorted-pair positions of the rows that came back from my node [R].
      local_rows: those rows [R, D].
      gateway_rows, gateway_weight: as a gateway, per remote source: the pair rows I summed
        (member order) [R, D] and their gates [R].
    """

    weight_P: Tensor
    local_pos: Tensor
    local_rows: Tensor
    gateway_rows: dict[int, Tensor]
    gateway_weight: dict[int, Tensor]


def reverse_weighted(
    plan: HaloPlan,
    ep: EPGroup,
    gateway_index: dict[int, Tensor],
    y_ND: Tensor,
    weight_TK: Tensor,
) -> tuple[Tensor, WeightedSums]:
    """y_TD = sum_k weight_TK[t, k] * (expert output of (t, k)); gateways pre-sum per node.

    Args:
      plan: the exchange's plan (dedup, three phases).
      gateway_index: per remote source whose gateway I am, its pack index [pairs].
      y_ND: my experts' output rows, grouped as dispatched [N, D].
      weight_TK: gates of my pairs [T, K].

    Returns:
      y_TD [T, D], and the WeightedSums for backward_weighted.
    """
    weight_P = take_rows(weight_TK.reshape(-1), plan.order_P).to(y_ND.dtype)
    local, from_node, gateway_rows, gateway_weight = _reverse(
        plan, ep, gateway_index, y_ND, weight_P
    )
    ranks = sorted(local)
    positions = [torch.arange(*plan.seg_of_dest[r], device=plan.device) for r in ranks]
    local_pos = cat_rows(positions, plan.order_P)
    local_rows = cat_rows([local[r] for r in ranks], y_ND)
    y_TD = y_ND.new_zeros((plan.num_tokens, y_ND.shape[1]))
    local_weighted = local_rows * take_rows(weight_P, local_pos)[:, None]
    y_TD.index_add_(0, take_rows(plan.token_sorted_P, local_pos), local_weighted)
    for b in plan.remote_nodes:
        y_TD.index_add_(0, plan.unique_tokens[b], from_node[b])
    return y_TD, WeightedSums(weight_P, local_pos, local_rows, gateway_rows, gateway_weight)


def _reverse(plan: HaloPlan, ep: EPGroup, gateway_index, y_ND: Tensor, weight_P: Tensor):
    """The reverse phases with gateway sums. Returns (pair rows from my node's ranks, by
    rank; per remote node one summed row per unique token; as a gateway, the pair rows and
    gates I summed per source)."""
    me, node = plan.me, plan.my_node
    start = start_reverse(plan, ep, y_ND, weighted=True)
    ops_w: list = []
    weights = _exchange_weights(plan, ep, ops_w, weight_P)
    works_w = post(ops_w)
    works_early = post(start.ops_early)
    works_iii = post(start.ops_iii)
    works_ii: list = []
    own = {s: start.back_to(s) for s in plan.srcs_via[me]}
    partial: dict[int, Tensor] = {}
    wait(works_w)
    for s in plan.srcs_via[me]:  # sum my own rows first: tokens only my experts saw can leave
        partial[s] = _gateway_own_sum(plan, gateway_index, s, own[s], weights[s])
        ops_own: list = []
        send(ep, ops_own, partial[s][plan.forwarded_unique_SQ[s][node] :], s, TAG_II_OWN)
        works_ii += post(ops_own)
    wait(works_iii)
    gateway_rows: dict[int, Tensor] = {}
    for s, rows_RD in regather(plan, start.at_gateway, y_ND, own).items():  # reverse Phase II
        gateway_rows[s] = rows_RD
        summed = _gateway_sum(plan, gateway_index, s, rows_RD, weights[s], partial[s])
        ops_ii: list = []  # each source's rows leave as soon as they are ready
        send(ep, ops_ii, summed[: plan.forwarded_unique_SQ[s][node]], s, TAG_II)
        works_ii += post(ops_ii)
    wait(works_ii + works_early)
    return start.local, start.from_fwd, gateway_rows, weights


def _exchange_weights(
    plan: HaloPlan, ep: EPGroup, ops: list, weight_P: Tensor
) -> dict[int, Tensor]:
    """Sources send the gates of their pairs to each remote gateway; returns mine by src."""
    for b in plan.remote_nodes:
        gw = plan.topo.gateway(plan.me, b)
        send(ep, ops, take_rows(weight_P, plan.rows_to_node[b]), gw, TAG_GATE)
    return {
        src: recv(ep, ops, plan.pairs_to_node(src, plan.my_node), weight_P, src, TAG_GATE)
        for src in plan.srcs_via[plan.me]
    }


def _gateway_own_sum(
    plan: HaloPlan, gateway_index, src: int, own_RD: Tensor, weight_R: Tensor
) -> Tensor:
    """As a gateway: per unique token of src, the weighted sum of my own experts' rows
    (the last pairs in src's member order). Rows from the forwarded count on are final."""
    partial = own_RD.new_zeros((plan.unique_SQ[src][plan.my_node], own_RD.shape[1]))
    n = own_RD.shape[0]
    index = gateway_index[src][weight_R.shape[0] - n :]
    return partial.index_add_(0, index, own_RD * weight_R[weight_R.shape[0] - n :, None])


def _gateway_sum(
    plan: HaloPlan, gateway_index, src: int, rows_RD: Tensor, weight_R: Tensor, partial: Tensor
) -> Tensor:
    """As a gateway: adds the other ranks' rows (src's pairs in member order, mine last,
    already in `partial`) for one weighted-sum row per unique token."""
    others = rows_RD.shape[0] - plan.pairs_SS[src][plan.me]
    index = gateway_index[src][:others]
    return partial.index_add_(0, index, rows_RD[:others] * weight_R[:others, None])


def backward_weighted(
    plan: HaloPlan,
    ep: EPGroup,
    gateway_index: dict[int, Tensor],
    saved: WeightedSums,
    grad_TD: Tensor,
) -> tuple[Tensor, Tensor]:
    """Gradients of reverse_weighted: (grad of expert rows [N, D], grad of gates [T, K])."""
    tok, weight_P = plan.token_sorted_P, saved.weight_P
    grad_weight: dict[int, Tensor] = {}
    from_node: dict[int, Tensor] = {}

    def expand(src: int, pack: Tensor) -> Tensor:
        grad_RD = take_rows(pack, gateway_index[src])
        grad_weight[src] = (grad_RD * saved.gateway_rows[src]).sum(dim=1)
        return grad_RD * saved.gateway_weight[src][:, None]

    def extra(ops: list) -> None:  # gate gradients go back to their sources with Phase III
        for src in plan.srcs_via[plan.me]:
            send(ep, ops, grad_weight[src], src, TAG_GATE)
        for b in plan.remote_nodes:
            rows, gw = plan.pairs_to_node(plan.me, b), plan.topo.gateway(plan.me, b)
            from_node[b] = recv(ep, ops, rows, weight_P, gw, TAG_GATE)

    grad_ND = forward(
        plan,
        ep,
        lambda pos: take_rows(grad_TD, tok[pos]) * weight_P[pos, None],
        grad_TD,
        pack=lambda b: take_rows(grad_TD, plan.unique_tokens[b]),
        expand=expand,
        extra=extra,
    )
    grad_weight_sorted_P = weight_P.new_empty(weight_P.shape)
    local_pos = saved.local_pos
    local_grad = take_rows(grad_TD, take_rows(tok, local_pos)) * saved.local_rows
    put_rows(grad_weight_sorted_P, local_pos, local_grad.sum(1))
    for b in plan.remote_nodes:
        put_rows(grad_weight_sorted_P, plan.rows_to_node[b], from_node[b])
    grad_weight_P = torch.empty_like(grad_weight_sorted_P)
    put_rows(grad_weight_P, plan.order_P, grad_weight_sorted_P)
    return grad_ND, grad_weight_P.reshape(plan.num_tokens, plan.topk)
