"""The runtime's one-stage model against Hugging Face `transformers` (the oracle).

For a tiny config of each family, the HF model (eager attention, fp32, fixed seed) is saved
with `save_pretrained`; the runtime builds its model from that directory's config.json (the
planner's parser + runtime/model/arch.py) and loads its safetensors (runtime/model/hf_weights.py).
Both run the same tokens: the routed experts must be the same sets, the logits and the loss
equal to fp32 round-off (TOL: the implementations sum in different orders and the runtime
uses SDPA where it can).
"""

from __future__ import annotations

import pytest
import torch

from runtime.model.hf_weights import hf_model, load_hf_weights
from runtime.model.transformer import StageModule, lm_loss

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB, BATCH, SEQ = 128, 2, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4)


def _mixtral():
    return transformers.MixtralConfig(
        **COMMON, intermediate_size=32, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )  # fmt: skip


def _qwen3_moe(**extra):
    return transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6, **extra,
    )  # fmt: skip


def _deepseek_v3():
    yarn = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64,
    }  # fmt: skip  # DeepSeek-V3's own rope_scaling, with a short original context
    return transformers.DeepseekV3Config(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=2560,
        rope_parameters=yarn,
    )  # fmt: skip


def _gpt_oss():
    return transformers.GptOssConfig(
        **COMMON, intermediate_size=32, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
    )  # fmt: skip  # layer_types alternate sliding / full; YaRN rope (the config's default)


CONFIGS = {
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "qwen3_moe_tied_normalised": lambda: _qwen3_moe(tie_word_embeddings=True, norm_topk_prob=True),
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}
CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def hf_reference(name: str, seed: int = 0):
    """A tiny HF model of config `name` with weights large enough to matter: every parameter
    and buffer (norms, sinks, biases, DeepSeek's correction bias) redrawn from a fixed seed."""
    config = CONFIGS[name]()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, CLASSES[config.model_type])(config).float().eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, t in list(model.named_parameters()) + list(model.named_buffers()):
            if "inv_freq" in key:
                continue
            noise = torch.randn(t.shape, generator=gen)
            if key.endswith("norm.weight") or "layernorm" in key:
                t.copy_(1 + 0.2 * noise)
            else:  # about 1/sqrt(fan_in) for matrices; O(1) for sinks and biases
                scale = t.shape[-1] ** -0.5 if t.dim() > 1 else 0.5
                t.copy_(noise * scale * (3.0 if "experts" in key else 1.0))
    return model


def route_recorder(model) -> list:
    """Chosen experts [T, K] of each HF MoE layer, in layer order, from its router's output."""
    chosen: list = []
    for module in model.modules():
        if type(module).__name__.endswith(("TopKRouter", "TopkRouter")):
            module.register_forward_hook(lambda m, i, out: chosen.append(out[2]))
    return chosen


def runtime_model(path) -> StageModule:
    spec, arch = hf_model(path)
    module = StageModule(spec, range(spec.num_layers), True, True, arch=arch)
    load_hf_weights(module, path, spec.family)
    return module


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_loss_and_routing_match_transformers(name, tmp_path):
    hf = hf_reference(name)
    hf.save_pretrained(tmp_path)
    ids = tokens()
    chosen_hf = route_recorder(hf)
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)
    ours = runtime_model(tmp_path)
    chosen_ours = []
    for moe in ours.moe_layers().values():
        moe.router.register_forward_hook(lambda m, i, out: chosen_ours.append(out[0]))
    with torch.no_grad():
        logits = ours(ids)
    assert len(chosen_ours) == len(chosen_hf) > 0
    for mine, theirs in zip(chosen_ours, chosen_hf, strict=True):
        assert torch.equal(mine.sort(dim=-1).values, theirs.sort(dim=-1).values)
    torch.testing.assert_close(logits, ref.logits, **TOL)
    loss = lm_loss(logits[:, :-1], ids[:, 1:])
    assert loss.item() == pytest.approx(ref.loss.item(), abs=1e-5)


def _placed_body(rank: int, world: int, path: str, layout: str, ids, expect) -> float:
    """This rank's part of the model from the checkpoint (experts split over ep = 2, or
    heads over tp = 2); returns the loss of the whole batch."""
    import torch.distributed as dist

    from runtime.dispatch.flat import FlatAllToAll
    from runtime.parallel.tensor_parallel import TPGroup

    spec, arch = hf_model(path)
    tp, placements, ep_rank = None, {}, 0
    if layout == "ep":  # experts 1, 3, ... on rank 1: not a contiguous split
        placements = {i: tuple(e % 2 for e in range(spec.layers[i].moe.num_experts))
                      for i in spec.moe_layers}  # fmt: skip
        ep_rank = rank
    else:
        tp = TPGroup(dist.group.WORLD, list(range(world)), rank, ids.numel(), ids.shape[1])
    module = StageModule(
        spec, range(spec.num_layers), True, True, placements, ep_rank, tp=tp, arch=arch
    )
    load_hf_weights(module, path, spec.family)
    for moe in module.moe_layers().values():
        if layout == "ep":
            moe.dispatcher = FlatAllToAll(dist.group.WORLD, world)
            assert len(moe.experts.expert_ids) == moe.spec.num_experts // 2
    mine = ids[rank::world] if layout == "ep" else ids  # ep: each rank its own sequences
    with torch.no_grad():
        logits = module(mine)
    torch.testing.assert_close(logits, expect[rank::world] if layout == "ep" else expect, **TOL)
    loss = lm_loss(logits[:, :-1], mine[:, 1:])
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    return total.item() / world


@pytest.mark.parametrize(
    "name,layout", [("deepseek_v3", "ep"), ("gpt_oss", "ep"), ("deepseek_v3", "tp"),
                    ("gpt_oss", "tp")],
)  # fmt: skip
def test_checkpoint_loads_into_a_two_rank_placement(name, layout, tmp_path, run_distributed):
    """save_pretrained -> two gloo ranks: experts split over ep = 2 (flat all-to-all) or
    heads (MLA's up-projections, GPT-OSS's sinks) over tp = 2; same logits and loss as HF."""
    hf = hf_reference(name)
    hf.save_pretrained(tmp_path)
    ids = tokens()
    with torch.no_grad():
        ref = hf(input_ids=ids, labels=ids)
    halves = [lm_loss(ref.logits[r::2, :-1], ids[r::2, 1:]).item() for r in range(2)]
    expected = sum(halves) / 2 if layout == "ep" else ref.loss.item()
    losses = run_distributed(_placed_body, 2, str(tmp_path), layout, ids, ref.logits)
    assert losses == pytest.approx([expected] * 2, abs=1e-5)
