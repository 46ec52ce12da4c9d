"""Causal self-attention of the runtime model: GQA/MHA (with qk-norm, sliding windows and
attention sinks) and DeepSeek's multi-head latent attention (MLA).

Both are single-device code that a TP group shards by heads (runtime/parallel/tensor_parallel.py):
this rank holds H / n query heads (and G / n key/value heads, n dividing both) and maps its
token slice [T / n, D] to its token slice, gathering the micro-batch for the attention itself.
MLA's down-projections and latent norms are replicated (their gradients are partial sums over
the TP group, like the other norms); its up-projections and output are split by heads.

Shape letters: B = sequences, S = sequence length, D = hidden size, H = query heads on this
rank, G = key/value heads on this rank, Y = head dim, C = latent (LoRA) rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from planner.specs import AttentionSpec
from runtime.model.arch import ModelArch
from runtime.model.layers import RMSNorm, seeded_linear
from runtime.model.rope import apply_rope, rope_tables
from runtime.parallel.tensor_parallel import TPGroup, shard_linear, sp_gather


def core_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float | None = None,
    window: int | None = None,
    sinks_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v over [B, H, S, *].

    window: each query sees itself and the window - 1 keys before it (transformers'
    sliding-window mask). sinks_H: a learned logit per head that joins every row's softmax
    denominator and is dropped from its numerator (GPT-OSS, modeling_gpt_oss.py:243-251).
    scale None: 1 / sqrt(q's head dim).
    """
    if window is None and sinks_H is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    s = q.shape[-2]
    pos = torch.arange(s, device=q.device)
    allowed_SS = pos[None, :] <= pos[:, None]
    if window is not None:
        allowed_SS &= pos[None, :] > pos[:, None] - window
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed_SS, float("-inf"))
    if sinks_H is None:
        probs = scores.float().softmax(dim=-1)
    else:
        sink = sinks_H.reshape(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1).to(scores.dtype)
        logits = torch.cat([scores, sink], dim=-1).float()
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = logits.softmax(dim=-1)[..., :-1]
    return probs.to(v.dtype) @ v


def _gather_micro_batch(x_BSD: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    if tp is None:
        return x_BSD
    s = tp.seq_len  # my token slice [T / n, D] -> the micro-batch
    return sp_gather(x_BSD, tp).view(tp.tokens // s, s, -1)


def _head_slice(n_heads: int, tp: TPGroup | None) -> slice:
    if tp is None:
        return slice(0, n_heads)
    per = n_heads // tp.size
    return slice(tp.index * per, (tp.index + 1) * per)


class Attention(nn.Module):
    """Causal GQA self-attention (MHA when G == H), with the options of AttentionSpec:
    q/k/v and o biases, per-head RMSNorm on q and k (qk_norm), a sliding window, sinks."""

    def __init__(
        self,
        d: int,
        spec: AttentionSpec,
        gen: torch.Generator,
        tp: TPGroup | None = None,
        arch: ModelArch | None = None,
    ) -> None:
        super().__init__()
        arch = arch or ModelArch()
        h, g = spec.num_heads, spec.num_kv_heads
        self.y = spec.head_dim or (spec.qk_nope_head_dim + spec.qk_rope_head_dim)
        if h % g:
            raise ValueError(f"num_heads {h} not divisible by num_kv_heads {g}")
        n = tp.size if tp is not None else 1
        if g % n:
            raise ValueError(f"num_kv_heads {g} not divisible by tp={n}")
        self.tp, self.h, self.g = tp, h // n, g // n  # heads on this rank
        self.rope, self.window = arch.rope, spec.sliding_window
        scale = arch.rope.score_scale()
        self.scale = None if scale == 1.0 else self.y**-0.5 * scale
        self.q = shard_linear(seeded_linear(d, h * self.y, spec.bias, gen), tp, 0, h)
        self.k = shard_linear(seeded_linear(d, g * self.y, spec.bias, gen), tp, 0, g)
        self.v = shard_linear(seeded_linear(d, g * self.y, spec.bias, gen), tp, 0, g)
        self.o = shard_linear(seeded_linear(h * self.y, d, spec.o_bias, gen), tp, 1, h)
        self.q_norm = RMSNorm(self.y, arch.norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.y, arch.norm_eps) if spec.qk_norm else None
        self.sinks = None
        if spec.sinks:  # this rank's heads' sink logits
            self.sinks = nn.Parameter(torch.zeros(h)[_head_slice(h, tp)].clone())
            self.sinks.tp_sharded = tp is not None
        self.recompute_core = False  # selective recompute: scores recomputed in backward

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = _gather_micro_batch(x_BSD, self.tp)
        b, s, _ = x_BSD.shape
        q = self.q(x_BSD).view(b, s, self.h, self.y)
        k = self.k(x_BSD).view(b, s, self.g, self.y)
        v = self.v(x_BSD).view(b, s, self.g, self.y)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        cos, sin = rope_tables(self.rope, self.y, s, q.device, q.dtype)
        q = apply_rope(q, cos, sin, self.rope.interleave)
        k = apply_rope(k, cos, sin, self.rope.interleave)
        if self.g != self.h:
            k = k.repeat_interleave(self.h // self.g, dim=1)
            v = v.repeat_interleave(self.h // self.g, dim=1)
        out = _run_core(self.recompute_core, q, k, v, self.scale, self.window, self.sinks)
        return self.o(out.transpose(1, 2).reshape(b, s, self.h * self.y))


def _run_core(recompute: bool, q, k, v, scale, window, sinks) -> torch.Tensor:
    if recompute and torch.is_grad_enabled():
        return checkpoint(core_attention, q, k, v, scale, window, sinks, use_reentrant=False)
    return core_attention(q, k, v, scale, window, sinks)


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3, arXiv:2405.04434 section 2.1).

    q = W_qb norm(W_qa x) (or W_q x without a q rank); the keys and values come from one
    latent c = norm(W_kva x)[:C] expanded per head by W_kvb, plus a rope part of the key
    shared by all heads, rotated from W_kva x[C:]; the softmax scale is
    1 / sqrt(nope + rope dims) times YaRN's mscale^2 (modeling_deepseek_v3.py:349-483).
    """

    def __init__(
        self,
        d: int,
        spec: AttentionSpec,
        gen: torch.Generator,
        tp: TPGroup | None = None,
        arch: ModelArch | None = None,
    ) -> None:
        super().__init__()
        arch = arch or ModelArch()
        h, n = spec.num_heads, tp.size if tp is not None else 1
        if h % n:
            raise ValueError(f"num_heads {h} not divisible by tp={n}")
        self.tp, self.h, self.rope = tp, h // n, arch.rope
        self.nope, self.rot = spec.qk_nope_head_dim, spec.qk_rope_head_dim
        self.v_dim, self.rank = spec.v_head_dim, spec.kv_lora_rank
        qk = self.nope + self.rot
        self.scale = qk**-0.5 * arch.rope.score_scale()
        self.q = self.q_a = self.q_a_norm = self.q_b = None
        if spec.q_lora_rank:
            self.q_a = seeded_linear(d, spec.q_lora_rank, spec.bias, gen)
            self.q_a_norm = RMSNorm(spec.q_lora_rank, arch.mla_norm_eps)
            self.q_b = shard_linear(seeded_linear(spec.q_lora_rank, h * qk, False, gen), tp, 0, h)
        else:
            self.q = shard_linear(seeded_linear(d, h * qk, False, gen), tp, 0, h)
        self.kv_a = seeded_linear(d, self.rank + self.rot, spec.bias, gen)
        self.kv_a_norm = RMSNorm(self.rank, arch.mla_norm_eps)
        kv_b = seeded_linear(self.rank, h * (self.nope + self.v_dim), False, gen)
        self.kv_b = shard_linear(kv_b, tp, 0, h)
        self.o = shard_linear(seeded_linear(h * self.v_dim, d, spec.o_bias, gen), tp, 1, h)
        self.recompute_core = False

    def forward(self, x_BSD: torch.Tensor) -> torch.Tensor:
        x_BSD = _gather_micro_batch(x_BSD, self.tp)
        b, s, _ = x_BSD.shape
        if self.q is not None:
            q = self.q(x_BSD)
        else:
            q = self.q_b(self.q_a_norm(self.q_a(x_BSD)))
        q = q.view(b, s, self.h, self.nope + self.rot).transpose(1, 2)
        q_pass, q_rot = q.split([self.nope, self.rot], dim=-1)
        latent_BSC, k_rot = self.kv_a(x_BSD).split([self.rank, self.rot], dim=-1)
        k_rot = k_rot.view(b, 1, s, self.rot)
        cos, sin = rope_tables(self.rope, self.rot, s, q.device, q.dtype)
        q_rot = apply_rope(q_rot, cos, sin, self.rope.interleave)
        k_rot = apply_rope(k_rot, cos, sin, self.rope.interleave)
        kv = self.kv_b(self.kv_a_norm(latent_BSC)).view(b, s, self.h, self.nope + self.v_dim)
        k_nope, v = kv.transpose(1, 2).split([self.nope, self.v_dim], dim=-1)
        q = torch.cat([q_pass, q_rot], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, self.h, -1, -1)], dim=-1)
        out = _run_core(self.recompute_core, q, k, v, self.scale, None, None)
        return self.o(out.transpose(1, 2).reshape(b, s, self.h * self.v_dim))


def make_attention(
    d: int, spec: AttentionSpec, gen: torch.Generator, tp=None, arch: ModelArch | None = None
) -> Attention | MLAttention:
    """MLAttention for an MLA spec with its latent ranks set, else Attention."""
    if spec.kind == "mla" and spec.kv_lora_rank and spec.qk_rope_head_dim:
        return MLAttention(d, spec, gen, tp, arch)
    return Attention(d, spec, gen, tp, arch)
