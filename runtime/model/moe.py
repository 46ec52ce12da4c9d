"""The MoE block: Router -> dispatch -> local Experts -> combine, single-device code.

The layer holds only the experts of its own EP rank (stacked along a leading "slot" axis,
slots in ascending expert id, the order the dispatcher groups rows in). All process-group
work lives behind the TokenDispatcher handed in from outside; with `LocalDispatcher` the
layer runs on one device holding every expert.

Shape letters: T = tokens on this rank, D = hidden size, F = expert FFN width,
K = top-k, E = routed experts, N = rows received for the local experts, X = local slots.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.specs import MoESpec
from runtime.dispatch.local import LocalDispatcher


def seeded_generator(*key: int) -> torch.Generator:
    """A CPU generator seeded from integers, so a weight depends only on its identity."""
    h = 1469598103934665603
    for k in key:
        h = ((h ^ (k & 0xFFFFFFFF)) * 1099511628211) % (2**61 - 1)
    return torch.Generator().manual_seed(h)


def init_uniform_(weight: torch.Tensor, fan_in: int, gen: torch.Generator) -> None:
    """Kaiming-uniform-like init from an explicit generator (identical on every rank)."""
    bound = 1.0 / math.sqrt(fan_in)
    with torch.no_grad():
        w = torch.empty(weight.shape, dtype=torch.float32).uniform_(-bound, bound, generator=gen)
        weight.copy_(w)


class Router(nn.Module):
    """Top-k softmax router; `bias_E` (aux-loss-free balancing) shifts selection only."""

    def __init__(self, d: int, spec: MoESpec, seed: int, layer: int) -> None:
        super().__init__()
        self.top_k = spec.top_k
        self.weight = nn.Parameter(torch.empty(spec.num_experts, d))
        init_uniform_(self.weight, d, seeded_generator(seed, layer, 1))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.router_bias else None
        self.register_buffer("bias_E", torch.zeros(spec.num_experts), persistent=False)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert_TK int64, gate_TK float): chosen experts and their weights."""
        logits = F.linear(x_TD, self.weight, self.bias)
        probs = logits.float().softmax(dim=-1)
        _, expert_TK = torch.topk(probs.detach() + self.bias_E, self.top_k, dim=-1)
        gate_TK = probs.gather(1, expert_TK)
        if self.top_k > 1:
            gate_TK = gate_TK / gate_TK.sum(dim=-1, keepdim=True)
        return expert_TK, gate_TK.to(x_TD.dtype)


class Experts(nn.Module):
    """The routed experts of one rank, stacked: parameter [X, ...] for X local slots.

    Each expert's initial weights depend only on (seed, layer, expert id), so any placement
    of the same experts gives the same model. `expert_ids` lists the slot owners ascending.
    """

    def __init__(self, d: int, spec: MoESpec, expert_ids: list[int], seed: int, layer: int):
        super().__init__()
        x, f = len(expert_ids), spec.expert_ffn
        self.gated = spec.gated
        self.expert_ids = list(expert_ids)
        self.w_in = nn.Parameter(torch.empty(x, d, f))
        self.w_gate = nn.Parameter(torch.empty(x, d, f)) if spec.gated else None
        self.w_out = nn.Parameter(torch.empty(x, f, d))
        self.b_in = nn.Parameter(torch.zeros(x, f)) if spec.expert_bias else None
        self.b_gate = nn.Parameter(torch.zeros(x, f)) if spec.expert_bias and spec.gated else None
        self.b_out = nn.Parameter(torch.zeros(x, d)) if spec.expert_bias else None
        self.seed, self.layer = seed, layer
        for slot, e in enumerate(expert_ids):
            self.init_slot(slot, e)

    def init_slot(self, slot: int, expert: int) -> None:
        gen = seeded_generator(self.seed, self.layer, 1000 + expert)
        d, f = self.w_in.shape[1], self.w_in.shape[2]
        init_uniform_(self.w_in[slot], d, gen)
        if self.w_gate is not None:
            init_uniform_(self.w_gate[slot], d, gen)
        init_uniform_(self.w_out[slot], f, gen)

    def slot_params(self) -> list[nn.Parameter]:
        """Every parameter with the slot axis first (what migration moves)."""
        names = ("w_in", "w_gate", "w_out", "b_in", "b_gate", "b_out")
        return [p for p in (getattr(self, n) for n in names) if p is not None]

    def forward(self, x_ND: torch.Tensor, counts_X: list[int]) -> torch.Tensor:
        """Apply slot i's expert to the i-th contiguous chunk of rows (counts_X rows each)."""
        outs = []
        for slot, rows in enumerate(x_ND.split(counts_X, dim=0)):
            h = rows @ self.w_in[slot]
            if self.b_in is not None:
                h = h + self.b_in[slot]
            if self.gated:
                g = rows @ self.w_gate[slot]
                if self.b_gate is not None:
                    g = g + self.b_gate[slot]
                h = F.silu(g) * h
            else:
                h = F.gelu(h)
            y = h @ self.w_out[slot]
            if self.b_out is not None:
                y = y + self.b_out[slot]
            outs.append(y)
        if not outs:
            return x_ND[:0]
        return torch.cat(outs, dim=0)


class MoELayer(nn.Module):
    """Route (top-k) -> dispatch -> local experts -> combine -> gate-weighted sum.

    Args:
        d: hidden size. spec: the layer's MoESpec. rank_of_expert_E: EP rank of each expert.
        ep_rank: this rank's index in its EP group. seed, layer: weight identity.
    The routing table can be swapped with `set_placement` (live migration).
    `tokens_E` accumulates tokens this rank routed to each expert since the last reset.
    """

    def __init__(
        self,
        d,
        spec: MoESpec,
        rank_of_expert_E,
        ep_rank: int,
        seed: int,
        layer: int,
    ):
        super().__init__()
        self.spec, self.ep_rank, self.layer = spec, ep_rank, layer
        self.router = Router(d, spec, seed, layer)
        self.register_buffer("rank_of_expert_E", torch.tensor(list(rank_of_expert_E)), False)
        local = [e for e, r in enumerate(rank_of_expert_E) if r == ep_rank]
        self.experts = Experts(d, spec, local, seed, layer)
        self.register_buffer("tokens_E", torch.zeros(spec.num_experts, dtype=torch.long), False)
        self.dispatcher = LocalDispatcher()
        self.counting = True  # off during the pipeline's shape-inference forward

    def set_placement(self, rank_of_expert_E) -> None:
        """Swap the routing table (the expert weights must already sit in their new slots)."""
        self.rank_of_expert_E = torch.tensor(list(rank_of_expert_E))
        self.experts.expert_ids = [e for e, r in enumerate(rank_of_expert_E) if r == self.ep_rank]

    def forward(self, x_BSD: torch.Tensor, count_tokens: bool = True) -> torch.Tensor:
        """count_tokens=False: a recomputation (activation checkpointing) of tokens already
        counted in `tokens_E`."""
        shape = x_BSD.shape
        x_TD = x_BSD.reshape(-1, shape[-1])
        expert_TK, gate_TK = self.router(x_TD)
        if self.counting and count_tokens:
            self.tokens_E += torch.bincount(expert_TK.reshape(-1), minlength=len(self.tokens_E))
        x_ND, counts, handle = self.dispatcher.dispatch(x_TD, expert_TK, self.rank_of_expert_E)
        counts_X = counts.tolist() if torch.is_tensor(counts) else list(counts)
        y_ND = self.experts(x_ND, counts_X)
        # gate-weighted combine: HALO-dedup sums a token's experts on their node first
        y_TD = self.dispatcher.combine(y_ND, handle, gate_TK)
        return y_TD.reshape(shape)
