"""Low-precision recipes: which GEMMs run in FP8 / MXFP8 and the casts they add.

Transformer Engine (`docs/features/low_precision_training/introduction/introduction.rst`)
runs only the linear layers' GEMMs in low precision (fprop, dgrad and wgrad of QKV, the
attention output projection, dense MLPs, routed and shared experts); core attention, norms,
softmax, the router and the output head stay in bf16 (Megatron-Core keeps the embedding,
output layer and router out of FP8). Low-precision GEMMs run at the device's
`peak_tflops[dtype]` from the cluster profile, the same efficiency curve as bf16; every
GEMM input is quantized first, a memory-bound pass:
- fp8 (per-tensor current scaling, Megatron's `--fp8-recipe tensorwise`): one amax read of
  the bf16 tensor, then one read that writes the row-wise copy and the transposed copy
  Hopper's wgrad needs: 2 + 2 + 1 + 1 = 6 B per element;
- mxfp8 (1 x 32 blocks, E8M0 scales, Blackwell): row-wise and column-wise copies quantized
  independently from bf16, each read 2 B and written 1 + 1/32 B (`performance_considerations.rst`).
Activations (X, and the output gradient dY of the same size as the output) are quantized
every micro-batch; weights once per optimizer step (TE caches them over the micro-batches
of a step, `is_first_microbatch`).
"""

from __future__ import annotations

from planner.specs import ClusterSpec, TrainingSpec

LOW_PRECISION = ("fp8", "mxfp8")
CAST_BYTES_PER_ELEMENT = {"fp8": 2.0 + 2.0 + 1.0 + 1.0, "mxfp8": 2 * (2.0 + 1.0 + 1.0 / 32)}


def linear_dtype(training: TrainingSpec) -> str:
    """The dtype of the linear layers' GEMMs: the training dtype."""
    return training.dtype


def compute_dtype(training: TrainingSpec) -> str:
    """The dtype of everything else (attention, router, head): bf16 under an FP8 recipe."""
    return "bf16" if training.dtype in LOW_PRECISION else training.dtype


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
    nbytes = per_elem * (io_elements + weight_params / num_microbatches)
    return nbytes / cluster.hbm_bytes_per_s
