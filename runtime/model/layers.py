"""Small building blocks of the runtime model: RMSNorm, a seeded nn.Linear and the token
embedding whose output starts the residual stream in the compute dtype."""

from __future__ import annotations

import torch
from torch import nn

from runtime.model.moe import init_uniform_
from runtime.model.precision import to_compute_dtype


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype (the
    statistics stay fp32 with bf16 activations, as Megatron's fused norms keep them)."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        var = x.float().pow(2).mean(dim=-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps) * self.weight.float()).to(x.dtype)


class Embedding(nn.Embedding):
    """nn.Embedding whose output is in the compute dtype (`to_compute_dtype`): the rows are
    looked up in the fp32 master weights and rounded once."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return to_compute_dtype(super().forward(ids))


def seeded_linear(d_in: int, d_out: int, bias: bool, gen: torch.Generator) -> nn.Linear:
    """nn.Linear with its weight drawn from `gen` (biases start at zero)."""
    lin = nn.Linear(d_in, d_out, bias=bias)
    init_uniform_(lin.weight, d_in, gen)
    if bias:
        nn.init.zeros_(lin.bias)
    return lin
