"""Small building blocks of the runtime model: RMSNorm, a seeded nn.Linear and the token
embedding whose output starts the residual stream in the compute dtype."""

from __future__ import annotations

import torch
from torch import nn

from runtime.model.moe import init_uniform_
from runtime.precision import to_compute_dtype


class RMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * weight, computed in fp32, returned in x's dtype (the
    statistics stay fp32 with bf16 activations). A bf16 or fp16 input runs
    `_LowPrecisionRMSNorm`, which keeps x and the fp32 1 / rms for backward, not fp32 copies
    of x."""

    def __init__(self, d: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype in (torch.bfloat16, torch.float16):
            return _LowPrecisionRMSNorm.apply(x, self.weight, self.eps)
        var = x.float().pow(2).mean(dim=-1, keepdim=True)
        return (x.float() * torch.rsqrt(var + self.eps) * self.weight.float()).to(x.dtype)


class _LowPrecisionRMSNorm(torch.autograd.Function):
    """RMSNorm of a bf16 / fp16 x in fp32, saving x and rstd = 1 / rms (fp32, one per row).
    Backward, with xhat = x rstd and g = grad_y * weight: grad_x = rstd (g - xhat mean(g xhat)),
    grad_weight = sum over rows of grad_y xhat (the fp32 formulas of the forward)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd * weight.float()).to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat, gy = x.float() * rstd, grad_y.float()
        g = gy * weight.float()
        grad_x = rstd * (g - xhat * (g * xhat).mean(dim=-1, keepdim=True))
        grad_w = (gy * xhat).reshape(-1, xhat.shape[-1]).sum(dim=0)
        return grad_x.to(x.dtype), grad_w.to(weight.dtype), None


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
