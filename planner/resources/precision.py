"""Low-precision recipes: which GEMMs run in FP8 / FP4, the casts they add, the bytes they keep.

Transformer Engine (`docs/features/low_precision_training/introduction/introduction.rst`)
runs only the linear layers' GEMMs in low precision (fprop, dgrad and wgrad of QKV, the
attention output projection, dense MLPs, routed and shared experts); core attention, norms,
softmax, the router and the output head stay in bf16 (Megatron-Core keeps the embedding,
output layer and router out of FP8 and FP4). Low-precision GEMMs run at the device's
`peak_tflops` for their format (`fp8` for both FP8 recipes, `mxfp8`, `nvfp4`, `mxfp4`; a
cluster without the key refuses the dtype), the same efficiency curve as bf16. Every GEMM
input is quantized first, a memory-bound pass (CAST_BYTES_PER_ELEMENT per activation and
output-gradient element, CAST_WEIGHT_BYTES_PER_ELEMENT per weight):
- fp8 (per-tensor current scaling, Megatron's `--fp8-recipe tensorwise`): one amax read of
  the bf16 tensor, then one read that writes the row-wise copy and the transposed copy
  Hopper's wgrad needs: 2 + 2 + 1 + 1 = 6 B per element;
- mxfp8 (1 x 32 blocks, E8M0 scales, Blackwell): row-wise and column-wise copies quantized
  independently from bf16, each read 2 B and written 1 + 1/32 B (`performance_considerations.rst`);
- fp8_blockwise (TE `Float8BlockScaling`, `transformer_engine/common/recipe/__init__.py`;
  Megatron's `--fp8-recipe blockwise`; DeepSeek-V3's 1 x 128 activation and 128 x 128 weight
  tiles): activations and gradients in 1 x 128 blocks with an fp32 scale each, the row-wise
  and column-wise copies quantized independently: 2 x (2 + 1 + 4/128) B; weights in
  128 x 128 blocks, whose transpose is exact: one read writing both copies, 2 + 2 x (1 + 4/128^2);
- nvfp4 (TE `NVFP4BlockScaling`, Megatron's `--fp4-format e2m1 --fp4-recipe nvfp4`): E2M1
  values (0.5 B) with an E4M3 scale per 16 and an fp32 scale per tensor, so an amax pass
  first; activations and gradients: 2 (amax, the random-Hadamard-transformed one fused) +
  row-wise 2 + 0.5 + 1/16 + column-wise (16 x 16 random Hadamard transform for wgrad;
  stochastic rounding on gradients) 2 + 0.5 + 1/16 = 7.125 B; weights with 16 x 16 2D scaling
  (transpose exact): 2 + 2 + 2 x (0.5 + 1/16) B;
- mxfp4 (E2M1 with an E8M0 scale per 32, no per-tensor scale; CDNA4's recipe, no Megatron-LM
  recipe): row-wise and column-wise copies from bf16, 2 x (2 + 0.5 + 1/32) B, weights alike.
All three GEMMs (fprop, dgrad, wgrad) run in the recipe's format in each (NVFP4BlockScaling
quantizes inputs, weights and output gradients; the NVFP4 paper, arXiv 2509.25149, runs
wgrad in NVFP4 with the Hadamard transform). Activations (X, and the output gradient dY of
the same size as the output) are quantized every micro-batch; weights once per optimizer step
(TE caches them over the micro-batches of a step, `is_first_microbatch`). The cached
quantized weights (row-wise + column-wise copies, QUANTIZED_WEIGHT_BYTES per parameter) are
held beside the bf16 weights for fp8_blockwise and the FP4 recipes.

Megatron's `--first-last-layers-bf16` keeps the first `--num-layers-at-start-in-bf16` and the
last `--num-layers-at-end-in-bf16` transformer layers in bf16 (`megatron/core/fp4_utils.py`
get_fp4_context, `fp8_utils.py` likewise): layer_training prices such a layer as bf16.
"""

from __future__ import annotations

from dataclasses import replace

from planner.specs import ClusterSpec, SpecError, TrainingSpec, peak_key

LOW_PRECISION = ("fp8", "mxfp8", "fp8_blockwise", "nvfp4", "mxfp4")
FP4 = ("nvfp4", "mxfp4")
_FP8_BLOCK_SCALE = 4.0 / 128  # an fp32 scale per 1 x 128 block, per element
_FP8_TILE_SCALE = 4.0 / 128**2  # an fp32 scale per 128 x 128 tile, per element
_NVFP4 = 0.5 + 1.0 / 16  # E2M1 + an E4M3 scale per 16
_MXFP4 = 0.5 + 1.0 / 32  # E2M1 + an E8M0 scale per 32
CAST_BYTES_PER_ELEMENT = {
    "fp8": 2.0 + 2.0 + 1.0 + 1.0,
    "mxfp8": 2 * (2.0 + 1.0 + 1.0 / 32),
    "fp8_blockwise": 2 * (2.0 + 1.0 + _FP8_BLOCK_SCALE),
    "nvfp4": 2.0 + 2 * (2.0 + _NVFP4),
    "mxfp4": 2 * (2.0 + _MXFP4),
}
CAST_WEIGHT_BYTES_PER_ELEMENT = {
    **CAST_BYTES_PER_ELEMENT,
    "fp8_blockwise": 2.0 + 2 * (1.0 + _FP8_TILE_SCALE),
    "nvfp4": 2.0 + 2.0 + 2 * _NVFP4,
}
# Quantized weight copies held beside the bf16 weights, per parameter: the row-wise (fprop)
# and column-wise (dgrad) copies with their scales (TE's Float8BlockwiseQTensor /
# NVFP4Tensor / MXFP4 storage). fp8 and mxfp8 leave them to the profile's framework overhead.
QUANTIZED_WEIGHT_BYTES = {
    "fp8_blockwise": 2 * (1.0 + _FP8_TILE_SCALE),
    "nvfp4": 2 * _NVFP4,
    "mxfp4": 2 * _MXFP4,
}


def linear_dtype(training: TrainingSpec) -> str:
    """The dtype of the linear layers' GEMMs: the training dtype."""
    return training.dtype


def compute_dtype(training: TrainingSpec) -> str:
    """The dtype of everything else (attention, router, head): bf16 under an FP8 / FP4 recipe."""
    return "bf16" if training.dtype in LOW_PRECISION else training.dtype


def gemm_peak_tflops(cluster: ClusterSpec, dtype: str) -> float:
    """The device's dense peak TFLOPS for `dtype`'s GEMMs; SpecError naming the cluster and
    the missing `peak_tflops` key."""
    key = peak_key(dtype)
    peaks = dict(cluster.device.peak_tflops)
    if key not in peaks:
        raise SpecError(
            f"cluster {cluster.name}: device.peak_tflops has no {key} entry, which {dtype} "
            f"training runs its GEMMs at; add {key}: <dense TFLOPS> or use --dtype bf16"
        )
    return peaks[key]


def layer_training(training: TrainingSpec, index: int, num_layers: int) -> TrainingSpec:
    """The training setup layer `index` of `num_layers` is priced with: bf16 for the first
    bf16_layers_start and the last bf16_layers_end layers under a low-precision dtype (Megatron's
    get_fp4_context / get_fp8_context: layer_no < start or layer_no >= num_layers - end),
    else `training` itself."""
    start, end = training.bf16_layers_start, training.bf16_layers_end
    if training.dtype not in LOW_PRECISION or start <= index < num_layers - end:
        return training
    return replace(training, dtype="bf16", bf16_layers_start=0, bf16_layers_end=0)


def cast_time_s(
    cluster: ClusterSpec,
    training: TrainingSpec,
    io_elements: float,
    weight_params: float,
    num_microbatches: int,
) -> float:
    """Seconds per micro-batch to quantize GEMM inputs: `io_elements` activation and output
    gradient elements, plus `weight_params` weights once per step of `num_microbatches`."""
    if training.dtype not in LOW_PRECISION:
        return 0.0
    per_elem = CAST_BYTES_PER_ELEMENT[training.dtype]
    weight_ratio = CAST_WEIGHT_BYTES_PER_ELEMENT[training.dtype] / per_elem
    nbytes = per_elem * (io_elements + weight_ratio * weight_params / num_microbatches)
    return nbytes / cluster.hbm_bytes_per_s
