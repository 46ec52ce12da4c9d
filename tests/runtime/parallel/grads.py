"""One optimizer step's gradients (or updated weights) on every rank against the single-device
oracle, for any layout: pipeline chunks, tensor and expert-tensor shards, FSDP shards.

Every tensor is named by what it is in the whole model, so a rank's piece can be set beside
the oracle's whole: ("embed" | "norm" | "head", param), ("layer", i, param) for the dense
parts of layer i, ("expert", i, param, expert id) for one routed expert's slot.
"""

from __future__ import annotations

import numpy as np
import torch
from torch.distributed.tensor import DTensor

from runtime.parallel.pipeline import chunks_of

# the FFN-width axis of each expert parameter (per expert, slot axis dropped)
EXPERT_WIDTH_AXIS = {"w_in": 1, "w_gate": 1, "w_out": 0, "b_in": 0, "b_gate": 0}


def _whole(t: torch.Tensor) -> np.ndarray:
    """A plain copy (FSDP's DTensor shards gathered: a collective over the shard's mesh)."""
    t = t.full_tensor() if isinstance(t, DTensor) else t
    return t.detach().numpy().copy()  # a copy: no shared-memory file descriptors


def named_tensors(module, weights: bool = False) -> dict:
    """Gradients (or, with `weights`, the parameters) of a rank's module by whole-model name."""
    out = {}
    for chunk in chunks_of(module):
        for part in ("embed", "norm", "head"):
            sub = getattr(chunk, part)
            for name, p in sub.named_parameters() if sub is not None else ():
                out[(part, name)] = p if weights else p.grad
        for i, block in zip(chunk.layer_ids, chunk.blocks, strict=True):
            experts = block.moe.experts if block.moe is not None else None
            expert_ids = {id(p) for p in experts.parameters()} if experts is not None else set()
            for name, p in block.named_parameters():
                if id(p) not in expert_ids:
                    out[("layer", i, name)] = p if weights else p.grad
            for name, p in experts.named_parameters() if experts is not None else ():
                t = p if weights else p.grad
                whole = _whole(t)
                for slot, e in enumerate(experts.expert_ids):
                    out[("expert", i, name, e)] = whole[slot]
    return {k: v if isinstance(v, np.ndarray) else _whole(v) for k, v in out.items()}


def step_body(rank: int, world: int, spec, weights: bool = False):
    """run_distributed body: one step's gradients after the gradient sync (with `weights`,
    the parameters after the optimizer step), by name, with (tp_idx, etp_idx)."""
    from runtime.data import sample_batch
    from runtime.launch import build_trainer
    from runtime.parallel.pipeline import sync_gradients

    tr = build_trainer(spec, rank, torch.device("cpu"))
    batch = spec.micro_batch * spec.num_microbatches
    x, y = sample_batch(0, tr.mesh.me.dp_idx, spec.dp, batch, spec.seq_len, spec.seed)
    tr.optimizer.zero_grad(set_to_none=False)
    tr.runner.step(x, y)
    sync_gradients(tr.module, tr.mesh, spec.dp, tr.counter)
    if weights:
        tr.optimizer.step()
    return (tr.mesh.me.tp_idx, tr.mesh.me.etp_idx), named_tensors(tr.module, weights)


def reference(spec, weights: bool = False) -> dict:
    """The oracle's step_body: the whole model on the global batch, gradients averaged as
    the distributed run averages them (then one Adam step with `weights`)."""
    from runtime.data import sample_batch
    from runtime.model.transformer import StageModule, lm_loss

    model = StageModule(spec.model, range(spec.model.num_layers), True, True, seed=spec.seed)
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    batch, m = spec.micro_batch * spec.num_microbatches, spec.num_microbatches
    for j in range(spec.dp):
        x, y = sample_batch(0, j, spec.dp, batch, spec.seq_len, spec.seed)
        for xc, yc in zip(x.chunk(m), y.chunk(m), strict=True):
            (lm_loss(model(xc), yc) / (spec.dp * m)).backward()
    if weights:
        opt.step()
    return named_tensors(model, weights)


def assert_match_oracle(results, ref: dict, tp: int, etp: int, rtol=1e-4, atol=1e-6) -> set:
    """Every rank's tensor equals its piece of the oracle's: a TP shard its tp_idx chunk of
    the sharded axis, an expert-TP shard its etp_idx chunk of the FFN width, anything else
    the whole. Returns the names seen on some rank."""
    seen = set()
    for (tp_idx, etp_idx), named in results:
        for key, got in named.items():
            want = ref[key]
            if got.shape != want.shape and key[0] == "expert":
                axis = EXPERT_WIDTH_AXIS[key[2]]
                want = np.split(want, etp, axis=axis)[etp_idx]
            elif got.shape != want.shape:
                axis = next(
                    a for a, (g, w) in enumerate(zip(got.shape, want.shape, strict=True)) if g != w
                )
                want = np.split(want, tp, axis=axis)[tp_idx]
            np.testing.assert_allclose(got, want, rtol=rtol, atol=atol, err_msg=str(key))
            seen.add(key)
    return seen
