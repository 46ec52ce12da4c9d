"""The compute dtype of activations (runtime/RUNTIME.md, "Precision")."""

from __future__ import annotations

import torch


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x in the compute dtype: autocast's (bf16 / fp16) inside an enabled region of x's
    device, else x unchanged. The residual stream starts so at the embedding, as Megatron-Core
    runs it without fp32_residual_connection (its embeddings are bf16 parameters)."""
    kind = x.device.type
    if not (x.is_floating_point() and torch.is_autocast_enabled(kind)):
        return x
    return x.to(torch.get_autocast_dtype(kind))
