"""The runtime as a memory oracle (benchmarks/memory_oracle.py) on small plans: every rank of
tiny-moe-deep plans made by `piper plan --target piper` on cpu-gloo, built by the runtime's
own builders on the meta device with a fake process group, holds exactly the weights,
gradients and Adam moments the resource model predicts for its stage, parameter for
parameter, under pp, vp, tp, ep, etp, FSDP and redundant expert slots.

The runtime holds 16 B per parameter (fp32 weights 4, grads 4, Adam moments 8), the piper
target's model 18 (bf16 weights 2 - the copies a bf16 step computes with, not parameter
state -, fp32 grads 4, master + moments 12), so each component and the totals are compared in
parameters (bytes / bytes per parameter). With tp > 1
both split the embedding and head by vocabulary rows and keep norms and routers whole on
every TP rank; the test pins a TP rank's parameters to their hand count too.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_oracle as mo  # noqa: E402

from planner.cli import main as piper  # noqa: E402
from planner.plan import load_plan  # noqa: E402
from planner.specs import GIB  # noqa: E402

D, V, E = 64, 256, 8  # tiny-moe-deep: hidden, vocabulary, routed experts; 8 layers, layer 0 dense
EXPERT = 3 * D * 64  # one gated routed expert (moe_intermediate_size 64)

LAYOUTS = {  # name -> piper plan's ranks and layout flags on cpu-gloo
    "pp-vp-tp-ep": "--gpus 8 --pp 2 --vp 2 --tp 2 --ep 2",
    "ep-fsdp": "--gpus 4 --pp 1 --tp 1 --ep 2 --fsdp",
    "ep-fsdp-mtp": "--gpus 4 --pp 1 --tp 1 --ep 2 --fsdp --mtp-layers 1",
    "pp-vp-ep-etp-slots": "--gpus 8 --pp 2 --vp 2 --tp 1 --ep 2 --etp 2 --redundant-slots 2",
    "mla-pp-ep": "--gpus 4 --pp 2 --vp 1 --tp 1 --ep 2",  # TINY_MLA, not tiny-moe-deep
    "mla-tp-ep": "--gpus 4 --pp 1 --vp 1 --tp 2 --ep 2 --no-fsdp",
    "mla-mtp-pp-ep": "--gpus 4 --pp 2 --vp 1 --tp 1 --ep 2 --mtp-layers 1",
    "mla-mtp-tp-ep": "--gpus 4 --pp 1 --vp 1 --tp 2 --ep 2 --no-fsdp --mtp-layers 1",
}
# a DeepSeek-V2-shaped model at tiny size: 4 heads, q / kv latents 32 / 16, heads 8 + 8 (v 8)
TINY_MLA = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2",
    "tie_word_embeddings": False, "moe_layer_freq": 1, "hidden_size": D,
    "intermediate_size": 128, "moe_intermediate_size": 32, "n_routed_experts": E,
    "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 4,
    "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "v_head_dim": 8, "vocab_size": V, "max_position_embeddings": 256,
}  # fmt: skip


@pytest.fixture(scope="module")
def plans(tmp_path_factory) -> dict[str, Path]:
    """Each layout planned once by `piper plan --target piper` (no plots: not read here)."""
    root = tmp_path_factory.mktemp("oracle")
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("planner.outputs.plots.render_plots", lambda plan, est: {})
        mla = root / "mla.json"
        mla.write_text(json.dumps(TINY_MLA))
        for name, flags in LAYOUTS.items():
            model = str(mla) if name.startswith("mla") else "tiny-moe-deep"
            args = ["plan", "--model", model, "--cluster", "cpu-gloo"]
            args += ["--seq-len", "64", "--global-batch", "16", "--target", "piper"]
            with contextlib.redirect_stdout(io.StringIO()):
                assert piper([*args, *flags.split(), "--out", str(root / name)]) == 0
            out[name] = root / name / "plan.json"
    return out


def _params(nbytes: float, per_param: float) -> float:
    return nbytes / per_param


def check_every_rank(path: Path, mla: bool = False) -> tuple[list, dict]:
    """Every rank's runtime parameters equal the model's for its stage, component by
    component (plus, for MLA, the attention excess); totals equal in bytes.
    Returns the states and context."""
    states, ctx = mo.oracle(path, every_rank=True)
    model_bpp = {c: mo.RUNTIME_BYTES_PER_PARAM[c] / ctx["conv"][c] for c in mo.COMPONENTS}
    assert model_bpp == {"weights": 2, "grads": 4, "optimizer": 12}  # the piper target's 18
    if not mla:
        assert ctx["attention"] == [0.0] * ctx["spec"].pp  # GQA runs as planned
    for st in states:
        model = ctx["model"][st.stage]
        excess = ctx["attention"][st.stage]
        for c in mo.COMPONENTS:
            run = _params(st.component(c), mo.RUNTIME_BYTES_PER_PARAM[c])
            assert run == pytest.approx(_params(model[c], model_bpp[c]) + excess, rel=1e-12), (
                st,
                c,
            )
        assert st.component("total") / 16 == pytest.approx(model["total"] / 18 + excess, rel=1e-12)
    return states, ctx


def test_pp_vp_tp_ep_ranks_hold_the_model_state_with_vocab_rows_and_whole_norms(plans):
    states, ctx = check_every_rank(plans["pp-vp-tp-ep"])
    spec = ctx["spec"]
    assert (spec.pp, spec.vp, spec.tp, spec.ep, spec.dp) == (2, 2, 2, 2, 2)
    assert [st.stage for st in states] == [0] * 4 + [1] * 4
    # a TP rank: half the vocabulary rows of the embedding (first stage: layers 0-1, 4-5)
    # or head (last: 2-3, 6-7) and half of attention (3 D^2) and each MLP (dense 128 wide,
    # shared expert 64 wide); the 2 norms a layer, the routers and the final norm whole;
    # 4 of the 8 experts of each MoE layer (ep = 2)
    layer = 3 * D * D // 2 + 2 * D
    moe = E * D + 3 * D * 64 // 2 + 4 * EXPERT
    first = V // 2 * D + 4 * layer + 3 * D * 128 // 2 + 3 * moe
    last = 4 * layer + 4 * moe + V // 2 * D + D
    assert [st.weights for st in states] == [4 * first] * 4 + [4 * last] * 4


def test_fsdp_shards_weights_grads_and_moments_as_the_model(plans):
    states, ctx = check_every_rank(plans["ep-fsdp"])
    spec = ctx["spec"]
    assert (spec.fsdp, spec.ep, spec.dp, spec.edp) == (True, 2, 4, 2)
    # a rank's shard: dense parameters over dp = 4, its EP rank's 4 experts over edp = 2
    # embedding, 8 x (attention 3 D^2 (4 q heads, 2 kv heads of 16) + 2 norms), layer 0's
    # dense MLP (128 wide), 7 x (router + shared expert 64 wide), head + final norm
    dense = V * D + 8 * (3 * D * D + 2 * D) + 3 * D * 128 + 7 * (E * D + 3 * D * 64) + V * D + D
    assert dense == 246_336
    expert = 7 * 4 * EXPERT
    assert [st.weights for st in states] == [4 * (dense // 4 + expert // 2)] * 4


def test_redundant_slots_with_expert_tp_are_held_and_priced_alike(plans):
    path = plans["pp-vp-ep-etp-slots"]
    states, ctx = check_every_rank(path)
    spec = ctx["spec"]
    assert (spec.pp, spec.vp, spec.ep, spec.etp, spec.edp) == (2, 2, 2, 2, 1)
    slots = mo.slot_state(load_plan(path))
    # 2 slots over ep = 2: one extra expert per MoE layer on every rank, half of it (etp = 2):
    # 3 MoE layers on the first stage, 4 on the last, at the model's 18 B
    assert [s.total for s in slots] == [18 * 3 * EXPERT / 2, 18 * 4 * EXPERT / 2]
    # the same slot state `piper plan` added to the stages' predicted memory
    plan = load_plan(path)
    before = [st.total_gib for st in mo.estimate_plan(plan).stages]
    after = [(b * GIB + s.total) / GIB for b, s in zip(before, slots, strict=True)]
    assert after == pytest.approx(plan.predicted.memory_gib_per_stage, rel=1e-8)
    assert after != pytest.approx(before, rel=1e-8)
    held = [len(moe.experts.expert_ids) for moe in _first_rank_moes(spec)]
    assert held == [5, 5, 5]  # 8 experts / ep 2 + 1 redundant slot per layer
    plain = ctx["model"][0]["weights"] - slots[0].weights
    assert states[0].weights / 4 - plain / 2 == 3 * EXPERT / 2


def test_mla_runs_as_mla_and_holds_the_models_attention(plans):
    # every rank's parameters equal the planner's count with no attention excess: the
    # runtime's MLA holds q down + up, kv down (latent + rope) and up (nope + v), o, and the
    # two latent norms, D*32 + 32*4*16 + D*(16+8) + 16*4*(8+8) + 4*8*D + 32 + 16 a layer
    states, ctx = check_every_rank(plans["mla-pp-ep"])
    assert [st.stage for st in states] == [0, 0, 1, 1]
    mla = D * 32 + 32 * 4 * 16 + D * (16 + 8) + 16 * 4 * (8 + 8) + 4 * 8 * D + 32 + 16
    from runtime.model.attention import MLAttention, make_attention

    att = load_plan(plans["mla-pp-ep"]).model_spec().layers[0].attention
    module = make_attention(D, att, mo.torch.Generator())
    assert isinstance(module, MLAttention)
    assert sum(p.numel() for p in module.parameters()) == mla == 8_752


def test_mla_over_tp_keeps_its_down_projections_whole(plans):
    # tp = 2: q / kv up-projections and o split by heads, the down-projections (q: D x 32,
    # kv: D x (16 + 8)) and the latent norms whole on both ranks, in the runtime and the model
    states, ctx = check_every_rank(plans["mla-tp-ep"])
    assert ctx["spec"].tp == 2 and ctx["attention"] == [0.0]
    whole = D * 32 + 32 + D * (16 + 8) + 16
    split = 32 * 4 * 16 + 16 * 4 * (8 + 8) + 4 * 8 * D
    from runtime.model.attention import MLAttention

    with mo.fake_world(0, ctx["spec"].world), mo.meta_hooks(), mo.torch.device("meta"):
        att = mo.build_trainer(ctx["spec"], 0, mo.torch.device("meta")).module.blocks[0].attn
        assert isinstance(att, MLAttention)
        assert sum(p.numel() for p in att.parameters()) == whole + split // 2


def test_fsdp_shards_the_mtp_modules_experts_over_edp_like_every_moe_layer(plans):
    states, ctx = check_every_rank(plans["ep-fsdp-mtp"])
    assert ctx["spec"].model.num_mtp_layers == 1 and ctx["spec"].fsdp
    plain, _ = check_every_rank(plans["ep-fsdp"])
    # one more MoE layer like the last (attention 3 D^2 + 2 norms, router, shared expert 64
    # wide, 4 experts per EP rank) and 3 D + 2 D^2: dense over dp = 4, experts over edp = 2
    dense = 3 * D * D + 2 * D + E * D + 3 * D * 64 + 3 * D + 2 * D * D
    extra = [4 * (dense // 4 + 4 * EXPERT // 2)] * 4
    assert [a.weights - b.weights for a, b in zip(states, plain, strict=True)] == extra


@pytest.mark.parametrize("name", ["mla-mtp-pp-ep", "mla-mtp-tp-ep"])
def test_mtp_modules_are_held_as_the_model_counts_them(plans, name):
    # one MTP module on the last stage: enorm, hnorm and its final norm (3 D), eh_proj
    # (2 D x D, split over tp), a layer like the last (MLA, 2 norms, router, shared expert 32
    # wide, 4 of the 8 experts at ep = 2); with pp = 2 also the embedding copy (V x D)
    states, ctx = check_every_rank(plans[name], mla=True)
    spec = ctx["spec"]
    assert spec.model.num_mtp_layers == 1
    tp, last_rank = spec.tp, spec.world - 1
    mla = D * 32 + 32 * 4 * 16 + D * (16 + 8) + 16 * 4 * (8 + 8) + 4 * 8 * D + 32 + 16
    whole_mla = D * 32 + 32 + D * (16 + 8) + 16  # MLA's down-projections and latent norms
    attention = whole_mla + (mla - whole_mla) // tp
    layer = attention + 2 * D + E * D + 3 * D * 32 // tp + 4 * 3 * D * 32
    want = 3 * D + 2 * D * D // tp + layer + (V * D if spec.pp > 1 else 0)
    meta = mo.torch.device("meta")
    with mo.fake_world(last_rank, spec.world), mo.meta_hooks(), meta:
        module = mo.build_trainer(spec, last_rank, meta).module
        held = sum(p.numel() for p in module.mtp.parameters())
        held += module.mtp_embed.weight.numel() if module.mtp_embed is not None else 0
    assert held == want


def _first_rank_moes(spec) -> list:
    """Rank 0's MoE layers as the runtime builds them (slot tables installed)."""
    meta = mo.torch.device("meta")
    with mo.fake_world(0, spec.world), mo.meta_hooks(), meta:
        trainer = mo.build_trainer(spec, 0, meta)
        return list(trainer.module.moe_layers().values())


def test_representative_ranks_take_each_stage_block_ends_and_middle(plans):
    plan = load_plan(plans["pp-vp-tp-ep"])
    spec = mo.run_spec_from_plan(plan, plan.model_spec(plans["pp-vp-tp-ep"]))
    ranks = mo.representative_ranks(spec)
    logical = [spec.logical_of_physical[r] for r in ranks]
    assert logical == [0, 2, 3, 4, 6, 7]
