"""A decoder-only MoE transformer built from a ModelSpec, as single-device code.

`StageModule` holds a contiguous run of layers (the embedding when it is the first stage,
the final norm and head when it is the last), so the whole model is the one-stage case and
a pipeline stage is the same class with fewer layers. Every weight is initialized from a
generator keyed by (seed, layer, part), so the same model comes out whatever the
pipeline split or expert placement.

Approximations (documented in runtime/RUNTIME.md): MLA attention runs as GQA with the same
head count; sliding windows and attention sinks are ignored; embedding and head are untied;
RoPE uses theta = 10000.

Shape letters: B = sequences, S = sequence length, D = hidden size, V = vocabulary,
H = query heads, G = key/value heads, Y = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from planner.specs import AttentionSpec, LayerSpec, ModelSpec
from runtime.model.moe import MoELayer, init_uniform_, seeded_generator
from runtime.parallel.tensor_parallel import (
    TPGroup,
    gather_tokens,
    shard_linear,
    sp_gather,
    split_tokens,
)


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(dim=-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def rope(x_BHSY: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotary position embedding over the last axis (rotate-half convention)."""
    s, y = x_BHSY.shape[-2], x_BHSY.shape[-1]
    half = y // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x_BHSY.device) / half)
    ang = torch.arange(s, dtype=torch.float32, device=x_BHSY.device)[:, None] * freq[None]
    cos, sin = ang.cos().to(x_BHSY.dtype), ang.sin().to(x_BHSY.dtype)
    x1, x2 = x_BHSY[..., :half], x_BHSY[..., half : 2 * half]
    rot = torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)
    return torch.cat([rot, x_BHSY[..., 2 * half :]], dim=-1)


def _linear(d_in: int, d_out: int, bias: bool, gen: torch.Generator) -> nn.Linear:
    lin = nn.Linear(d_in, d_out, bias=bias)
    init_uniform_(lin.weight, d_in, gen)
    if bias:
        nn.init.zeros_(lin.bias)
    return lin


class Attention(nn.Module):
    """Causal GQA self-attention (MHA when G == H; MLA approximated as GQA, see module doc).

    With a TP group of size n, this rank holds H / n query heads and G / n key/value heads
    (runtime/parallel/tensor_parallel.py; H and G must be multiples of n) and maps its token slice
    [T / n, D] to its token slice, gathering the micro-batch for the attention itself.
    """

    def __init__(
        self, d: int, spec: AttentionSpec, gen: torch.Generator, tp: TPGroup | None = None
    ) -> None:
        super().__init__()
        h, g = spec.num_heads, spec.num_kv_heads
        self.y = spec.head_dim or (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        if h % g:
            raise ValueError(f"num_heads {h} not divisible by num_kv_heads {g}")
        n = tp.size if tp is not None else 1
        if g % n:
            raise ValueError(f"num_kv_heads {g} not divisible by tp={n}")
        self.tp, self.h, self.g = tp, h // n, g // n  # heads on this rank
        self.q = shard_linear(_linear(d, h * self.y, spec.bias, gen), tp, 0, h)
        self.k = shard_linear(_linear(d, g * self.y, spec.bias, gen), tp, 0, g)
        self.v = shard_linear(_linear(d, g * self.y, spec.bias, gen), tp, 0, g)
        self.o = shard_linear(_linear(h * self.y, d, spec.o_bias, gen), tp, 1, h)
        self.q_norm = RMSNorm(self.y) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.y) if spec.qk_norm else None
        self.recompute_core = False  # selective recompute: scores recomputed in backward

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        if self.tp is not None:  # my token slice [T / n, D] -> the micro-batch
            s = self.tp.seq_len
            x_BSD = sp_gather(x_BSD, self.tp).view(self.tp.tokens // s, s, -1)
        b, s, _ = x_BSD.shape
        q = self.q(x_BSD).view(b, s, self.h, self.y)
        k = self.k(x_BSD).view(b, s, self.g, self.y)
        v = self.v(x_BSD).view(b, s, self.g, self.y)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        q, k = rope(q), rope(k)
        if self.g != self.h:
            k = k.repeat_interleave(self.h // self.g, dim=1)
            v = v.repeat_interleave(self.h // self.g, dim=1)
        if self.recompute_core and torch.is_grad_enabled():
            out = checkpoint(_core_attention, q, k, v, use_reentrant=False)
        else:
            out = _core_attention(q, k, v)
        return self.o(out.transpose(1, 2).reshape(b, s, self.h * self.y))


def _core_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class MLP(nn.Module):
    """Dense feed-forward: SwiGLU when gated, else GELU; optional sigmoid output gate.

    With a TP group, this rank holds ffn / n of the hidden width (column-parallel up and
    gate over the gathered micro-batch, row-parallel down back to the token slice); the
    output gate is replicated and reads the token slice.
    """

    def __init__(
        self, d: int, ffn: int, gated: bool, gen, sigmoid_gate=False, tp: TPGroup | None = None
    ):
        super().__init__()
        self.tp = tp
        self.up = shard_linear(_linear(d, ffn, False, gen), tp, 0)
        self.gate = shard_linear(_linear(d, ffn, False, gen), tp, 0) if gated else None
        self.down = shard_linear(_linear(ffn, d, False, gen), tp, 1)
        self.out_gate = _linear(d, 1, False, gen) if sigmoid_gate else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x_in = sp_gather(x, self.tp) if self.tp is not None else x
        h = self.up(x_in)
        h = F.silu(self.gate(x_in)) * h if self.gate is not None else F.gelu(h)
        y = self.down(h)
        if self.out_gate is not None:
            y = torch.sigmoid(self.out_gate(x)) * y
        return y


class Block(nn.Module):
    """One transformer layer: attention, then a dense MLP, an MoE, or both (Arctic).

    recompute: "full" keeps only the layer input and reruns the whole layer (its all-to-alls
    and TP collectives included) in backward; "selective" reruns only the core attention
    (scores, softmax, values); "none" keeps every activation.
    """

    def __init__(
        self,
        d: int,
        spec: LayerSpec,
        layer: int,
        seed: int,
        rank_of_expert_E,
        ep_rank,
        tp=None,
        recompute: str = "none",
    ):
        super().__init__()
        self.recompute = recompute
        gen = seeded_generator(seed, layer, 0)
        self.attn_norm = RMSNorm(d)
        self.attn = Attention(d, spec.attention, gen, tp)
        self.attn.recompute_core = recompute == "selective"
        self.ffn_norm = RMSNorm(d)
        self.mlp = MLP(d, spec.dense_ffn, spec.dense_gated, gen, tp=tp) if spec.dense_ffn else None
        self.moe = self.shared = None
        if spec.moe is not None:
            m = spec.moe
            if rank_of_expert_E is None:
                rank_of_expert_E = [0] * m.num_experts
            self.moe = MoELayer(d, m, rank_of_expert_E, ep_rank, seed, layer)
            if m.num_shared_experts and m.shared_ffn:
                width = m.num_shared_experts * m.shared_ffn
                self.shared = MLP(d, width, m.gated, gen, sigmoid_gate=m.shared_gate, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute != "full" or not torch.is_grad_enabled():
            return self._layer(x)
        calls = []

        def run(inp: torch.Tensor) -> torch.Tensor:
            calls.append(1)  # the second call is the recomputation: its tokens are not new
            return self._layer(inp, count_tokens=len(calls) == 1)

        # no early stop: the recomputation runs the whole layer, its collectives included,
        # the same on every rank of the EP and TP groups
        with set_checkpoint_early_stop(False):
            return checkpoint(run, x, use_reentrant=False)

    def _layer(self, x: torch.Tensor, count_tokens: bool = True) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        h = self.ffn_norm(x)
        out = torch.zeros_like(x)
        if self.mlp is not None:
            out = out + self.mlp(h)
        if self.moe is not None:
            out = out + self.moe(h, count_tokens)
        if self.shared is not None:
            out = out + self.shared(h)
        return x + out


class StageModule(nn.Module):
    """Layers `layer_ids` of the model; embedding if `first`, final norm + head if `last`.

    Args:
        model: the ModelSpec. layer_ids: contiguous layer indices of this stage.
        placements: layer index -> rank_of_expert_E for the MoE layers (default: all on 0).
        ep_rank: this rank's index in its EP group. seed: weight identity.
        tp: this rank's tensor-parallel group (None: no TP).
        recompute: layer index -> "full" or "selective" for the layers the plan recomputes.
    forward: token ids [B, S] (first stage) or hidden [B, S, D] -> hidden or logits [B, S, V].
    """

    def __init__(
        self,
        model: ModelSpec,
        layer_ids,
        first: bool,
        last: bool,
        placements: dict[int, tuple[int, ...]] | None = None,
        ep_rank: int = 0,
        seed: int = 0,
        tp: TPGroup | None = None,
        recompute: dict[int, str] | None = None,
    ) -> None:
        super().__init__()
        d, v = model.hidden_size, model.vocab_size
        placements = placements or {}
        self.layer_ids = list(layer_ids)
        self.first, self.last = first, last
        self.tp = tp
        self.embed = nn.Embedding(v, d) if first else None
        if self.embed is not None:
            with torch.no_grad():
                gen = seeded_generator(seed, 10**6, 1)
                self.embed.weight.copy_(torch.randn(v, d, generator=gen))
        self.blocks = nn.ModuleList(
            Block(
                d, model.layers[i], i, seed, placements.get(i), ep_rank, tp,
                (recompute or {}).get(i, "none"),
            )
            for i in self.layer_ids
        )  # fmt: skip
        self.norm = RMSNorm(d) if last else None
        self.head = _linear(d, v, False, seeded_generator(seed, 10**6, 2)) if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """With TP, hidden states between layers and stages are this rank's token slice
        [T / n, D]; the head sees the whole micro-batch, so logits are [B, S, V] anyway."""
        tp = self.tp
        if self.embed is not None:
            x = self.embed(x)
            if tp is not None:
                x = split_tokens(x.reshape(-1, x.shape[-1]), tp)
        for block in self.blocks:
            x = block(x)
        if self.head is not None:
            x = self.norm(x)
            if tp is not None:
                x = gather_tokens(x, tp).view(tp.tokens // tp.seq_len, tp.seq_len, -1)
            x = self.head(x)
        return x

    def moe_layers(self) -> dict[int, MoELayer]:
        """Layer index -> MoELayer for the MoE layers of this stage."""
        return {
            i: b.moe for i, b in zip(self.layer_ids, self.blocks, strict=True) if b.moe is not None
        }

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters sharded over EP (synchronized over the edp group)."""
        return [p for moe in self.moe_layers().values() for p in moe.experts.parameters()]

    def tp_partial_parameters(self) -> list[nn.Parameter]:
        """Replicated parameters whose grads are partial sums over the TP group: all but the
        sharded ones and the embedding and head (which see the whole micro-batch alike) -
        norms, routers, row-parallel biases and gates see only this rank's tokens or heads."""
        if self.tp is None:
            return []
        whole = {id(p) for m in (self.embed, self.head) if m is not None for p in m.parameters()}
        return [
            p
            for p in self.dense_parameters()
            if id(p) not in whole and not getattr(p, "tp_sharded", False)
        ]

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters replicated over the stage's data-parallel ranks."""
        expert_ids = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in expert_ids]


def lm_loss(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (targets are already shifted by the data loader)."""
    return F.cross_entropy(
        logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(), target_BS.reshape(-1)
    )
