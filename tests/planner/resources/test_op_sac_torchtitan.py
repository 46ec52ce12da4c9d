"""Per-op SAC against torchtitan itself: the bytes torchtitan 0.3.0's SelectiveAC stores per
block (its caching mode's storage, one forward on CPU) plus the block input equal what
planner.resources.op_sac prices, for a dense GQA block, a GQA MoE block and MLA dense and MoE
blocks with shared experts. Runs where torchtitan 0.3.0 and triton are installed (see
benchmarks/export_check.py for the venv); skipped elsewhere."""

from __future__ import annotations

import importlib

import pytest

from planner.parallel import ParallelConfig
from planner.resources.memory import layer_activations
from planner.specs import AttentionSpec, LayerSpec, ModelSpec, MoESpec, TrainingSpec

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
tac = pytest.importorskip("torchtitan.distributed.activation_checkpoint")

B, S = 2, 256


def _patch_attention(monkeypatch):
    """torch's flex attention has no CPU backward; a custom op with flex's outputs (the
    attention output and an fp32 log-sum-exp) stands in, saved like flex attention."""
    from torchtitan.models.common.attention import FlexAttention

    @torch.library.custom_op("piper_sac_check::attn", mutates_args=())
    def attn(
        q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True
        )
        return out, torch.zeros(q.shape[:-1], dtype=torch.float32)

    attn.register_autograd(lambda ctx, gout, glse: (None, None, None))

    class Aux:
        def __init__(self, lse):
            self.lse = lse

    def flex(q, k, v, **_):
        out, lse = attn(q, k, v)
        return out, Aux(lse)

    monkeypatch.setattr(FlexAttention, "compiled_flex_attn", staticmethod(flex))
    return attn._opoverload


def _stored_bytes(tree) -> int:
    if isinstance(tree, (list, tuple)):
        return sum(_stored_bytes(t) for t in tree)
    if isinstance(tree, dict):
        return sum(_stored_bytes(t) for t in tree.values())
    value = getattr(tree, "val", tree)
    return value.untyped_storage().nbytes() if isinstance(value, torch.Tensor) else 0


def _measure(monkeypatch, family: str, flavor: str):
    """(model, bytes each block's SAC storage keeps)."""
    op = _patch_attention(monkeypatch)
    storages = []
    orig = tac.create_selective_checkpoint_contexts

    def capture(policy_fn, *args, **kwargs):
        fwd, rec = orig(policy_fn, *args, **kwargs)
        storages.append(fwd.storage)
        return fwd, rec

    monkeypatch.setattr(tac, "create_selective_checkpoint_contexts", capture)

    class SAC(tac.SelectiveAC):
        def get_save_ops(self):
            return super().get_save_ops() | {op}

    registry = importlib.import_module(f"torchtitan.models.{family}").model_registry
    torch.manual_seed(0)
    model = registry(flavor, attn_backend="flex").model.build().to(torch.bfloat16)
    SAC(tac.SelectiveAC.Config()).apply(model)
    positions = torch.arange(S).repeat(B, 1)
    tokens = torch.randint(0, 2048, (B, S))
    model(tokens, positions, model.get_attention_masks(positions))
    return model, [_stored_bytes(list(s.values())) for s in storages]


def _priced(layer: LayerSpec, d: int) -> float:
    model = ModelSpec("check", "moe", d, 2048, (layer,))
    par = ParallelConfig(pp=1, dp=1, micro_batch=B, recompute="selective",
                         recompute_modules=("op",))  # fmt: skip
    training = TrainingSpec(seq_len=S, global_batch=B)
    kept = layer_activations(model, layer, training, par, "selective").total
    if layer.moe is not None:  # CPU autocast keeps the gate's scores bf16: top-k values 2 B
        kept -= 2.0 * B * S * layer.moe.top_k
    return kept - 2.0 * B * S * d  # the block input is the checkpoint's, not in the storage


GQA = AttentionSpec("gqa", num_heads=16, num_kv_heads=8, head_dim=128, qk_norm=True)
MLA = AttentionSpec("mla", num_heads=16, num_kv_heads=16, head_dim=192, kv_lora_rank=512,
                    qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)  # fmt: skip


def test_qwen3_dense_and_moe_blocks(monkeypatch):
    _, dense = _measure(monkeypatch, "qwen3", "debugmodel")
    assert dense[0] == _priced(LayerSpec("dense", GQA, dense_ffn=3072), 256) == 9732096
    _, moe = _measure(monkeypatch, "qwen3", "debugmodel_moe")
    layer = LayerSpec("moe", GQA, moe=MoESpec(num_experts=64, top_k=8, expert_ffn=768))
    assert moe[0] == _priced(layer, 256) == 6365184


def test_deepseek_v3_mla_dense_and_moe_blocks(monkeypatch):
    _, stored = _measure(monkeypatch, "deepseek_v3", "debugmodel")
    dense = LayerSpec("dense", MLA, dense_ffn=1024)
    moe = LayerSpec("moe", MLA, moe=MoESpec(num_experts=8, top_k=3, expert_ffn=256,
                                            num_shared_experts=2, shared_ffn=256))  # fmt: skip
    assert stored[:2] == [_priced(dense, 256), _priced(moe, 256)] == [10780672, 10271744]
