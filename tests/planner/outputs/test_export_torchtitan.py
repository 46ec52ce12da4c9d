"""The torchtitan 0.3 export parsed back (bash, then torchtitan's flag names) and compared with
the plan; torchtitan's own ConfigManager accepts it where torchtitan is installed."""

from __future__ import annotations

import argparse
from dataclasses import replace

import pytest

from planner.outputs.export import export_plan
from planner.outputs.export.torchtitan import shard_degree
from planner.resources.params import count_params
from planner.specs import SpecError
from tests.planner.outputs.export_plans import (
    KNOBS,
    STAGES,
    bash_array,
    knob_plan,
    make_plan,
    priced_for,
)
from tests.planner.outputs.test_export_torchtitan_model import titan_plan

PAR = "parallelism."
INTS = ("data_parallel_replicate_degree data_parallel_shard_degree tensor_parallel_degree "
        "context_parallel_degree pipeline_parallel_degree pipeline_parallel_microbatch_size "
        "expert_parallel_degree").split()  # fmt: skip


def titan_namespace(args: list[str]) -> argparse.Namespace:
    """The exported arguments under torchtitan 0.3's names (unknown names fail)."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--module")
    p.add_argument("--config")
    for name in INTS:
        p.add_argument(f"--{PAR}{name}", dest=name, type=int)
    p.add_argument(f"--{PAR}pipeline_parallel_schedule", dest="schedule")
    p.add_argument(f"--{PAR}module_fqns_per_model_part", dest="parts", nargs="+")
    for name in ("local_batch_size", "global_batch_size", "seq_len"):
        p.add_argument(f"--training.{name}", dest=name, type=int)
    p.add_argument("--training.mixed_precision_param", dest="param_dtype")
    p.add_argument("--training.disable_cuda_graphs", dest="no_graphs", action="store_true")
    p.add_argument("--optimizer.implementation", dest="optimizer")
    p.add_argument("--checkpoint.enable", dest="checkpoints", action="store_true")
    p.add_argument("--checkpoint.interval", dest="checkpoint_interval", type=int)
    p.add_argument("ac", choices=[f"activation_checkpoint:{m}" for m in
                                  ("none", "selective", "full")])  # fmt: skip
    return p.parse_args(args)


def titan(plan):
    result = export_plan(priced_for(plan, "torchtitan"), "torchtitan")
    return titan_namespace(bash_array(result.text, "TORCHTITAN_ARGS")), result


def fsdp_plan(**kw):
    plan = make_plan(**kw)
    return replace(plan, training={**plan.training, "fsdp": True})


def test_torchtitan_args_match_plan():
    plan = fsdp_plan()
    ns, result = titan(plan)
    p = plan.parallel
    assert (ns.pipeline_parallel_degree, ns.expert_parallel_degree) == (p.pp, p.ep)
    assert (ns.tensor_parallel_degree, ns.context_parallel_degree) == (p.tp, p.cp)
    assert ns.data_parallel_shard_degree * ns.data_parallel_replicate_degree == p.dp
    assert ns.data_parallel_shard_degree == p.dp  # FSDP: all of dp sharded
    assert ns.pipeline_parallel_microbatch_size == p.micro_batch
    assert ns.schedule == "1F1B"
    # pp > 1: a step's micro-batches all go through the pipeline at once
    assert ns.local_batch_size == p.micro_batch * p.num_microbatches == 16
    assert (ns.global_batch_size, ns.seq_len, ns.param_dtype) == (32, 128, "bfloat16")
    assert ns.no_graphs  # CUDA graphs refuse pipeline parallelism
    assert ns.ac == "activation_checkpoint:none"
    parts = [part.split(",") for part in ns.parts]
    assert [[int(f.split(".")[1]) for f in part if f.startswith("layers.")] for part in parts] == [
        list(s) for s in STAGES
    ]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "lm_head"]
    # tiny-moe-deep is no torchtitan model: composed by the config module written beside
    assert (ns.module, ns.config) == ("piper_titan_tiny_moe_deep", "piper_tiny_moe_deep")
    assert list(result.files) == ["piper_titan_tiny_moe_deep.py"]


def test_torchtitan_without_pipelining_accumulates_micro_batches():
    plan = fsdp_plan()
    par = replace(plan.parallel, pp=1, dp=8, edp=4)
    ns, _ = titan(replace(plan, parallel=par, stages=(replace(plan.stages[0], layers=tuple(
        range(8))),), ranks=()))  # fmt: skip
    assert ns.local_batch_size == par.micro_batch == 2  # torchtitan accumulates 8 of them
    assert ns.global_batch_size == 8 * 2 * 8
    assert ns.parts is None and ns.no_graphs  # ep = 2 still turns CUDA graphs off


def test_torchtitan_full_recompute_on_every_layer():
    plan = fsdp_plan()
    rc, result = titan(replace(plan, parallel=replace(plan.parallel, recompute="full")))
    assert rc.ac == "activation_checkpoint:full"
    assert not any("recompute" in n for n in result.notes)


@pytest.mark.parametrize(
    ("change", "phrase"),
    [
        ({"training": {"fsdp": False}}, "priced with no sharding"),
        ({"training": {"a2a_overlap": True}}, "1F1B all-to-all overlap"),
        ({"extra": {"dispatcher": "deepep"}}, "deepep dispatcher"),
        ({"training": {"dtype": "fp8"}}, "priced in fp8"),
    ],
)
def test_torchtitan_refuses_what_it_does_not_run(change, phrase):
    plan = priced_for(fsdp_plan(), "torchtitan")
    plan = replace(
        plan,
        training={**plan.training, **change.get("training", {})},
        extra={**plan.extra, **change.get("extra", {})},
    )
    with pytest.raises(SpecError, match=f"{phrase}.*re-plan with --target torchtitan"):
        export_plan(plan, "torchtitan")


@pytest.mark.parametrize(("dp", "tp", "ep", "shard"), [(4, 1, 2, 2), (1, 4, 4, 1), (2, 2, 2, 1)])
def test_torchtitan_shard_degree_lets_ep_fit(dp, tp, ep, shard):
    got = shard_degree(dp, 1, tp, ep, sharded=False)
    assert got == shard and dp % got == 0 and (got * tp) % ep == 0
    assert shard_degree(dp, 1, tp, ep, sharded=True) == dp


def test_torchtitan_every_knob():
    """torchtitan's equivalents of the knobs it runs: vp, cp, FSDP, bf16 moments, full
    recompute on every layer, its own model config; etp = 1 with ep > 1."""
    plan = knob_plan("bf16")
    k = KNOBS
    par = replace(plan.parallel, etp=1, edp=k["tp"] * k["cp"] * k["dp"] // k["ep"],
                  recompute="full", recompute_modules=())  # fmt: skip
    training = {**plan.training, "a2a_overlap": False, "cuda_graphs": "none", "mtp_layers": 0}
    plan = replace(plan, parallel=par, training=training, extra={"dispatcher": "flat"})
    ns, result = titan(plan)
    assert (ns.module, ns.config) == ("deepseek_v3", "deepseek_v3_671b")
    assert ns.schedule == "Interleaved1F1B" and len(ns.parts) == k["pp"] * k["vp"]
    assert ns.context_parallel_degree == k["cp"] and ns.data_parallel_shard_degree == k["dp"]
    assert ns.optimizer == "fused_opt_states_bf16"
    assert ns.ac == "activation_checkpoint:full"
    with pytest.raises(SpecError, match="re-plan with --target torchtitan"):
        export_plan(knob_plan("bf16"), "torchtitan")  # etp 2, the overlap, DeepEP, modules


NATIVE = {"deepseek-v3": "deepseek_v3", "qwen3-30b-a3b": "qwen3", "gpt-oss-20b": "gpt_oss"}


@pytest.mark.parametrize("name", [*NATIVE, "tiny-moe-deep", "llama4-maverick"])
def test_torchtitan_config_manager_accepts_the_export(name, tmp_path, monkeypatch):
    """torchtitan 0.3's ConfigManager parses the export (with the config module beside it on
    PYTHONPATH) and builds the model on the meta device with the plan's parameter count."""
    manager = pytest.importorskip("torchtitan.config.manager")
    torch = pytest.importorskip("torch")
    plan = titan_plan(name)
    result = export_plan(plan, "torchtitan")
    for file, text in result.files.items():
        (tmp_path / file).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    config = manager.ConfigManager().parse_args(bash_array(result.text, "TORCHTITAN_ARGS"))
    p, par, tr = plan.parallel, config.parallelism, config.training
    assert (par.pipeline_parallel_degree, par.tensor_parallel_degree) == (p.pp, p.tp)
    assert (par.context_parallel_degree, par.expert_parallel_degree) == (p.cp, p.ep)
    assert par.data_parallel_replicate_degree * par.data_parallel_shard_degree == p.dp
    assert par.pipeline_parallel_microbatch_size == p.micro_batch
    assert tr.global_batch_size == p.dp * p.micro_batch * p.num_microbatches
    assert tr.local_batch_size == p.micro_batch * p.num_microbatches  # pp > 1
    assert len(par.module_fqns_per_model_part) == p.pp * p.vp
    assert config.model_spec.name == NATIVE.get(name, f"piper_titan_{name.replace('-', '_')}")
    if name in NATIVE:
        return  # torchtitan's own shapes; the benchmark builds those (export_check.py)
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        built = model_config.build()
    assert sum(t.numel() for t in built.parameters()) == count_params(plan.model_spec()).total
