"""The runtime's one-stage model against Hugging Face `transformers` (the oracle).

For a tiny config of each family, the HF model (eager attention, fp32, fixed seed) is saved
with `save_pretrained`; the runtime builds its model from that directory's config.json (the
planner's parser + runtime/model/arch.py) and loads its safetensors (runtime/model/hf_weights.py).
Both run the same tokens: the routed experts must be the same sets, the logits and the loss
equal to fp32 round-off (TOL: the implementations sum in different orders and the runtime
uses SDPA where it can).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from runtime.model.hf_weights import hf_model, load_hf_weights
from runtime.model.transformer import StageModule, lm_loss

transformers = pytest.importorskip("transformers")

TOL = dict(rtol=1e-5, atol=1e-5)
VOCAB, BATCH, SEQ = 128, 2, 16
COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, num_attention_heads=4)


def _mixtral(**extra):
    return transformers.MixtralConfig(
        **{**COMMON, **extra}, intermediate_size=32, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, rope_parameters={"rope_type": "default", "rope_theta": 5e5},
    )  # fmt: skip


def _qwen3_moe(**extra):
    return transformers.Qwen3MoeConfig(
        **{**COMMON, **extra}, intermediate_size=96, moe_intermediate_size=32,
        num_key_value_heads=2,
        head_dim=16, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[0],
        rope_parameters={"rope_type": "default", "rope_theta": 1e6}, rms_norm_eps=1e-6,
    )  # fmt: skip


def _deepseek_v3(**extra):
    yarn = {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "mscale": 1.0,
        "mscale_all_dim": 1.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "original_max_position_embeddings": 64,
    }  # fmt: skip  # DeepSeek-V3's own rope_scaling, with a short original context
    return transformers.DeepseekV3Config(
        **{**COMMON, **extra}, intermediate_size=96, moe_intermediate_size=32,
        num_key_value_heads=4,
        n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
        q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        first_k_dense_replace=1, routed_scaling_factor=2.5, max_position_embeddings=2560,
        rope_parameters=yarn, num_nextn_predict_layers=0,  # MTP off: transformers has none
    )  # fmt: skip


def _gpt_oss(**extra):
    return transformers.GptOssConfig(
        **{**COMMON, **extra}, intermediate_size=32, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, num_experts_per_tok=2, sliding_window=4,
    )  # fmt: skip  # layer_types alternate sliding / full; YaRN rope (the config's default)


CONFIGS = {
    "mixtral": _mixtral,
    "qwen3_moe": _qwen3_moe,
    "qwen3_moe_tied_normalised": lambda **extra: _qwen3_moe(
        tie_word_embeddings=True, norm_topk_prob=True, **extra
    ),
    "deepseek_v3": _deepseek_v3,
    "gpt_oss": _gpt_oss,
}
CLASSES = {
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "deepseek_v3": "DeepseekV3ForCausalLM",
    "gpt_oss": "GptOssForCausalLM",
}


def hf_reference(name: str, seed: int = 0, **extra):
    """A tiny HF model of config `name` (keys `extra` changed) with weights large enough to
    matter: every parameter and buffer (norms, sinks, biases, DeepSeek's correction bias)
    redrawn from a fixed seed."""
    config = CONFIGS[name](**extra)
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
    if layout == "ep":
        expect = expect[rank::world]
    else:  # this rank's vocabulary rows of the logits
        expect = expect[..., module.head.start : module.head.start + module.head.real]
    torch.testing.assert_close(logits, expect, **TOL)
    loss = module.loss(logits[:, :-1], mine[:, 1:])
    total = torch.tensor([loss.item()])
    dist.all_reduce(total)
    return total.item() / world


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,layout", [("deepseek_v3", "ep"), ("deepseek_v3", "tp"), ("gpt_oss", "tp")]
)  # GPT-OSS over ep = 2: test_run_with_hf_weights_starts_from_the_checkpoint
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


def _trainer_body(rank: int, world: int, spec, path: str):
    """piper run's path: build_trainer with --hf-weights, one step; the step's loss and batch."""
    from runtime.launch import build_trainer

    trainer = build_trainer(spec, rank, hf_weights=path)
    loss, _, _ = trainer.step(0)
    batch = spec.micro_batch * spec.num_microbatches
    x, y = trainer.sample(0, trainer.mesh.me.dp_idx, spec.dp, batch, spec.seq_len, spec.seed)
    return loss, x.numpy().copy(), y.numpy().copy()  # no shared-memory tensors across processes


@pytest.mark.slow
@pytest.mark.parametrize(
    "name,pp,dp", [("deepseek_v3", 1, 2), ("gpt_oss", 1, 2), ("qwen3_moe_tied_normalised", 2, 1)]
)
def test_run_with_hf_weights_starts_from_the_checkpoint(name, pp, dp, tmp_path, run_distributed):
    """A dp = ep = 2 plan (or pp = 2, tied embeddings on two stages) of the checkpoint's
    model, built as `piper run --hf-weights` builds it: the first loss of each rank with one
    is HF's loss on that rank's batch (vocab 256: byte data)."""
    from planner.plan import ModelEntry
    from planner.run.hf_checkpoint import check_hf_checkpoint
    from planner.run.spec import run_spec_from_plan
    from tests.runtime.tiny_plans import hand_plan

    hf = hf_reference(name, vocab_size=256)
    hf.save_pretrained(tmp_path)
    model = hf_model(tmp_path)[0]
    entry = ModelEntry(model.name, str(tmp_path / "config.json"))
    plan = hand_plan(model, pp, dp, dp, micro_batch=1, num_microbatches=2, seq_len=SEQ,
                     model_entry=entry)  # fmt: skip
    spec = run_spec_from_plan(plan, model, 1.0, 2, str(tmp_path), steps=1)
    check_hf_checkpoint(str(tmp_path), spec.model, 1.0)
    results = run_distributed(_trainer_body, 2, spec, str(tmp_path))
    assert [loss is None for loss, _, _ in results] == [pp == 2, False]  # last stage's
    for loss, x, y in results[pp - 1 :]:
        x, y = torch.from_numpy(x), torch.from_numpy(y)
        with torch.no_grad():
            logits = hf(input_ids=x).logits
        expected = sum(lm_loss(logits[i : i + 1], y[i : i + 1]).item() for i in range(2)) / 2
        assert loss == pytest.approx(expected, abs=1e-5)


def test_hf_weights_refused_in_one_line_for_another_model(tmp_path):
    from planner.run.hf_checkpoint import check_hf_checkpoint
    from planner.specs import SpecError

    hf_reference("mixtral").save_pretrained(tmp_path)
    other = hf_model(tmp_path)[0]
    with pytest.raises(SpecError, match=r"--hf-weights .*: layers is 3 in the checkpoint, 2"):
        check_hf_checkpoint(str(tmp_path), replace(other, layers=other.layers[:2]), 1.0)
    with pytest.raises(SpecError, match="drop --scale 0.5"):
        check_hf_checkpoint(str(tmp_path), other, 0.5)
    with pytest.raises(SpecError, match="no config.json"):
        check_hf_checkpoint(str(tmp_path / "missing"), other, 1.0)
    config = tmp_path / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"mixtral"', '"qwen2_moe"'))
    with pytest.raises(SpecError, match="model_type 'qwen2_moe' is not one the runtime loads"):
        check_hf_checkpoint(str(tmp_path), other, 1.0)
    config.write_text(text.replace('"default"', '"llama3"'))
    with pytest.raises(SpecError, match="rope_type 'llama3' is not run"):
        check_hf_checkpoint(str(tmp_path), other, 1.0)


def test_piper_run_refuses_a_checkpoint_of_another_model_in_one_line(tmp_path, capsys):
    from planner.cli import main
    from planner.plan import ModelEntry
    from tests.runtime.tiny_plans import hand_plan

    ckpt = tmp_path / "ckpt"
    hf_reference("mixtral", vocab_size=256).save_pretrained(ckpt)
    model = hf_model(ckpt)[0]
    plan = hand_plan(model, 1, 1, 1, model_entry=ModelEntry("m", str(ckpt / "config.json")))
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    other = tmp_path / "other"
    hf_reference("mixtral", vocab_size=256, num_hidden_layers=2).save_pretrained(other)
    capsys.readouterr()  # save_pretrained's progress bars
    assert main(["run", str(path), "--steps", "1", "--hf-weights", str(other)]) == 2
    err = capsys.readouterr().err.strip()
    assert "--hf-weights" in err and "layers is 2 in the checkpoint, 3 in the plan" in err
    assert "\n" not in err


def _losses_body(rank: int, world: int, spec, path: str, steps: int):
    """Losses of `steps` steps and the (synchronized) gradients of the first, by name."""
    from runtime.launch import build_trainer

    trainer = build_trainer(spec, rank, hf_weights=path)
    losses = [trainer.step(0)[0]]
    grads = {n: p.grad.numpy().copy() for n, p in trainer.module.named_parameters()}
    losses += [trainer.step(i)[0] for i in range(1, steps)]
    return losses, grads


@pytest.mark.slow
@pytest.mark.parametrize("name", ["deepseek_v3", "gpt_oss"])
def test_tp2_trains_mla_and_sinks_like_one_device(name, tmp_path, run_distributed):
    """From the checkpoint, heads over tp = 2 (MLA's latent projections and norms
    replicated, their gradients summed over the TP group; GPT-OSS's sinks split): each rank's
    first gradients are its slice of the one-device ones, and three Adam steps give the
    one-device losses (Adam amplifies round-off of near-zero gradients: 1e-4)."""
    from planner.plan import ModelEntry
    from planner.run.spec import run_spec_from_plan
    from tests.runtime.tiny_plans import hand_plan

    hf_reference(name, vocab_size=256).save_pretrained(tmp_path)
    model = hf_model(tmp_path)[0]
    entry = ModelEntry(model.name, str(tmp_path / "config.json"))
    runs = {}
    for tp in (1, 2):
        plan = hand_plan(model, 1, 1, 1, micro_batch=2, num_microbatches=1, seq_len=SEQ,
                         model_entry=entry, tp=tp)  # fmt: skip
        spec = run_spec_from_plan(plan, model, 1.0, tp, str(tmp_path), steps=3)
        runs[tp] = run_distributed(_losses_body, tp, spec, str(tmp_path), 3)
    (one_losses, one_grads), *_ = runs[1]
    for rank, (losses, grads) in enumerate(runs[2]):
        assert losses == pytest.approx(one_losses, rel=1e-4, abs=1e-4)
        assert grads.keys() == one_grads.keys()
        for key, g in grads.items():
            whole = torch.from_numpy(one_grads[key])
            for axis in [a for a in range(whole.dim()) if whole.shape[a] != g.shape[a]]:
                whole = whole.narrow(axis, rank * g.shape[axis], g.shape[axis])
            torch.testing.assert_close(torch.from_numpy(g), whole, rtol=1e-4, atol=1e-6)
    assert one_losses[2] < one_losses[0]  # it trains
