"""benchmarks/export_check.py: priced settings and each engine's parsed values in one
vocabulary (pure functions; the engines themselves run only in the benchmark)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import export_check as ec  # noqa: E402

from planner.run.spec import run_spec_from_plan  # noqa: E402
from tests.planner.outputs.export_plans import (  # noqa: E402
    KNOB_STAGES,
    knob_plan,
    make_plan,
    priced_for,
)


def test_layer_set_text():
    assert ec.layer_set_text([], 8) == "none"
    assert ec.layer_set_text(range(8), 8) == "all 8"
    assert ec.layer_set_text([0, 1, 2, 5, 7], 8) == "5 of 8: 0-2,5,7"


def test_priced_settings_of_the_every_knob_plan():
    plan = priced_for(knob_plan("fp8"), "megatron")
    got = ec.priced_settings(plan, 61, 1)
    assert set(got) == set(ec.SETTINGS)
    layout = (got["pp"], got["vp"], got["cp"], got["ep"], got["etp"], got["dp"])
    assert layout == (8, 2, 2, 32, 2, 16)
    assert got["global_batch"] == 16 * 1 * 64 and got["num_microbatches"] == 64
    # 8 ranks x 2 chunks in virtual order; each rank's layers split over its chunks
    assert len(got["pipeline_split"]) == 16 and sum(got["pipeline_split"]) == 61
    assert [got["pipeline_split"][s] + got["pipeline_split"][8 + s] for s in range(8)] == list(
        KNOB_STAGES
    )
    assert got["recompute"] == "selective"
    assert got["recompute_modules"] == ("layernorm", "moe_act")
    assert got["recompute_layers"] == frozenset(range(61))
    assert (got["sharding"], got["a2a_overlap"], got["dispatcher"]) == ("fsdp", True, "deepep")
    assert (got["dtype"], got["optimizer_dtype"], got["cuda_graphs"]) == ("fp8", "bf16", "partial")
    assert got["mtp_layers"] == 1


def test_priced_settings_read_defaults_from_the_model_and_cluster():
    plan = make_plan(recompute={0: (0, 1)})  # recompute layers listed, policy "none"
    got = ec.priced_settings(plan, 8, 3)
    assert got["recompute"] == "none" and got["recompute_layers"] == frozenset()
    assert got["recompute_modules"] == () and got["mtp_layers"] == 3
    assert got["cuda_graphs"] == "none" and got["sharding"] == "none"
    assert got["pipeline_split"] == (3, 2, 2, 1)
    selective = replace(plan, parallel=replace(plan.parallel, recompute="selective"))
    got = ec.priced_settings(selective, 8, 0)
    assert got["recompute_modules"] == ("core_attn",)  # what the resource model prices
    assert got["recompute_layers"] == frozenset({0, 1})


def megatron_out(**over):
    base = {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
        "context_parallel_size": 1, "expert_model_parallel_size": 4,
        "expert_tensor_parallel_size": 1, "data_parallel_size": 4,
        "virtual_pipeline_model_parallel_size": None, "micro_batch_size": 1,
        "global_batch_size": 64, "seq_length": 4096, "num_layers": 8,
        "recompute_granularity": None, "recompute_method": None, "recompute_num_layers": None,
        "recompute_modules": None, "use_distributed_optimizer": True, "use_megatron_fsdp": False,
        "data_parallel_sharding_strategy": "no_shard", "overlap_moe_expert_parallel_comm": False,
        "num_moe_experts": 8, "moe_token_dispatcher_type": "alltoall",
        "moe_flex_dispatcher_backend": "deepep", "bf16": True, "fp16": False, "fp8": None,
        "fp8_recipe": "delayed", "fp4": None, "use_precision_aware_optimizer": False,
        "exp_avg_dtype": "torch.float32", "exp_avg_sq_dtype": "torch.float32",
        "cuda_graph_impl": "none", "cuda_graph_scope": [], "mtp_num_layers": None,
    }  # fmt: skip
    base.update(over)
    return {"args": dict(base), "config": dict(base), "num_microbatches": 16,
            "chunks": [[0, 0, 5], [1, 5, 3]]}  # fmt: skip


def test_megatron_parsed_reads_args_and_config():
    got = {k: v for k, (v, _) in ec.megatron_parsed(megatron_out(), 8).items()}
    assert (got["tp"], got["pp"], got["vp"], got["ep"], got["dp"]) == (2, 2, 1, 4, 4)
    assert got["pipeline_split"] == (5, 3) and got["num_microbatches"] == 16
    assert (got["sharding"], got["dispatcher"], got["dtype"]) == ("zero", "flat", "bf16")
    assert (got["recompute"], got["recompute_layers"]) == ("none", frozenset())
    assert (got["optimizer_dtype"], got["cuda_graphs"], got["mtp_layers"]) == ("fp32", "none", 0)


def test_megatron_parsed_recompute_methods_and_knobs():
    out = megatron_out(recompute_granularity="full", recompute_method="block",
                       recompute_num_layers=2, moe_token_dispatcher_type="flex",
                       fp8="e4m3", fp8_recipe="mxfp8", use_megatron_fsdp=True,
                       data_parallel_sharding_strategy="optim_grads_params",
                       use_precision_aware_optimizer=True, exp_avg_dtype="torch.bfloat16",
                       exp_avg_sq_dtype="torch.bfloat16", cuda_graph_impl="local",
                       cuda_graph_scope=["full_iteration"], mtp_num_layers=1)  # fmt: skip
    got = {k: v for k, (v, _) in ec.megatron_parsed(out, 8).items()}
    assert got["recompute_layers"] == frozenset({0, 1, 5, 6})  # the first 2 of each chunk
    assert (got["dispatcher"], got["dtype"], got["sharding"]) == ("deepep", "mxfp8", "fsdp")
    assert (got["optimizer_dtype"], got["cuda_graphs"], got["mtp_layers"]) == ("bf16", "full", 1)
    uniform = megatron_out(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1)  # fmt: skip
    assert ec.megatron_parsed(uniform, 8)["recompute_layers"][0] == frozenset(range(8))
    selective = megatron_out(recompute_granularity="selective", recompute_modules=["moe_act"])
    got = {k: v for k, (v, _) in ec.megatron_parsed(selective, 8).items()}
    assert got["recompute_modules"] == ("moe_act",) and got["recompute_layers"] == frozenset(
        range(8)
    )


def titan_out(pp=1, parts=None, local=2, ac="FullAC.Config", **training):
    return {
        "parallelism": {
            "data_parallel_replicate_degree": 1, "data_parallel_shard_degree": 8,
            "tensor_parallel_degree": 2, "context_parallel_degree": 1,
            "pipeline_parallel_degree": pp,
            "pipeline_parallel_schedule": "Interleaved1F1B" if parts and len(parts) > pp
            else "1F1B",
            "pipeline_parallel_microbatch_size": 1, "expert_parallel_degree": 4,
            "module_fqns_per_model_part": parts,
        },
        "training": {"local_batch_size": local, "global_batch_size": 128, "seq_len": 4096,
                     "dtype": "float32", "mixed_precision_param": "bfloat16",
                     "disable_cuda_graphs": True, **training},
        "activation_checkpoint": ac, "optimizer_implementation": "foreach",
        "dispatchers": ["AllToAllTokenDispatcher.Config"], "mtp_layers": 0, "converters": [],
    }  # fmt: skip


def test_titan_parsed_pp1_accumulates_local_batches():
    got = {k: v for k, (v, _) in ec.titan_parsed(titan_out(), 4).items()}
    assert (got["dp"], got["micro_batch"], got["num_microbatches"]) == (8, 2, 8)
    assert (got["etp"], got["vp"], got["pipeline_split"]) == (1, 1, (4,))
    assert (got["recompute"], got["recompute_layers"]) == ("full", frozenset(range(4)))
    assert (got["sharding"], got["dispatcher"], got["dtype"]) == ("fsdp", "flat", "bf16")
    assert (got["cuda_graphs"], got["optimizer_dtype"], got["a2a_overlap"]) == (
        "none", "fp32", False)  # fmt: skip


def test_titan_parsed_interleaved_parts():
    parts = [["tok_embeddings", "layers.0"], ["layers.1"], ["layers.2"],
             ["layers.3", "norm", "lm_head"]]  # fmt: skip
    out = titan_out(pp=2, parts=parts, local=16, ac=None, disable_cuda_graphs=False)
    out["parallelism"]["data_parallel_replicate_degree"] = 2
    got = {k: v for k, (v, _) in ec.titan_parsed(out, 4).items()}
    assert (got["vp"], got["pipeline_split"], got["num_microbatches"]) == (2, (1, 1, 1, 1), 16)
    assert (got["dp"], got["sharding"]) == (16, "hsdp 2x8")
    assert (got["recompute"], got["cuda_graphs"]) == ("none", "full")


def test_piper_parsed_against_a_plan_flags_only_what_the_runtime_runs_otherwise():
    plan = make_plan(recompute={0: (0, 1)})
    spec = run_spec_from_plan(plan, plan.model_spec())
    priced = ec.priced_settings(plan, 8, plan.model_spec().num_mtp_layers)
    rows = ec.compare(priced, ec.piper_parsed(spec, "flat", "bf16"))
    assert [r[0] for r in rows] == list(ec.SETTINGS)
    assert [r[0] for r in rows if not r[4]] == []  # the export's --precision plan: bf16
    # the plan is priced in bf16; a runtime left at its own fp32 and halo runs otherwise
    rows = ec.compare(priced, ec.piper_parsed(spec, "halo", "fp32"))
    assert [r[0] for r in rows if not r[4]] == ["dispatcher", "dtype"]


def test_compare_reports_a_setting_the_engine_did_not_give():
    priced = {name: 1 for name in ec.SETTINGS}
    parsed = {name: (1, "f") for name in ec.SETTINGS if name != "mtp_layers"}
    rows = ec.compare(priced, parsed)
    assert [(r[0], r[2], r[4]) for r in rows if not r[4]] == [("mtp_layers", "<not parsed>", False)]
    assert ec.show(frozenset(range(3)), 3) == "all 3" and ec.show((4, 4), 8) == "4/4"
    assert ec.show(True, 1) == "on"


def test_titan_parsed_compares_the_built_params_within_one_percent():
    out = titan_out()
    out.update(params=46_702_000_000)
    got = ec.titan_parsed(out, 4)
    assert got["model_params"] == (46_702_000_000, "model built on meta")
    out.update(dispatchers=[])  # a model config with no dispatcher is no flat dispatcher
    assert ec.titan_parsed(out, 4)["dispatcher"][0] == "none in the model config"
    priced = {name: got[name][0] for name in ec.SETTINGS} | {"model_params": 46_702_792_704}
    assert all(r[4] for r in ec.compare(priced, got))  # within 1%
    priced["model_params"] = 46_702_792_704 // 2
    rows = ec.compare(priced, got)
    assert [r[0] for r in rows if not r[4]] == ["model_params"]
    assert ec.show(541_762_717_696, 4, "model_params") == "541.76B params"


def test_run_titan_sources_the_export_and_builds_the_composed_model(tmp_path):
    """The benchmark's torchtitan path end to end on a model torchtitan composes (skipped
    without torchtitan): the args file sourced, its config module found on PYTHONPATH, every
    priced setting parsed as priced and the model built with the plan's parameter count."""
    pytest.importorskip("torchtitan.config.manager")
    from planner.resources.params import count_params
    from tests.planner.outputs.test_export_torchtitan_model import titan_plan

    plan = titan_plan("tiny-moe-deep")
    path = tmp_path / "plan.json"
    path.write_text(plan.to_json())
    out = ec.run_titan(path, sys.executable)
    assert isinstance(out, dict), out
    model = plan.model_spec()
    total = count_params(model).total
    assert out["params"] == total and out["build"].startswith("ok")
    priced = ec.priced_settings(plan, model.num_layers, model.num_mtp_layers, total)
    rows = ec.compare(priced, ec.titan_parsed(out, model.num_layers))
    assert [r[0] for r in rows if not r[4]] == []
