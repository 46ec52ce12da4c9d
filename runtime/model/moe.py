"""The MoE block: Router -> dispatch -> local Experts -> combine, single-device code.

The layer holds only the experts of its own EP rank, stacked along a leading "slot" axis in
the order of its row of the slot table (planner.run.spec.ExpertSlots; a replicated expert
has a slot on several ranks, runtime/model/replicas.py splits its tokens over them). All
process-group work lives behind the TokenDispatcher handed in from outside, which moves rows
to slots; with `LocalDispatcher` the layer runs on one device holding every expert.

Shape letters: T = tokens on this rank, D = hidden size, F = expert FFN width,
K = top-k, E = routed experts, N = rows received for the local experts, X = local slots.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from planner.run.spec import EMPTY, ExpertSlots
from planner.specs import MoESpec
from runtime.dispatch.local import LocalDispatcher
from runtime.model.arch import ModelArch
from runtime.model.replicas import SlotRouter
from runtime.precision import to_compute_dtype


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
    """Top-k router of `arch.router` kind; `bias_E` (aux-loss-free balancing, DeepSeek-V3's
    e_score_correction_bias) shifts the choice only, never the weights.

    softmax: softmax over all experts, top-k. topk_softmax: top-k of the logits, softmax over
    the k (GPT-OSS). sigmoid: sigmoid scores, top-k within the `topk_groups` best of
    `num_groups` expert groups (a group scores the sum of its two best), times
    routed_scaling_factor (DeepSeek-V3). Weights are renormalised per arch.norm_topk_prob.
    """

    def __init__(
        self, d: int, spec: MoESpec, seed: int, layer: int, arch: ModelArch | None = None
    ) -> None:
        super().__init__()
        self.arch = arch or ModelArch()
        self.top_k = spec.top_k
        if spec.num_experts % self.arch.num_groups:
            raise ValueError(
                f"{spec.num_experts} experts do not split into n_group={self.arch.num_groups}"
            )
        self.weight = nn.Parameter(torch.empty(spec.num_experts, d))
        init_uniform_(self.weight, d, seeded_generator(seed, layer, 1))
        self.bias = nn.Parameter(torch.zeros(spec.num_experts)) if spec.router_bias else None
        self.register_buffer("bias_E", torch.zeros(spec.num_experts), persistent=False)

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (expert_TK int64, gate_TK in x's dtype): chosen experts and their weights,
        scored in fp32."""
        arch = self.arch
        # fp32 logits and scores whatever the compute dtype: Megatron-Core's
        # moe_router_dtype="fp32" (router.py:106-111; DeepSeek-V3's, modeling_deepseek_v3.py:135)
        with torch.autocast(x_TD.device.type, enabled=False):
            bias = self.bias.float() if self.bias is not None else None
            logits = F.linear(x_TD.float(), self.weight.float(), bias)
        if arch.router == "topk_softmax":
            _, expert_TK = torch.topk(logits.detach().float() + self.bias_E, self.top_k, dim=-1)
            gate_TK = logits.gather(1, expert_TK).softmax(dim=-1)
            return expert_TK, gate_TK.to(x_TD.dtype)
        probs = logits.float().sigmoid() if arch.router == "sigmoid" else logits.float().softmax(-1)
        choice = probs.detach() + self.bias_E
        if arch.num_groups > 1:
            choice = _group_limited(choice, arch.num_groups, arch.topk_groups)
        _, expert_TK = torch.topk(choice, self.top_k, dim=-1)
        gate_TK = probs.gather(1, expert_TK)
        norm = arch.norm_topk_prob if arch.norm_topk_prob is not None else self.top_k > 1
        if norm:
            eps = 1e-20 if arch.router == "sigmoid" else 0.0  # DeepSeek's guard against 0 / 0
            gate_TK = gate_TK / (gate_TK.sum(dim=-1, keepdim=True) + eps)
        if arch.routed_scaling_factor != 1.0:
            gate_TK = gate_TK * arch.routed_scaling_factor
        return expert_TK, gate_TK.to(x_TD.dtype)


def _group_limited(choice_TE: torch.Tensor, groups: int, keep: int) -> torch.Tensor:
    """Scores of the experts outside each token's `keep` best groups set to -inf; a group
    scores the sum of its two best experts (DeepSeek-V3, modeling_deepseek_v3.py:138-151)."""
    t, e = choice_TE.shape
    by_group = choice_TE.view(t, groups, e // groups)
    group_TG = by_group.topk(min(2, e // groups), dim=-1)[0].sum(dim=-1)
    kept_TG = torch.zeros_like(group_TG)
    kept_TG.scatter_(1, torch.topk(group_TG, keep, dim=-1, sorted=False)[1], 1.0)
    mask_TE = kept_TG.bool()[:, :, None].expand(t, groups, e // groups).reshape(t, e)
    return choice_TE.masked_fill(~mask_TE, float("-inf"))


class Experts(nn.Module):
    """The routed experts of one rank, stacked: parameter [X, ...] for X local slots.

    Each expert's initial weights depend only on (seed, layer, expert id), so any placement
    of the same experts gives the same model and every copy of a replicated expert starts
    equal. `expert_ids` lists the expert of each slot (EMPTY: a free slot, all zeros).
    """

    def __init__(
        self,
        d: int,
        spec: MoESpec,
        expert_ids: list[int],
        seed: int,
        layer: int,
        arch: ModelArch | None = None,
    ):
        super().__init__()
        x, f = len(expert_ids), spec.expert_ffn
        self.gated = spec.gated
        arch = arch or ModelArch()
        self.limit, self.alpha = arch.swiglu_limit, arch.swiglu_alpha
        self.expert_ids = list(expert_ids)
        self.w_in = nn.Parameter(torch.empty(x, d, f))
        self.w_gate = nn.Parameter(torch.empty(x, d, f)) if spec.gated else None
        self.w_out = nn.Parameter(torch.empty(x, f, d))
        self.b_in = nn.Parameter(torch.zeros(x, f)) if spec.expert_bias else None
        self.b_gate = nn.Parameter(torch.zeros(x, f)) if spec.expert_bias and spec.gated else None
        self.b_out = nn.Parameter(torch.zeros(x, d)) if spec.expert_bias else None
        self.seed, self.layer = seed, layer
        self.gemm = "grouped"  # or "loop": the slots one by one (GEMMS)
        self._casts: tuple | None = None  # operands(): (key, casts, their parameters)
        for slot, e in enumerate(expert_ids):
            self.init_slot(slot, e)

    def init_slot(self, slot: int, expert: int) -> None:
        if expert == EMPTY:
            with torch.no_grad():
                for p in self.slot_params():
                    p[slot].zero_()
            return
        gen = seeded_generator(self.seed, self.layer, 1000 + expert)
        d, f = self.w_in.shape[1], self.w_in.shape[2]
        init_uniform_(self.w_in[slot], d, gen)
        if self.w_gate is not None:
            init_uniform_(self.w_gate[slot], d, gen)
        init_uniform_(self.w_out[slot], f, gen)

    def slot_params(self) -> list[nn.Parameter]:
        """Every parameter with the slot axis first (what migration moves)."""
        return [p for p in (getattr(self, n) for n in _SLOT_PARAMS) if p is not None]

    def forward(self, x_ND: torch.Tensor, counts_X: list[int]) -> torch.Tensor:
        """Apply slot i's expert to the i-th contiguous chunk of rows (counts_X rows each):
        in grouped GEMMs when `gemm` is "grouped" and the shapes allow it, else slot by slot.
        Under autocast the rows and the weights are in its dtype (`operands`), the output too."""
        x_ND = to_compute_dtype(x_ND)  # the grouped GEMM is not on autocast's list
        w = self.operands(x_ND.dtype)
        if self.gemm == "grouped" and grouped_mm_fits(x_ND, w["w_in"], w["w_out"]):
            return self._grouped(x_ND, counts_X, w)
        return self._loop(x_ND, counts_X, w)

    def operands(self, dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """The slot parameters (name -> [X, ...]) in `dtype`, as the GEMMs take them. A cast
        is made once and reused by every micro-batch until a parameter changes (its version
        moves on Adam's step, a migration, a checkpoint load), as autocast's weight cache
        does for the dense layers within the step: that cache keeps only the casts autocast
        makes of whole leaf tensors, and the grouped GEMM is not on its list while the loop
        would cast one slot's view at a time, so without this every micro-batch would round
        the expert weights again. `drop_operands` frees the copies between steps."""
        params = {n: getattr(self, n) for n in _SLOT_PARAMS if getattr(self, n) is not None}
        if all(p.dtype == dtype for p in params.values()):  # fp32, or FSDP's bf16 gather
            return params
        key = (
            dtype,
            torch.is_grad_enabled(),
            [(id(p), p._version, p.data_ptr()) for p in params.values()],
        )
        if self._casts is None or self._casts[0] != key:
            # the parameters stay referenced with their casts, so their ids are not reused
            self._casts = (key, {n: p.to(dtype) for n, p in params.items()}, list(params.values()))
        return self._casts[1]

    def drop_operands(self) -> None:
        """Free the cast weights `operands` keeps (the step is over)."""
        self._casts = None

    def _loop(self, x_ND: torch.Tensor, counts_X: list[int], w: dict) -> torch.Tensor:
        outs = []
        b_in, b_gate, b_out = w.get("b_in"), w.get("b_gate"), w.get("b_out")
        for slot, rows in enumerate(x_ND.split(counts_X, dim=0)):
            h = rows @ w["w_in"][slot]
            if b_in is not None:
                h = h + b_in[slot]
            if self.gated:
                g = rows @ w["w_gate"][slot]
                if b_gate is not None:
                    g = g + b_gate[slot]
                h = self._glu(g, h)
            else:
                h = F.gelu(h)
            y = h @ w["w_out"][slot]
            if b_out is not None:
                y = y + b_out[slot]
            outs.append(y)
        if not outs:
            return x_ND[:0]
        return torch.cat(outs, dim=0)

    def _glu(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """SwiGLU silu(gate) * up; with a limit, GPT-OSS's clamped form
        (up + 1) * gate * sigmoid(alpha * gate) on clamped inputs (modeling_gpt_oss.py:82-88)."""
        if not self.limit:
            return F.silu(gate) * up
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))

    def _grouped(self, x_ND: torch.Tensor, counts_X: list[int], w: dict) -> torch.Tensor:
        """The same as `_loop` in three grouped GEMMs (two without a gate) over all slots:
        torch._grouped_mm with offs = the cumulative row counts (rows of slot i between
        offs[i - 1] and offs[i]); biases added per row from the row's slot."""
        counts = torch.tensor(counts_X, device=x_ND.device)
        offs = counts.cumsum(0).to(torch.int32)
        slot_N = None
        if self.b_in is not None:
            slot_N = torch.repeat_interleave(
                torch.arange(len(counts_X), device=x_ND.device), counts
            )
        h = _gmm(x_ND, w["w_in"], offs, w.get("b_in"), slot_N)
        if self.gated:
            h = self._glu(_gmm(x_ND, w["w_gate"], offs, w.get("b_gate"), slot_N), h)
        else:
            h = F.gelu(h)
        return _gmm(h, w["w_out"], offs, w.get("b_out"), slot_N)


GEMMS = ("grouped", "loop")
_SLOT_PARAMS = ("w_in", "w_gate", "w_out", "b_in", "b_gate", "b_out")


def grouped_mm_fits(x_ND: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> bool:
    """torch._grouped_mm's layout rule: every row stride a multiple of 16 bytes (so D and F
    multiples of 4 in fp32, 8 in bf16), plain tensors (weights are cast to x's dtype)."""
    size = x_ND.element_size()
    plain = all(type(t) in (torch.Tensor, nn.Parameter) for t in (x_ND, w_in, w_out))
    return plain and all((n * size) % 16 == 0 for n in w_in.shape[1:])


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    return grad.contiguous()


def _gmm(x_ND, w_XAB, offs, b_XB, slot_N) -> torch.Tensor:
    """Grouped GEMM; the gradient reaching its output is made contiguous first
    (torch._grouped_mm's backward refuses an expanded one, e.g. from a sum). A tensor hook,
    not an identity Function: the output stays a plain tensor, no view (FSDP2 warns about
    views returned by the modules it wraps)."""
    y = torch._grouped_mm(x_ND, w_XAB, offs=offs)
    if y.requires_grad:
        y.register_hook(_contiguous)
    return y if b_XB is None else y + b_XB[slot_N]


class MoELayer(nn.Module):
    """Route (top-k) -> dispatch -> local experts -> combine -> gate-weighted sum.

    Args:
        d: hidden size. spec: the layer's MoESpec. rank_of_expert_E: EP rank of each expert
            (E/ep experts per rank, one slot each).
        ep_rank: this rank's index in its EP group. seed, layer: weight identity.
        arch: router kind and expert activation (runtime/model/arch.py).
    `init_slots` builds the experts of another slot table (replicas, free slots) before
    training; `set_slots` swaps the table once the weights sit in their slots (migration).
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
        arch: ModelArch | None = None,
    ):
        super().__init__()
        self.spec, self.ep_rank, self.layer, self.d, self.seed = spec, ep_rank, layer, d, seed
        self.arch = arch or ModelArch()
        self.router = Router(d, spec, seed, layer, self.arch)
        table = ExpertSlots.of_ranks(rank_of_expert_E, max(rank_of_expert_E) + 1)
        row = list(table.slots_RS[ep_rank])
        self.experts = Experts(d, spec, row, seed, layer, self.arch)
        self.set_slots(table)
        self.register_buffer("tokens_E", torch.zeros(spec.num_experts, dtype=torch.long), False)
        self.dispatcher = LocalDispatcher()
        self.counting = True  # off during the pipeline's shape-inference forward

    def init_slots(self, table: ExpertSlots) -> None:
        """Rebuild this rank's experts for `table` (EP group ranks) from their initial weights;
        before the optimizer holds them."""
        device = self.router.weight.device
        row = list(table.slots_RS[self.ep_rank])
        self.experts = Experts(self.d, self.spec, row, self.seed, self.layer, self.arch)
        self.experts = self.experts.to(device)
        self.set_slots(table)

    def set_slots(self, table: ExpertSlots) -> None:
        """Swap the slot table (EP group ranks; the weights must already sit in their slots)."""
        self.slots = table
        self.slot_router = SlotRouter(table, self.spec.num_experts)
        self.experts.expert_ids = list(table.slots_RS[self.ep_rank])

    @property
    def rank_of_expert_E(self) -> torch.Tensor:
        """The lowest EP group rank holding each expert [E]."""
        return torch.tensor(self.slots.rank_of_expert(self.spec.num_experts))

    def forward(self, x_BSD: torch.Tensor, count_tokens: bool = True) -> torch.Tensor:
        """count_tokens=False: a recomputation (activation checkpointing) of tokens already
        counted in `tokens_E`."""
        shape = x_BSD.shape
        x_TD = x_BSD.reshape(-1, shape[-1])
        expert_TK, gate_TK = self.router(x_TD)
        if self.counting and count_tokens:
            self.tokens_E += torch.bincount(expert_TK.reshape(-1), minlength=len(self.tokens_E))
        slot_TK = self.slot_router.route(expert_TK, self.ep_rank)
        rank_of_slot_G = self.slot_router.rank_of_slot_G
        x_ND, counts, handle = self.dispatcher.dispatch(x_TD, slot_TK, rank_of_slot_G)
        counts_X = counts.tolist() if torch.is_tensor(counts) else list(counts)
        y_ND = self.experts(x_ND, counts_X)
        # gate-weighted combine: HALO-dedup sums a token's experts on their node first
        y_TD = self.dispatcher.combine(y_ND, handle, gate_TK)
        return y_TD.reshape(shape)
