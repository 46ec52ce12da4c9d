"""NVFP4, MXFP4 and block-scaled FP8 priced by hand: the GEMMs at the format's peak, the
quantize traffic, the bytes of state and saved activations per recipe, the BF16-kept layers,
the refusal of a cluster without the peak, and the Megatron / torchtitan exports."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.outputs.export import export_plan
from planner.outputs.export.megatron import megatron_args
from planner.parallel import ParallelConfig
from planner.resources.compute import M_HALF_ROWS, gemm_time, layer_work
from planner.resources.cost import estimate
from planner.resources.memory import layer_activations, state_bytes
from planner.resources.precision import cast_time_s, gemm_peak_tflops, layer_training
from planner.specs import DeviceSpec, EfficiencyTable, SpecError, TrainingSpec
from tests.planner.outputs.export_plans import knob_plan, make_plan, priced_for
from tests.planner.outputs.megatron_core import FLAGS, transformer_config
from tests.planner.resources.resource_specs import make_cluster, make_model

D, H, E, K, F = 64, 4, 8, 2, 96
PEAKS = (("bf16", 100.0), ("fp8", 200.0), ("nvfp4", 400.0), ("mxfp4", 400.0))


def _cluster(tables: tuple = ()):
    cl = make_cluster(tables=tables)
    return replace(cl, device=DeviceSpec("dev", 80.0, PEAKS, 1000.0))


def _model(layers: int = 2):
    return make_model(layers=layers, d=D, heads=H, experts=E, top_k=K, ffn=F)


@pytest.mark.parametrize("dtype,peak", [("nvfp4", 400.0), ("mxfp4", 400.0),
                                        ("fp8_blockwise", 200.0)])  # fmt: skip
def test_gemm_time_is_flops_over_the_formats_peak_times_efficiency(dtype, peak):
    cl, rows, flops = _cluster(), 4096.0, 3e12
    t, tables = gemm_time(cl, TrainingSpec(dtype=dtype), rows, flops, 0.0, 0)
    eff = cl.gemm_efficiency * rows / (rows + M_HALF_ROWS)  # 0.5 x 4096 / 4224
    assert tables == () and t == pytest.approx(flops / (peak * 1e12 * eff))


# per element: amax + row-wise + column-wise (nvfp4); two independent copies (mxfp4, blockwise)
CAST = {"nvfp4": (7.125, 5.125), "mxfp4": (5.0625, 5.0625),
        "fp8_blockwise": (6.0625, 2 + 2 * (1 + 4 / 128**2))}  # fmt: skip


@pytest.mark.parametrize("dtype", ["nvfp4", "mxfp4", "fp8_blockwise"])
def test_only_linear_gemms_run_in_the_format_and_each_adds_its_casts(dtype):
    """Measured tables: bf16 40, fp8 80, fp4 160 TFLOPS; attention, router and the memory-bound
    passes keep their bf16 time; the quantize pass moves CAST bytes per element."""
    tables = tuple(EfficiencyTable(f"gemm_{n}", (1.0, 1e9), (v, v))
                   for n, v in (("bf16", 40.0), ("fp8_blockwise", 80.0), ("nvfp4", 160.0),
                                ("mxfp4", 160.0)))  # fmt: skip
    cl, model = _cluster(tables), _model()
    par = ParallelConfig(pp=1, dp=2, ep=2, num_microbatches=4)
    bf = {w.name: w for w in layer_work(model, model.layers[0], cl, TrainingSpec(seq_len=32), par)}
    tr = TrainingSpec(seq_len=32, dtype=dtype)
    lp = {w.name: w for w in layer_work(model, model.layers[0], cl, tr, par)}
    speedup = 2.0 if dtype == "fp8_blockwise" else 4.0
    for name in ("attn_proj", "experts"):
        assert lp[name].time_s == pytest.approx(bf[name].time_s / speedup)
    for name in ("attn_core", "router", "elementwise"):
        assert lp[name].time_s == pytest.approx(bf[name].time_s)
    io = 32 * 2 * D + 32 * K * (2 * D + 3 * F)
    weights = 4 * D * D + (E / 2) * 3 * D * F
    cast_io, cast_w = CAST[dtype]
    assert lp["quantize"].time_s == pytest.approx((cast_io * io + cast_w * weights / 4) / 1e12)
    assert cast_time_s(cl, tr, 1e9, 0.0, 1) == pytest.approx(cast_io * 1e9 / 1e12)


def test_first_and_last_layers_kept_in_bf16_are_priced_in_bf16():
    """Megatron's --num-layers-at-start-in-bf16 1 --num-layers-at-end-in-bf16 2 of 6 layers."""
    cl, model = _cluster(), _model(6)
    par = ParallelConfig(pp=1, dp=2, ep=2, num_microbatches=4)
    tr = TrainingSpec(seq_len=32, dtype="nvfp4", bf16_layers_start=1, bf16_layers_end=2)
    dtypes = [layer_training(tr, i, 6).dtype for i in range(6)]
    assert dtypes == ["bf16", "nvfp4", "nvfp4", "nvfp4", "bf16", "bf16"]
    bf = layer_work(model, model.layers[0], cl, TrainingSpec(seq_len=32), par)
    kept = layer_work(model, model.layers[0], cl, layer_training(tr, 0, 6), par)
    fp4 = layer_work(model, model.layers[1], cl, layer_training(tr, 1, 6), par)
    assert [w.time_s for w in kept] == [w.time_s for w in bf]
    assert "quantize" in {w.name for w in fp4} and "quantize" not in {w.name for w in kept}
    assert layer_training(TrainingSpec(dtype="bf16"), 0, 6).dtype == "bf16"


# Training state per parameter (Megatron's 18 B accounting, one rank, no sharding): bf16
# weights 2 + fp32 grads 4 + master 4 (2 with the precision-aware optimizer's remainders,
# which FP4 recipes keep and FP8 recipes do not) + Adam 8, plus the quantized weight copies
# (row-wise + column-wise with scales): blockwise 2 x (1 + 4 / 128^2), nvfp4 2 x (0.5 + 1/16),
# mxfp4 2 x (0.5 + 1/32); fp8 and mxfp8 count none.
STATE = {
    "bf16": (18.0, 16.0),
    "fp8": (18.0, 18.0),
    "mxfp8": (18.0, 18.0),
    "fp8_blockwise": (20.00048828125, 20.00048828125),
    "nvfp4": (19.125, 17.125),
    "mxfp4": (19.0625, 17.0625),
}


@pytest.mark.parametrize("dtype", sorted(STATE))
def test_state_bytes_per_parameter_by_recipe(dtype):
    par = ParallelConfig(pp=1, dp=4)
    plain, aware = STATE[dtype]
    tr = TrainingSpec(dtype=dtype, bytes_per_param=18)
    assert state_bytes(1e6, 0.0, tr, par).total == pytest.approx(plain * 1e6)
    pao = replace(tr, precision_aware_optimizer=True)
    assert state_bytes(1e6, 0.0, pao, par).total == pytest.approx(aware * 1e6)
    # the distributed optimizer shards master + moments (12 B) over dp = 4, not the copies
    zero = state_bytes(1e6, 0.0, replace(tr, zero=True), par).total
    assert zero == pytest.approx((plain - 12.0 + 3.0) * 1e6)


def test_saved_gemm_inputs_in_each_recipes_bytes():
    """The attention context (o-proj input) and the routed copies (fc1 input) are saved at the
    column-wise copy's bytes; q / k / v and the router stay bf16."""
    model, par = _model(), ParallelConfig(pp=1, dp=2, ep=2)
    bf = dict(layer_activations(model, model.layers[0], TrainingSpec(seq_len=32), par).components)
    for dtype, per_elem in (("nvfp4", 0.5625), ("mxfp4", 0.53125), ("fp8_blockwise", 1.03125)):
        tr = TrainingSpec(seq_len=32, dtype=dtype)
        lp = dict(layer_activations(model, model.layers[0], tr, par).components)
        for name in ("context", "dispatch"):
            assert lp[name] == pytest.approx(bf[name] * per_elem / 2)
        assert (lp["qkv"], lp["router"]) == (bf["qkv"], bf["router"])


def test_a_cluster_without_the_formats_peak_refuses_it_in_one_line():
    h100, model = load_cluster("h100"), load_model("tiny-moe-deep")
    with pytest.raises(SpecError) as err:
        gemm_peak_tflops(h100, "nvfp4")
    assert "cluster h100" in str(err.value) and "nvfp4" in str(err.value)
    assert "\n" not in str(err.value)
    par = ParallelConfig(pp=1, dp=8, ep=8)
    with pytest.raises(SpecError, match="cluster h100: device.peak_tflops has no mxfp4"):
        estimate(model, h100, TrainingSpec(seq_len=128, global_batch=8, dtype="mxfp4"), par)
    assert gemm_peak_tflops(h100, "fp8_blockwise") == 1979  # the FP8 Tensor Core rate
    with pytest.raises(SpecError, match="cluster frontier: device.peak_tflops has no fp8 "):
        gemm_peak_tflops(load_cluster("frontier"), "fp8_blockwise")
    mi355x = load_cluster("mi355x")  # CDNA4: MXFP4, no NVFP4
    assert gemm_peak_tflops(mi355x, "mxfp4") == pytest.approx(10066.3)
    with pytest.raises(SpecError, match="cluster mi355x: device.peak_tflops has no nvfp4"):
        gemm_peak_tflops(mi355x, "nvfp4")


def test_bf16_layer_counts_are_checked():
    with pytest.raises(SpecError, match="bf16_layers_start"):
        TrainingSpec(dtype="nvfp4", bf16_layers_start=-1)
    with pytest.raises(SpecError, match="dtype is bf16"):
        TrainingSpec(dtype="bf16", bf16_layers_end=2)


def _knob_plan(dtype: str, start: int = 0, end: int = 0):
    plan = priced_for(knob_plan(dtype), "megatron")
    extra = {"bf16_layers_start": start, "bf16_layers_end": end}
    return replace(plan, training={**plan.training, **extra})


MEGATRON_FP4_FLAGS = {
    "--fp4-format": ("fp4", "str"),
    "--fp4-recipe": ("fp4_recipe", "str"),
    "--first-last-layers-bf16": ("first_last_layers_bf16", "true"),
    "--num-layers-at-start-in-bf16": ("num_layers_at_start_in_bf16", "int"),
    "--num-layers-at-end-in-bf16": ("num_layers_at_end_in_bf16", "int"),
}


def test_megatron_export_carries_the_fp4_and_blockwise_recipes(monkeypatch):
    pytest.importorskip("megatron.core")
    for flag, (dest, kind) in MEGATRON_FP4_FLAGS.items():  # Megatron-LM's argparse names
        monkeypatch.setitem(FLAGS, flag, (dest, kind))
    model = load_model("deepseek-v3")
    nv = megatron_args(_knob_plan("nvfp4", 1, 2), model)
    i = nv.args.index("--fp4-format")
    assert nv.args[i - 1 : i + 4] == ("--bf16", "--fp4-format", "e2m1", "--fp4-recipe", "nvfp4")
    assert "--fp8-format" not in nv.args and nv.min_version >= (0, 15)
    config = transformer_config(list(nv.args), monkeypatch)  # Megatron-Core's own checks
    assert (config.fp4, config.fp4_recipe, config.fp8) == ("e2m1", "nvfp4", None)
    assert config.first_last_layers_bf16
    assert (config.num_layers_at_start_in_bf16, config.num_layers_at_end_in_bf16) == (1, 2)
    block = megatron_args(_knob_plan("fp8_blockwise"), model)
    config = transformer_config(list(block.args), monkeypatch)
    assert (config.fp8, config.fp8_recipe) == ("e4m3", "blockwise")
    assert "--first-last-layers-bf16" not in block.args


def test_megatron_refuses_mxfp4_and_too_many_bf16_layers_in_one_line():
    model = load_model("deepseek-v3")
    with pytest.raises(SpecError) as err:
        megatron_args(_knob_plan("mxfp4"), model)
    assert "no MXFP4 recipe" in str(err.value) and "ROCm" in str(err.value)
    assert "\n" not in str(err.value)
    most = model.num_layers // knob_plan().parallel.pp
    with pytest.raises(SpecError, match=f"at most num_layers // pp = {most}"):
        megatron_args(_knob_plan("nvfp4", 0, most + 1), model)


@pytest.mark.parametrize("dtype", ["nvfp4", "mxfp4"])
def test_torchtitan_export_refuses_fp4_in_one_line(dtype):
    """torchtitan 0.3's NVFP4 converter swaps dense Linear layers only (the routed experts
    would train in bf16) and it has no MXFP4 converter."""
    plan = make_plan()
    plan = priced_for(replace(plan, training={**plan.training, "fsdp": True}), "torchtitan")
    export_plan(plan, "torchtitan")  # the same plan in bf16 exports
    plan = replace(plan, training={**plan.training, "dtype": dtype})
    with pytest.raises(SpecError) as err:
        export_plan(plan, "torchtitan")
    assert f"priced in {dtype}" in str(err.value) and "\n" not in str(err.value)
