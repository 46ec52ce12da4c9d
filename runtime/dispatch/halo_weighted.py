"""Gate-weighted combine for HALO-dedup: the gateway of each node sums a token's rows.

`combine(y_ND, handle, gate_TK)` must return y_TD = sum_k gate_TK[t, k] * y(t, k). With dedup,
the gateway that received a token once for its node also sums that token's gate-weighted
expert outputs from its node, so one row per (token, node) crosses the network back. The
backward sends one gradient row per (token, node) out; the gates' gradients (scalars) come
back from the gateways with Phase III.

A mixin of runtime.dispatch.halo._HaloExchange: it uses that class's routing state (order_P,
token_sorted_P, rows_to_node, unique_tokens, gateway_index, ...) and its _forward/_reverse.
Shape letters as in runtime/dispatch/flat.py; R rows of one message.
"""

from __future__ import annotations

import torch
from torch import Tensor

from runtime.dispatch.flat import put_rows, take_rows

_TAG_GATE = 16


class WeightedReduction:
    """reverse_weighted / backward_weighted for _HaloExchange (see module docstring)."""

    @property
    def reduces_weighted(self) -> bool:
        """Whether combine(weight_TK) sums on the remote node (dedup, not direct)."""
        return self.dedup

    def reverse_weighted(self, y_ND: Tensor, weight_TK: Tensor) -> Tensor:
        """y_TD = sum_k weight_TK[t, k] * (expert output of (t, k)); gateways pre-sum per node."""
        weight_P = take_rows(weight_TK.reshape(-1), self.order_P).to(y_ND.dtype)
        local, from_node, _ = self._reverse(y_ND, weight_P)
        ranks = sorted(local)
        positions = [torch.arange(*self.seg_of_dest[r], device=self.device) for r in ranks]
        local_pos = self._cat(positions, self.order_P)
        local_rows = self._cat([local[r] for r in ranks], y_ND)
        y_TD = y_ND.new_zeros((self.num_tokens, y_ND.shape[1]))
        local_weighted = local_rows * take_rows(weight_P, local_pos)[:, None]
        y_TD.index_add_(0, take_rows(self.token_sorted_P, local_pos), local_weighted)
        for b in self.remote_nodes:
            y_TD.index_add_(0, self.unique_tokens[b], from_node[b])
        self.saved.update(weight_P=weight_P, local_pos=local_pos, local_rows=local_rows)
        return y_TD

    def _exchange_weights(self, ops: list, weight_P: Tensor) -> dict[int, Tensor]:
        """Sources send the gates of their pairs to each remote gateway; returns mine by src."""
        for b in self.remote_nodes:
            gw = self.topo.gateway(self.me, b)
            self._send(ops, take_rows(weight_P, self.rows_to_node[b]), gw, _TAG_GATE)
        return {
            src: self._recv(ops, self._pairs_to_node(src, self.my_node), weight_P, src, _TAG_GATE)
            for src in self.srcs_via[self.me]
        }

    def _gateway_first(self, src: int) -> int:
        """Unique tokens of src's message to my node that other ranks of my node also need
        (they come first; the rest, only the gateway's experts saw)."""
        return self.forwarded_unique_SN[src][self.my_node]

    def _gateway_own_sum(self, src: int, own_RD: Tensor, weight_R: Tensor) -> Tensor:
        """As a gateway: per unique token of src, the weighted sum of my own experts' rows
        (the last pairs in src's member order). Rows from _gateway_first(src) on are final."""
        partial = own_RD.new_zeros((self.unique_SN[src][self.my_node], own_RD.shape[1]))
        n = own_RD.shape[0]
        index = self.gateway_index[src][weight_R.shape[0] - n :]
        return partial.index_add_(0, index, own_RD * weight_R[weight_R.shape[0] - n :, None])

    def _gateway_sum(self, src: int, rows_RD: Tensor, weight_R: Tensor, partial: Tensor) -> Tensor:
        """As a gateway: adds the other ranks' rows (src's pairs in member order, mine last,
        already in `partial`) for one weighted-sum row per unique token; saved for backward."""
        self.saved.setdefault("gateway_rows", {})[src] = rows_RD
        self.saved.setdefault("gateway_weight", {})[src] = weight_R
        others = rows_RD.shape[0] - self.pairs_SS[src][self.me]
        index = self.gateway_index[src][:others]
        return partial.index_add_(0, index, rows_RD[:others] * weight_R[:others, None])

    def backward_weighted(self, grad_TD: Tensor) -> tuple[Tensor, Tensor]:
        """Gradients of reverse_weighted: (grad of expert rows [N, D], grad of gates [T, K])."""
        tok, saved = self.token_sorted_P, self.saved
        weight_P, rows_by_src = saved["weight_P"], saved.get("gateway_rows", {})
        grad_weight: dict[int, Tensor] = {}
        from_node: dict[int, Tensor] = {}

        def expand(src: int, pack: Tensor) -> Tensor:
            grad_RD = take_rows(pack, self.gateway_index[src])
            grad_weight[src] = (grad_RD * rows_by_src[src]).sum(dim=1)
            return grad_RD * saved["gateway_weight"][src][:, None]

        def extra(ops: list) -> None:  # gate gradients go back to their sources with Phase III
            for src in self.srcs_via[self.me]:
                self._send(ops, grad_weight[src], src, _TAG_GATE)
            for b in self.remote_nodes:
                rows, gw = self._pairs_to_node(self.me, b), self.topo.gateway(self.me, b)
                from_node[b] = self._recv(ops, rows, weight_P, gw, _TAG_GATE)

        grad_ND = self._forward(
            lambda pos: take_rows(grad_TD, tok[pos]) * weight_P[pos, None],
            grad_TD,
            pack=lambda b: take_rows(grad_TD, self.unique_tokens[b]),
            expand=expand,
            extra=extra,
        )
        grad_weight_sorted_P = weight_P.new_empty(weight_P.shape)
        local_pos = saved["local_pos"]
        local_grad = take_rows(grad_TD, take_rows(tok, local_pos)) * saved["local_rows"]
        put_rows(grad_weight_sorted_P, local_pos, local_grad.sum(1))
        for b in self.remote_nodes:
            put_rows(grad_weight_sorted_P, self.rows_to_node[b], from_node[b])
        grad_weight_P = torch.empty_like(grad_weight_sorted_P)
        put_rows(grad_weight_P, self.order_P, grad_weight_sorted_P)
        return grad_ND, grad_weight_P.reshape(self.num_tokens, self.topk)
