"""Small building blocks of the runtime model: RMSNorm and a seeded nn.Linear."""

from __future__ import annotations

import torch
from torch import nn

from runtime.model.moe import init_uniform_


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(dim=-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps)).to(x.dtype) * self.weight


def seeded_linear(d_in: int, d_out: int, bias: bool, gen: torch.Generator) -> nn.Linear:
    """nn.Linear with its weight drawn from `gen` (biases start at zero)."""
    lin = nn.Linear(d_in, d_out, bias=bias)
    init_uniform_(lin.weight, d_in, gen)
    if bias:
        nn.init.zeros_(lin.bias)
    return lin
