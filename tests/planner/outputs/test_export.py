"""The Megatron-LM export parsed back (bash, then Megatron's flag names and types) and compared
value by value with the plan and the model; Megatron-Core's TransformerConfig accepts it."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from planner.inputs.models import load_model, model_config, resolve_model
from planner.outputs.export import export_plan
from planner.outputs.export.megatron import megatron_args, pipeline_split_args
from planner.outputs.export.model_settings import model_settings
from planner.plan import ExpertPlacement, ModelEntry, StagePlan
from planner.specs import SpecError
from tests.planner.outputs import export_plans
from tests.planner.outputs.export_plans import (
    KNOB_STAGES,
    KNOBS,
    bash_array,
    knob_plan,
    make_plan,
    priced_for,
)
from tests.planner.outputs.megatron_core import megatron_namespace, transformer_config


def megatron(plan):
    """(namespace of the exported flags as Megatron-LM parses them, export result)."""
    result = export_plan(priced_for(plan, "megatron"), "megatron")
    return megatron_namespace(bash_array(result.text, "MEGATRON_ARGS")), result


def test_megatron_flags_match_plan():
    plan = make_plan()
    ns, result = megatron(plan)
    p = plan.parallel
    assert (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size) == (p.tp, p.pp)
    assert (ns.expert_model_parallel_size, ns.expert_tensor_parallel_size) == (p.ep, 1)
    assert ns.context_parallel_size == 1 and ns.micro_batch_size == p.micro_batch
    assert ns.global_batch_size == p.dp * p.micro_batch * p.num_microbatches == 32
    assert (ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers) == (3, 1)
    assert ns.pipeline_model_parallel_layout is None
    assert not ns.sequence_parallel  # tp = 1
    m = load_model("tiny-moe-deep")
    assert (ns.num_layers, ns.hidden_size, ns.seq_length) == (8, 64, 128)
    assert (ns.num_attention_heads, ns.num_query_groups, ns.group_query_attention) == (4, 2, True)
    assert ns.ffn_hidden_size == m.layers[0].dense_ffn == 128
    assert (ns.num_experts, ns.moe_router_topk, ns.moe_ffn_hidden_size) == (8, 2, 64)
    assert ns.moe_layer_freq == [0, 1, 1, 1, 1, 1, 1, 1]
    assert ns.moe_shared_expert_intermediate_size == 64
    assert ns.swiglu and ns.untie_embeddings_and_output_weights and ns.bf16
    assert not ns.use_distributed_optimizer and ns.recompute_granularity is None
    assert ns.moe_token_dispatcher_type == "alltoall"
    # Piper's generic MoE: softmax router renormalized over the top-k, the class-default aux
    assert (ns.moe_router_score_function, ns.moe_router_pre_softmax) == ("softmax", False)
    assert (ns.moe_router_load_balancing_type, ns.moe_aux_loss_coeff) == (["aux_loss"], 0.001)
    # the contiguous placement and Megatron's rank order need no notes about them
    assert not any("placement" in n or "rank order" in n for n in result.notes)
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in result.text
    assert "# needs Megatron-Core >= 0.13 (checked with 0.16)" in result.text


def test_megatron_zero_and_uniform_full_recompute():
    plan = priced_for(replace(make_plan(zero=True), parallel=replace(
        make_plan().parallel, recompute="full")), "megatron")  # fmt: skip
    ns, result = megatron(plan)
    assert ns.use_distributed_optimizer
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == (
        "full", "uniform", 1,
    )  # fmt: skip
    assert not any("recompute" in n for n in result.notes)


@pytest.mark.parametrize("engine", ["megatron", "torchtitan"])
def test_exports_refuse_what_the_engine_runs_differently(engine):
    """A planned expert placement, recompute on some layers only, or another engine's
    conventions: one line naming the setting and `re-plan with --target ENGINE`."""
    permuted = tuple(ExpertPlacement(layer, (1, 0, 0, 0, 1, 1, 1, 0)) for layer in range(1, 8))

    def make_plan(**kw):  # each engine's own sharding, so only the setting tested differs
        plan = export_plans.make_plan(**kw)
        return replace(plan, training={**plan.training, "fsdp": engine == "torchtitan"})

    cases = {
        "places experts off the engine's default": priced_for(make_plan(experts=permuted), engine),
        "recomputes 3 of 8 layers": replace(
            priced_for(make_plan(recompute={0: (0, 1), 1: (3,)}), engine),
            parallel=replace(make_plan().parallel, recompute="full"),
        ),
        "B of training state per parameter": priced_for(
            make_plan(), "torchtitan" if engine == "megatron" else "megatron"
        ),
    }
    for phrase, plan in cases.items():
        with pytest.raises(SpecError, match=f"{phrase}.*re-plan with --target {engine}") as err:
            export_plan(plan, engine)
        assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("counts", "mtp", "expected"),
    [
        ([4, 4, 4], 0, []),
        ([5, 3], 0, ["--decoder-first-pipeline-num-layers", "5"]),
        ([3, 2, 2, 2], 0, ["--decoder-first-pipeline-num-layers", "3"]),
        ([2, 2, 2, 1], 0, ["--decoder-last-pipeline-num-layers", "1"]),
        ([2, 3, 1, 2], 1, ["--pipeline-model-parallel-layout", "Ett|ttt|t|ttmL"]),
    ],
)
def test_pipeline_split_cases(counts, mtp, expected):
    args, notes = pipeline_split_args(counts, mtp)
    assert args == expected
    assert bool(notes) == ("--pipeline-model-parallel-layout" in args)


def test_megatron_sequence_parallel_with_tensor_parallelism():
    plan = make_plan()
    par = replace(plan.parallel, dp=1, tp=2, edp=1)  # the planner's model splits tokens over tp
    ns, result = megatron(replace(plan, parallel=par))
    assert ns.tensor_model_parallel_size == 2 and ns.sequence_parallel
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1\n" in result.text  # Megatron needs it with TP


def test_megatron_every_knob():
    """vp (a layout string: the virtual stages differ), cp, etp, recompute modules, FSDP,
    bf16 moments, FP8, the all-to-all overlap, DeepEP and MTP, each landing in its flag."""
    plan = knob_plan("fp8")
    ns, result = megatron(plan)
    k = KNOBS
    assert (ns.pipeline_model_parallel_size, ns.context_parallel_size) == (k["pp"], k["cp"])
    assert (ns.tensor_model_parallel_size, ns.expert_model_parallel_size) == (k["tp"], k["ep"])
    assert ns.expert_tensor_parallel_size == k["etp"]
    # virtual stage c*pp+s holds chunk c of rank s: ranks of 8 layers split 4+4, of 7 into 4+3
    chunks = [[4, 4] if n == 8 else [4, 3] for n in KNOB_STAGES]
    virtual = [chunks[s][c] for c in range(k["vp"]) for s in range(k["pp"])]
    stages = ns.pipeline_model_parallel_layout.split("|")
    assert [s.count("t") for s in stages] == virtual and len(stages) == k["pp"] * k["vp"]
    assert stages[0].startswith("E") and stages[-1].endswith("mL")
    assert ns.recompute_granularity == "selective"
    assert ns.recompute_modules == ["moe_act", "layernorm"]
    assert ns.use_megatron_fsdp and not ns.use_distributed_optimizer
    assert (ns.data_parallel_sharding_strategy, ns.ckpt_format) == (
        "optim_grads_params", "fsdp_dtensor",
    )  # fmt: skip
    assert ns.use_precision_aware_optimizer
    assert (ns.exp_avg_dtype, ns.exp_avg_sq_dtype) == ("bf16", "bf16")
    assert ns.bf16 and (ns.fp8, ns.fp8_recipe) == ("e4m3", "tensorwise")
    assert ns.overlap_moe_expert_parallel_comm and ns.delay_wgrad_compute
    assert (ns.moe_token_dispatcher_type, ns.moe_flex_dispatcher_backend) == ("flex", "deepep")
    assert ns.mtp_num_layers == 1
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=32\n" in result.text  # FSDP and the overlap
    assert "# needs Megatron-Core >= 0.16" in result.text  # the flex dispatcher's backend flag
    mx, _ = megatron(knob_plan("mxfp8"))
    assert (mx.fp8, mx.fp8_recipe) == ("e4m3", "mxfp8")


def test_megatron_equal_virtual_stages_use_layers_per_virtual_stage():
    plan = make_plan(stages=((0, 1), (2, 3), (4, 5), (6, 7)))
    par = replace(plan.parallel, vp=2)
    ns, _ = megatron(replace(plan, parallel=par))
    assert ns.num_layers_per_virtual_pipeline_stage == 1
    assert ns.pipeline_model_parallel_layout is None


def test_megatron_model_settings_of_deepseek_v3(first_plans):
    ns, result = megatron(first_plans["deepseek-v3"])
    assert ns.multi_latent_attention and (ns.q_lora_rank, ns.kv_lora_rank) == (1536, 512)
    assert (ns.qk_head_dim, ns.qk_pos_emb_head_dim, ns.v_head_dim) == (128, 64, 128)
    assert ns.qk_layernorm and ns.mtp_num_layers == 1
    assert ns.moe_layer_freq == [0] * 3 + [1] * 58
    # sigmoid scores with expert bias (noaux_tc), 8 groups top-4, scaled by 2.5
    assert (ns.moe_router_score_function, ns.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (ns.moe_router_num_groups, ns.moe_router_group_topk) == (8, 4)
    assert ns.moe_router_topk_scaling_factor == 2.5
    assert (ns.moe_router_load_balancing_type, ns.moe_aux_loss_coeff) == (["seq_aux_loss"], 1e-4)
    assert (ns.rotary_base, ns.layernorm_epsilon, ns.rope_type) == (10000, 1e-6, "rope")
    assert not ns.apply_rope_fusion  # Megatron fuses MLA's RoPE only for YaRN
    assert ns.moe_router_dtype == "fp32"


def test_megatron_model_settings_of_the_first_plans(first_plans):
    qwen, _ = megatron(first_plans["qwen3-30b-a3b"])
    # norm_topk_prob true: the top-k are renormalized, so no pre-softmax
    assert (qwen.rotary_base, qwen.qk_layernorm, qwen.moe_router_pre_softmax) == (
        1000000, True, False,
    )  # fmt: skip
    assert (qwen.moe_aux_loss_coeff, qwen.layernorm_epsilon) == (0.001, 1e-6)
    scout, _ = megatron(first_plans["llama4-scout"])
    assert (scout.moe_router_score_function, scout.moe_router_topk) == ("sigmoid", 1)
    assert scout.qk_l2_norm and not scout.qk_layernorm and scout.rotary_interleaved
    assert scout.no_rope_freq == 4 and scout.moe_apply_probs_on_input
    assert (scout.rotary_base, scout.moe_shared_expert_intermediate_size) == (500000, 8192)
    assert scout.use_distributed_optimizer and scout.recompute_granularity == "full"
    gpt, result = megatron(first_plans["gpt-oss-20b"])
    assert gpt.quick_geglu and not gpt.swiglu and gpt.glu_linear_offset == 1.0
    assert gpt.activation_func_clamp_value == 7.0 and gpt.softmax_type == "learnable"
    assert gpt.window_size == (128, 0) and gpt.window_attn_skip_freq == [1, 0] * 12
    assert not gpt.disable_bias_linear  # attention and expert biases: Megatron's add_bias_linear
    assert (gpt.rotary_base, gpt.moe_aux_loss_coeff) == (150000, 0.9)
    version = result.text.split("# needs Megatron-Core >= ")[1].split()[0]
    assert tuple(map(int, version.split("."))) >= (0, 15)  # softmax-type, quick-geglu offset
    mixtral, _ = megatron(first_plans["default"])
    assert (mixtral.moe_aux_loss_coeff, mixtral.rotary_base) == (0.02, 1000000)


def test_megatron_rope_scaling_from_the_config_file(tmp_path):
    """A config that has DeepSeek-V3's YaRN scaling exports it (MLA's yarn rope type)."""
    cfg, _, _ = resolve_model("deepseek-v3")
    cfg["rope_scaling"] = {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    model = load_model(str(path))
    plan = replace(make_plan(), model=ModelEntry("dsv3", str(path), model_config(model)))
    ns, result = megatron(plan)
    assert (ns.rope_type, ns.rotary_scaling_factor) == ("yarn", 40.0)
    assert (ns.mscale, ns.mscale_all_dim, ns.apply_rope_fusion) == (1.0, 1.0, True)
    assert not any("rope_scaling" in n for n in result.notes)
    cfg["rope_scaling"]["beta_fast"] = 16
    path.write_text(json.dumps(cfg))
    notes = " ".join(export_plan(priced_for(plan, "megatron"), "megatron").notes)
    assert "beta_fast=16.0" in notes and "differs from Megatron's fixed" in notes


def test_model_settings_wrong_type_is_one_line(tmp_path):
    cfg, _, _ = resolve_model("qwen3-30b-a3b")
    cfg["rope_theta"] = "a lot"
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(SpecError, match="rope_theta' must be a number") as err:
        load_model(str(path))  # the model reader refuses it
    assert "\n" not in str(err.value)
    # a plan naming that file as its source (its embedded config valid): the export, which
    # reads the source's settings, refuses it in one line too
    entry = ModelEntry("q", str(path), model_config(load_model("qwen3-30b-a3b")))
    plan = replace(make_plan(), model=entry)
    with pytest.raises(SpecError, match="rope_theta' must be a number") as err:
        model_settings(plan, plan.model_spec())
    assert "\n" not in str(err.value)


def test_megatron_a2a_overlap_needs_vp_with_pipelining_note():
    plan = make_plan()
    plan = replace(plan, training={**plan.training, "a2a_overlap": True})
    notes = " ".join(megatron_args(plan, plan.model_spec()).notes)
    assert "only under interleaved 1F1B" in notes


CORE_PLANS = ["deepseek-v3", "qwen3-30b-a3b", "llama4-scout", "gpt-oss-20b", "default"]


@pytest.mark.parametrize("name", CORE_PLANS)
def test_megatron_core_accepts_the_first_plans(name, first_plans, monkeypatch):
    """Megatron-Core's TransformerConfig.__post_init__ validates each export."""
    pytest.importorskip("megatron.core")
    plan = first_plans[name]
    args = bash_array(export_plan(priced_for(plan, "megatron"), "megatron").text, "MEGATRON_ARGS")
    config = transformer_config(args, monkeypatch)
    p, model = plan.parallel, plan.model_spec()
    assert (config.tensor_model_parallel_size, config.pipeline_model_parallel_size) == (p.tp, p.pp)
    assert (config.expert_model_parallel_size, config.num_moe_experts) == (p.ep, model.num_experts)
    assert config.moe_router_topk == model.top_k
    settings = model_settings(plan, model)
    assert config.moe_router_score_function == settings.router_score
    assert config.layernorm_epsilon == settings.norm_eps


@pytest.mark.parametrize("dtype", ["fp8", "mxfp8", "bf16"])
def test_megatron_core_accepts_every_knob(dtype, monkeypatch):
    pytest.importorskip("megatron.core")
    args = bash_array(
        export_plan(priced_for(knob_plan(dtype), "megatron"), "megatron").text, "MEGATRON_ARGS"
    )
    config = transformer_config(args, monkeypatch)
    k = KNOBS
    assert type(config).__name__ == "MLATransformerConfig"
    assert (config.context_parallel_size, config.expert_tensor_parallel_size) == (k["cp"], k["etp"])
    assert config.overlap_moe_expert_parallel_comm and config.mtp_num_layers == 1
    assert config.recompute_modules == ["moe_act", "layernorm"]
    assert (config.moe_token_dispatcher_type, config.moe_flex_dispatcher_backend) == (
        "flex", "deepep",
    )  # fmt: skip
    layout = config.pipeline_model_parallel_layout
    assert [len(chunks) for chunks in layout.layout] == [k["vp"]] * k["pp"]  # [rank][chunk]
    assert config.fp8 == (None if dtype == "bf16" else "e4m3")
    assert config.cuda_graph_impl == "transformer_engine"
    assert [str(getattr(s, "name", s)) for s in config.cuda_graph_scope] == [
        "attn", "moe_router", "moe_preprocess",
    ]  # fmt: skip


def test_whole_iteration_cuda_graphs_export(monkeypatch):
    pytest.importorskip("megatron.core")
    plan = knob_plan("bf16")
    # whole-iteration graphs: Megatron refuses them with the all-to-all overlap
    full = replace(plan, training={**plan.training, "cuda_graphs": "full", "a2a_overlap": False})
    args = bash_array(export_plan(priced_for(full, "megatron"), "megatron").text, "MEGATRON_ARGS")
    assert args[args.index("--cuda-graph-impl") + 1] == "local"
    assert args[args.index("--cuda-graph-scope") + 1] == "full_iteration"
    config = transformer_config(args, monkeypatch)
    assert config.cuda_graph_impl == "local"
    none = replace(plan, training={**plan.training, "cuda_graphs": "none"})
    text = export_plan(priced_for(none, "megatron"), "megatron").text
    assert "--cuda-graph-impl" not in bash_array(text, "MEGATRON_ARGS")


def test_megatron_core_refuses_a_broken_export(first_plans, monkeypatch):
    """The check has teeth: expert bias with a softmax router is Megatron-Core's error."""
    pytest.importorskip("megatron.core")
    args = bash_array(
        export_plan(priced_for(first_plans["deepseek-v3"], "megatron"), "megatron").text,
        "MEGATRON_ARGS",
    )
    i = args.index("--moe-router-score-function")
    args[i + 1] = "softmax"
    with pytest.raises(ValueError, match="Expert bias for aux-loss-free routing"):
        transformer_config(args, monkeypatch)


def test_stage_layers_of_a_permuted_plan_are_refused():
    plan = make_plan()
    bad = replace(plan, parallel=replace(plan.parallel, vp=2),
                  stages=tuple(StagePlan(i, (i,)) for i in range(4)))  # fmt: skip
    with pytest.raises(SpecError, match="stages must cover layers 0..7 in order"):
        export_plan(priced_for(bad, "megatron"), "megatron")


def test_megatron_without_the_hf_config_says_the_defaults_are_used():
    """A hand-written plan without model.settings that names no config gets the family's
    defaults with a note; one naming a config that is gone is refused (not defaults)."""
    plan = make_plan()
    entry = replace(plan.model, name="my-model", source="", settings=None)
    notes = " ".join(
        export_plan(priced_for(replace(plan, model=entry), "megatron"), "megatron").notes
    )
    assert "no HF config found for 'my-model'" in notes
    gone = replace(plan.model, name="my-model", source="/nowhere/config.json", settings=None)
    with pytest.raises(SpecError, match="has no model.settings .* '/nowhere/config.json' cannot"):
        export_plan(priced_for(replace(plan, model=gone), "megatron"), "megatron")
    assert "no HF config" not in " ".join(
        export_plan(priced_for(plan, "megatron"), "megatron").notes
    )
