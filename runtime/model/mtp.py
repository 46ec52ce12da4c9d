"""Multi-token prediction (MTP): DeepSeek-V3's sequential prediction modules on the last stage.

DeepSeek-V3 (arXiv 2412.19437, section 2.2) adds D modules after the main model; module k
(1..D) reads, at every position i, the previous depth's representation h^{k-1}_i (h^0: the
main model's output) and the embedding of token t_{i+k}, and predicts t_{i+k+1}:

    h'_i  = W_k [RMSNorm_e(Emb(t_{i+k})) ; RMSNorm_h(h^{k-1}_i)]       (2D -> D)
    h^k_i = FinalNorm_k(Block_k(h'))_i                                  (one layer)
    CE_k  = mean over i < S - k of cross_entropy(Head(h^k_i), t_{i+k+1})

with the embedding and the output head shared with the main model. The loss is
main CE + (lambda / D) * sum_k CE_k. Numerics as Megatron-Core implements them
(NVIDIA/Megatron-LM at d98e8a64ddf34856e74b24714e3bedb2f5a39553,
megatron/core/transformer/multi_token_prediction.py, "mtp.py" below):
- the concatenation puts the normed embedding first, the normed hidden second
  (mtp.py:1341 `torch.cat((decoder_input, hidden_states), -1)`; the paper writes the
  hidden first; vLLM reads DeepSeek-V3's released eh_proj weights in the embedding-first
  order too, vllm-project/vllm 4f7c14402630b97c8c078523fca8edef287ed2cf
  vllm/model_executor/models/deepseek_mtp.py:84-85);
- each module has its own final norm before the shared head (mtp.py:1247, 1439) and hands
  that normed output to the next module; h^0 is the main model's output after its final
  norm (gpt_model.py:628 runs the decoder, whose final layernorm is transformer_block.py:755-756,
  then the MTP block);
- module k embeds the input ids rolled left k times with zeros rolled in (mtp.py:1279,
  roll_tensor mtp.py:252-253) and is scored on the labels rolled left k times, the last k
  positions of each sequence masked, averaged over the unmasked ones (mtp.py:1020-1029,
  1065). With the data loader's targets (target_i = t_{i+1}) that is: embed
  target rolled k - 1 times (zeros in the last k positions), score positions i < S - k
  against target_{i+k};
- lambda = 0.1, Megatron-Core's default `mtp_loss_scaling_factor`
  (megatron/core/transformer/transformer_config.py:75), divided by D (mtp.py:1047).

transformers' DeepSeek-V3 has no MTP (it drops `model.layers.<num_hidden_layers>.*`), so no
Hugging Face reference exists; tests/runtime/model/test_mtp.py checks the formula above
written out in plain torch.

Shape letters: B = sequences, S = sequence length, D = hidden size, V = vocabulary,
T = tokens of this rank (B * S, or a TP token slice of them).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from runtime.model.arch import ModelArch
from runtime.model.layers import RMSNorm, seeded_linear
from runtime.model.moe import seeded_generator
from runtime.parallel.tensor_parallel import TPGroup, shard_linear, sp_gather

# Megatron-Core's mtp_loss_scaling_factor default (transformer_config.py:75 at the commit above)
MTP_LOSS_SCALE = 0.1
EH_PROJ_PART = 3  # seeded_generator part of the 2D -> D projection (0: the layer, 1-2: moe)


class MTPModule(nn.Module):
    """One MTP depth: enorm, hnorm, the 2D -> D projection `eh_proj`, one Block like the
    model's last layer (its MoE dispatched like every MoE layer) and its own final norm.

    Args:
        d: hidden size. block: the transformer layer (runtime.model.transformer.Block) built
        for this depth's layer index. seed, layer: weight identity of the projection.
        tp: this rank's TP group: the projection is row-parallel over its 2D input features
        (each rank holds 2D / n of them, the planner's 2 d^2 / tp), reading the gathered
        micro-batch and reduce-scattering to token slices, like an MLP's down-projection.
        arch: the norms' epsilon.
    forward: h [T, D] or [B, S, D] (depth k - 1), e = Emb(t_{i+k}) of the same shape ->
    h^k of that shape.
    """

    def __init__(
        self,
        d: int,
        block: nn.Module,
        seed: int,
        layer: int,
        tp: TPGroup | None = None,
        arch: ModelArch | None = None,
    ) -> None:
        super().__init__()
        arch = arch or ModelArch()
        self.tp = tp
        self.enorm = RMSNorm(d, arch.norm_eps)
        self.hnorm = RMSNorm(d, arch.norm_eps)
        gen = seeded_generator(seed, layer, EH_PROJ_PART)
        self.eh_proj = shard_linear(seeded_linear(2 * d, d, False, gen), tp, 1)
        self.block = block
        self.final_norm = RMSNorm(d, arch.norm_eps)

    def forward(self, h: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        x = torch.cat((self.enorm(e), self.hnorm(h)), dim=-1)
        if self.tp is not None:
            per = x.shape[-1] // self.tp.size
            lo = self.tp.index * per
            x = sp_gather(x.reshape(-1, x.shape[-1]), self.tp)[:, lo : lo + per]
        return self.final_norm(self.block(self.eh_proj(x)))


def mtp_input_ids(target_BS: torch.Tensor, k: int) -> torch.Tensor:
    """Token ids module k embeds: t_{i+k} = target_{i+k-1} at positions i < S - k, 0 at the
    last k positions (Megatron's input ids rolled left k times, zeros rolled in)."""
    s = target_BS.shape[1]
    ids = torch.zeros_like(target_BS)
    if s > k:
        ids[:, : s - k] = target_BS[:, k - 1 : s - 1]
    return ids


def mtp_depth_losses(
    modules: nn.ModuleList,
    h0: torch.Tensor,
    target_BS: torch.Tensor,
    embed: Callable[[torch.Tensor], torch.Tensor],
    head: Callable[[torch.Tensor], torch.Tensor],
    cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
) -> list[torch.Tensor]:
    """CE_1 .. CE_D of one micro-batch.

    Args:
        modules: the D MTPModules, depth order. h0: the main model's final-norm output
        ([B, S, D], or this TP rank's token slice [T / n, D]). target_BS: next-token targets
        (target_i = t_{i+1}). embed: token ids [B, S] -> embeddings shaped as h0 (the shared
        embedding). head: hidden -> logits [B, S, V or V / n] (the shared head).
        cross_entropy: (logits [B, S', V'], targets [B, S']) -> mean loss (the main loss's).
    Returns: one scalar per depth; a depth with no target left (S <= k) gives 0, as
    Megatron's clamped token count does (mtp.py:1063).
    """
    s, h, out = target_BS.shape[1], h0, []
    for k, module in enumerate(modules, start=1):
        h = module(h, embed(mtp_input_ids(target_BS, k)))
        if s <= k:
            out.append(h.sum() * 0.0)  # keeps the module in the graph with a zero gradient
            continue
        logits = head(h)
        out.append(cross_entropy(logits[:, : s - k], target_BS[:, k:]))
    return out


def mtp_objective(main: torch.Tensor, depth_losses: list[torch.Tensor]) -> torch.Tensor:
    """main + (MTP_LOSS_SCALE / D) * sum_k CE_k."""
    return main + MTP_LOSS_SCALE / len(depth_losses) * torch.stack(depth_losses).sum()
