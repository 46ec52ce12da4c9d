"""A decoder-only MoE transformer built from a ModelSpec, as single-device code.

`StageModule` holds a contiguous run of layers (the embedding when it is the first stage,
the final norm and head when it is the last), so the whole model is the one-stage case and
a pipeline stage is the same class with fewer layers. Every weight is initialized from a
generator keyed by (seed, layer, part), so the same model comes out whatever the
pipeline split or expert placement.

The layers follow the ModelSpec (MLA, sliding windows, sinks, qk-norm, biases, shared
experts, dense layers, tied embeddings, `num_mtp_layers` multi-token-prediction modules on
the last stage, runtime/model/mtp.py); the numerics its shapes leave open (RoPE, norm
epsilon, router, expert activation) follow a ModelArch (runtime/model/arch.py): the runtime's
own convention by default, a family's when read from its HF config (runtime/RUNTIME.md,
"Model architectures").

Shape letters: B = sequences, S = sequence length, D = hidden size, V = vocabulary,
H = query heads, G = key/value heads, Y = head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

from planner.parallel import default_placement
from planner.specs import LayerSpec, ModelSpec
from runtime.model.arch import ModelArch
from runtime.model.attention import make_attention
from runtime.model.layers import Embedding, RMSNorm, seeded_linear
from runtime.model.moe import MoELayer, seeded_generator
from runtime.model.mtp import MTPModule, mtp_depth_losses, mtp_objective
from runtime.parallel.tensor_parallel import (
    TPGroup,
    VocabParallelEmbedding,
    VocabParallelHead,
    shard_linear,
    sp_gather,
    vocab_parallel_cross_entropy,
)


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
        self.up = shard_linear(seeded_linear(d, ffn, False, gen), tp, 0)
        self.gate = shard_linear(seeded_linear(d, ffn, False, gen), tp, 0) if gated else None
        self.down = shard_linear(seeded_linear(ffn, d, False, gen), tp, 1)
        self.out_gate = seeded_linear(d, 1, False, gen) if sigmoid_gate else None

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
        arch: ModelArch | None = None,
    ):
        super().__init__()
        arch = arch or ModelArch()
        self.recompute = recompute
        gen = seeded_generator(seed, layer, 0)
        self.attn_norm = RMSNorm(d, arch.norm_eps)
        self.attn = make_attention(d, spec.attention, gen, tp, arch)
        self.attn.recompute_core = recompute == "selective"
        self.ffn_norm = RMSNorm(d, arch.norm_eps)
        self.mlp = MLP(d, spec.dense_ffn, spec.dense_gated, gen, tp=tp) if spec.dense_ffn else None
        self.moe = self.shared = None
        if spec.moe is not None:
            m = spec.moe
            if rank_of_expert_E is None:
                rank_of_expert_E = [0] * m.num_experts
            self.moe = MoELayer(d, m, rank_of_expert_E, ep_rank, seed, layer, arch)
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
        arch: the numerics the shapes leave open (default: the runtime's, ModelArch()).
    With `model.tie_word_embeddings` the head's weight is the embedding's when both sit on
    this stage; on two stages the head starts as a copy and trains on its own (Megatron
    instead sums the two copies' gradients over its embedding group).
    With `model.num_mtp_layers` = D > 0 the last stage also holds D MTPModules
    (runtime/model/mtp.py), run-model layer indices L .. L + D - 1 (L = len(model.layers),
    the checkpoint's `model.layers.<num_hidden_layers>` names), each a Block like the last
    layer, its experts in the default placement (planner.parallel.default_placement) over
    the last layer's EP group. They read the shared embedding: the first
    stage's when this stage is also the first; else `mtp_embed`, a copy (Megatron's MTP
    stage holds one too, gpt_model.py:173) whose gradient the pipeline's gradient sync sums
    with the first stage's (runtime/parallel/pipeline.py), or with tied embeddings the
    head's weight.
    forward: token ids [B, S] (first stage) or hidden [B, S, D] -> hidden or logits [B, S, V];
    with MTP the last stage returns (logits, main final-norm output) for `loss`.
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
        arch: ModelArch | None = None,
    ) -> None:
        super().__init__()
        arch = arch or ModelArch()
        d, v = model.hidden_size, model.vocab_size
        placements = placements or {}
        self.layer_ids = list(layer_ids)
        self.first, self.last = first, last
        self.tp = tp
        self.embed = self.head = None
        if first:
            self.embed = Embedding(v, d)
            with torch.no_grad():
                self.embed.weight.copy_(_embedding_init(v, d, seed))
            if tp is not None:
                self.embed = VocabParallelEmbedding(self.embed.weight, tp)
        self.blocks = nn.ModuleList(
            Block(
                d, model.layers[i], i, seed, placements.get(i), ep_rank, tp,
                (recompute or {}).get(i, "none"), arch,
            )
            for i in self.layer_ids
        )  # fmt: skip
        self.norm = RMSNorm(d, arch.norm_eps) if last else None
        self.mtp = self.mtp_embed = None
        self.mtp_layer_ids: list[int] = []
        # first or last stage of a split model whose MTP modules read an untied embedding copy
        untied = model.num_mtp_layers > 0 and not model.tie_word_embeddings
        self.syncs_mtp_embedding = untied and first != last
        self.loss_parts: list[tuple[torch.Tensor, torch.Tensor]] = []  # (main, CE_k) per call
        if last:
            self.head = seeded_linear(d, v, False, seeded_generator(seed, 10**6, 2))
            if model.tie_word_embeddings and self.embed is None:
                with torch.no_grad():  # the embedding's initial weights
                    self.head.weight.copy_(_embedding_init(v, d, seed))
            if tp is not None:
                self.head = VocabParallelHead(self.head.weight, tp)
            if model.tie_word_embeddings and self.embed is not None:
                self.head.weight = self.embed.weight
        if last and model.num_mtp_layers:
            self._build_mtp(model, placements, ep_rank, seed, arch)

    def _build_mtp(self, model: ModelSpec, placements: dict, ep_rank: int, seed: int, arch):
        """The MTP modules and, on a stage without the embedding, its copy (class docstring)."""
        d, v, n = model.hidden_size, model.vocab_size, len(model.layers)
        last = placements.get(n - 1)
        # E / ep experts a rank, as the planner prices an MTP layer (no redundant slots): the
        # default placement over the last layer's EP group, not its (perhaps slotted) table
        placement = None
        if last is not None and model.layers[-1].moe is not None:
            placement = default_placement(model.layers[-1].moe.num_experts, max(last) + 1)
        self.mtp_layer_ids = list(range(n, n + model.num_mtp_layers))
        blocks = [
            Block(d, model.layers[-1], i, seed, placement, ep_rank, self.tp, "none", arch)
            for i in self.mtp_layer_ids
        ]
        self.mtp = nn.ModuleList(
            MTPModule(d, b, seed, i, self.tp, arch)
            for i, b in zip(self.mtp_layer_ids, blocks, strict=True)
        )
        if self.embed is not None:
            return
        embed = Embedding(v, d)
        with torch.no_grad():
            embed.weight.copy_(_embedding_init(v, d, seed))
        self.mtp_embed = VocabParallelEmbedding(embed.weight, self.tp) if self.tp else embed
        if model.tie_word_embeddings:
            self.mtp_embed.weight = self.head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """With TP, hidden states between layers and stages are this rank's token slice
        [T / n, D], and the logits are the whole micro-batch's over this rank's vocabulary
        rows [B, S, V / n] (runtime/parallel/tensor_parallel.py)."""
        if self.embed is not None:
            x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        if self.head is None:
            return x
        h = self.norm(x)
        return (self.head(h), h) if self.mtp is not None else self.head(h)

    def loss(self, output, target_BS: torch.Tensor) -> torch.Tensor:
        """Mean next-token cross entropy of this chunk's logits (the last chunk's): lm_loss,
        or with TP the vocab-parallel cross entropy over the group (the same on every rank).
        With MTP, `output` is forward's (logits, final-norm output) and the loss is
        main + (lambda / D) sum_k CE_k (runtime/model/mtp.py); (main, [CE_k]) is appended to
        `loss_parts`, detached, for the metrics."""
        if self.mtp is None:
            return self._cross_entropy(output, target_BS)
        logits_BSV, h = output
        main = self._cross_entropy(logits_BSV, target_BS)
        embed = self.embed if self.embed is not None else self.mtp_embed
        depth = mtp_depth_losses(self.mtp, h, target_BS, embed, self.head, self._cross_entropy)
        self.loss_parts.append((main.detach(), torch.stack(depth).detach()))
        return mtp_objective(main, depth)

    def _cross_entropy(self, logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return lm_loss(logits_BSV, target_BS)
        start = self.head.start if self.head is not None else 0
        return vocab_parallel_cross_entropy(logits_BSV, target_BS, start, self.tp)

    def moe_layers(self) -> dict[int, MoELayer]:
        """Layer index -> MoELayer for the MoE layers of this stage (MTP modules' included)."""
        return {i: b.moe for i, b in self.indexed_blocks() if b.moe is not None}

    def indexed_blocks(self) -> list[tuple[int, Block]]:
        """(run-model layer index, Block) of this stage's layers, then its MTP modules'."""
        out = list(zip(self.layer_ids, self.blocks, strict=True))
        if self.mtp is not None:
            out += [(i, m.block) for i, m in zip(self.mtp_layer_ids, self.mtp, strict=True)]
        return out

    def expert_parameters(self) -> list[nn.Parameter]:
        """Parameters sharded over EP (synchronized over the edp group)."""
        return [p for moe in self.moe_layers().values() for p in moe.experts.parameters()]

    def tp_partial_parameters(self) -> list[nn.Parameter]:
        """Replicated parameters whose grads are partial sums over the TP group: all but the
        sharded ones (norms, routers, row-parallel biases, gates and MLA's down-projections
        see only this rank's tokens or heads)."""
        if self.tp is None:
            return []
        return [p for p in self.dense_parameters() if not getattr(p, "tp_sharded", False)]

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters replicated over the stage's data-parallel ranks."""
        expert_ids = {id(p) for p in self.expert_parameters()}
        return [p for p in self.parameters() if id(p) not in expert_ids]


def _embedding_init(v: int, d: int, seed: int) -> torch.Tensor:
    """The whole embedding's initial [V, D] weights (a tied head on another stage starts so)."""
    return torch.randn(v, d, generator=seeded_generator(seed, 10**6, 1))


def lm_loss(logits_BSV: torch.Tensor, target_BS: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy (targets are already shifted by the data loader)."""
    return F.cross_entropy(
        logits_BSV.reshape(-1, logits_BSV.shape[-1]).float(), target_BS.reshape(-1)
    )
