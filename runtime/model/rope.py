"""Rotary position embedding: frequencies (plain or YaRN) and their application to q and k.

The frequencies follow transformers' `_compute_default_rope_parameters` and
`_compute_yarn_parameters` (modeling_rope_utils.py:346-484 in 5.24; YaRN: arXiv:2309.00071),
so the runtime's angles are the same floats as the reference implementation's.

Shape letters: B = sequences, H = heads, S = sequence length, Y = rotary dims, R = Y / 2.
"""

from __future__ import annotations

import math

import torch

from runtime.model.arch import RopeSpec, yarn_mscale


def inv_freq_R(rope: RopeSpec, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim / 2] (fp32) and the factor cos and sin are scaled by."""
    base = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.kind == "default":
        return base, 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if not attention_factor:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(
                factor, rope.mscale_all_dim
            )
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        # the dimension whose wavelength makes `rotations` turns over the original context
        return (dim * math.log(rope.original_max_positions / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate by `factor`
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - extrapolation) + extrapolated * extrapolation, attention_factor


def rope_tables(
    rope: RopeSpec, dim: int, seq_len: int, device, dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [S, dim / 2] for positions 0..S-1 (times YaRN's attention factor)."""
    inv, scale = inv_freq_R(rope, dim)
    inv = inv[: dim // 2]
    ang = torch.arange(seq_len, dtype=torch.float32)[:, None] * inv[None]
    cos, sin = ang.cos() * scale, ang.sin() * scale
    return cos.to(device=device, dtype=dtype), sin.to(device=device, dtype=dtype)


def apply_rope(x_BHSY: torch.Tensor, cos_SR: torch.Tensor, sin_SR: torch.Tensor, interleave: bool):
    """Rotate the last axis: halves (x_i, x_{i+R}) by default, pairs (x_2i, x_2i+1) when
    `interleave`; the output puts the rotated first members before the second ones in both
    cases (as transformers does, modeling_deepseek_v3.py:310-346)."""
    half = cos_SR.shape[-1]
    rest = x_BHSY[..., 2 * half :]  # an odd last dimension (a --scale'd width) is not rotated
    if interleave:
        x1, x2 = x_BHSY[..., 0 : 2 * half : 2], x_BHSY[..., 1 : 2 * half : 2]
    else:
        x1, x2 = x_BHSY[..., :half], x_BHSY[..., half : 2 * half]
    return torch.cat([x1 * cos_SR - x2 * sin_SR, x2 * cos_SR + x1 * sin_SR, rest], dim=-1)
