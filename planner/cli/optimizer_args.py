"""The memory and precision flags `piper plan` and `piper estimate` price (Megatron-Core's; other
targets refuse them in planner.targets.check_training): optimizer offload to the host, the
precision-aware optimizer, the gradient buffer's dtype, the layers kept in bf16 under an fp8 or
fp4 dtype and fine-grained activation offloading, as TrainingSpec fields."""

from __future__ import annotations

import argparse

from planner.specs import ACTIVATION_OFFLOAD_MODULES, SpecError


def add_optimizer_state_arguments(p: argparse.ArgumentParser) -> None:
    """--optimizer-offload-fraction F, --precision-aware-optimizer, --grad-dtype,
    --activation-offload-modules M1,M2."""
    p.add_argument("--optimizer-offload-fraction", type=float, default=0.0, metavar="F",
                   help="share of the optimizer state (fp32 master + Adam moments) kept "
                   "and updated in host memory (--optimizer-cpu-offload); default 0")  # fmt: skip
    p.add_argument("--precision-aware-optimizer", action="store_true",
                   help="Megatron's --use-precision-aware-optimizer: bf16 parameters' master "
                   "weights as 2 B remainders")  # fmt: skip
    p.add_argument("--grad-dtype", choices=("fp32", "bf16"), default=None,
                   help="the gradient buffer (bf16: Megatron's --grad-reduce-in-bf16); "
                   "default: the target's accounting")  # fmt: skip
    p.add_argument("--bf16-layers", default="0,0", metavar="START,END",
                   help="under an fp8/fp4 --dtype, the first START and last END layers stay bf16 "
                   "(Megatron's --num-layers-at-start/end-in-bf16); default 0,0")  # fmt: skip
    p.add_argument("--activation-offload-modules", default="", metavar="LIST",
                   help="comma-separated modules whose inputs wait in host memory (Megatron's "
                   "--offload-modules): " + ",".join(ACTIVATION_OFFLOAD_MODULES))  # fmt: skip


def bf16_layers(text: str) -> tuple[int, int]:
    """`--bf16-layers START,END` as two counts; SpecError (one line) otherwise."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and len(p.strip()) < 6 for p in parts):
        raise SpecError(f"--bf16-layers {text!r}: give two layer counts, START,END (e.g. 1,1)")
    return int(parts[0]), int(parts[1])


def optimizer_state(args: argparse.Namespace) -> dict[str, object]:
    """The flags as TrainingSpec keyword arguments."""
    start, end = bf16_layers(args.bf16_layers)
    return {
        "bf16_layers_start": start,
        "bf16_layers_end": end,
        "optimizer_offload_fraction": args.optimizer_offload_fraction,
        "precision_aware_optimizer": args.precision_aware_optimizer,
        "grad_dtype": args.grad_dtype,
        "activation_offload_modules": args.activation_offload_modules,
    }
