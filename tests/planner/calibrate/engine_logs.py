"""Training logs written with the engines' own format strings (planner/calibrate/logs.py cites
the file and line of each): Megatron-LM's arguments block, iteration line and memory report,
torchtitan 0.3.0's device-mesh line and per-step line with its ANSI colours. The engines'
.format calls are kept as they are written there."""

# ruff: noqa: UP032

from __future__ import annotations

from collections.abc import Mapping, Sequence

MEGATRON_ARGS = {  # tiny_plan's layout under Megatron's argument names
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2,
    "virtual_pipeline_model_parallel_size": None, "context_parallel_size": 1,
    "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1,
    "data_parallel_size": 2, "world_size": 4, "micro_batch_size": 1, "global_batch_size": 8,
    "seq_length": 64, "log_interval": 1, "train_iters": 8,
}  # fmt: skip


def megatron_args_block(args: Mapping[str, object]) -> list[str]:
    """megatron/training/arguments.py `_print_args`, title "arguments"."""
    title = "arguments"
    out = [f"------------------------ {title} ------------------------"]
    str_list = []
    for arg, value in args.items():
        dots = "." * (48 - len(arg))
        str_list.append("  {} {} {}".format(arg, dots, value))
    out += sorted(str_list, key=lambda x: x.lower())
    out.append(f"-------------------- end of {title} ---------------------")
    return out


def megatron_iteration(
    iteration: int, train_iters: int, elapsed_s: float, tflops: float, batch_size: int,
    loss: float, nan_iters: int = 0,
) -> str:  # fmt: skip
    """megatron/training/training.py `training_log`'s log_string (GPT: the 'lm loss' key)."""
    log_string = " [2026-08-22 15:22:22.000000]"
    log_string += " iteration {:8d}/{:8d} |".format(iteration, train_iters)
    log_string += " consumed samples: {:12d} |".format(iteration * batch_size)
    log_string += " elapsed time per iteration (ms): {:.1f} |".format(elapsed_s * 1000.0)
    log_string += f" throughput per GPU (TFLOP/s/GPU): {tflops:.1f} |"
    log_string += f" learning rate: {3e-4:.6E} |"
    log_string += f" global batch size: {batch_size:5d} |"
    avg = loss
    if avg >= 0.0:
        log_string += " {}: {:.6E} |".format("lm loss", avg)
    log_string += f" loss scale: {1.0:.1f} |"
    log_string += f" grad norm: {1.234:.3f} |"
    log_string += " number of skipped iterations: {:3d} |".format(0)
    log_string += " number of nan iterations: {:3d} |".format(nan_iters)
    return log_string


def megatron_memory(rank: int, iteration: int, allocated_mb: float, max_mb: float) -> str:
    """megatron/training/utils/common_utils.py `report_memory` as rank 0 of its dp group."""
    string = f"(after {iteration} iterations)" + " memory (MB)"
    string += f" | allocated: {allocated_mb:.2f}"
    string += f" | max allocated: {max_mb:.2f}"
    string += f" | reserved: {max_mb + 100:.2f}"
    string += f" | max reserved: {max_mb + 100:.2f}"
    return "[Rank {}] {}".format(rank, string)


def megatron_log(
    elapsed_s: Sequence[float], args: Mapping[str, object] = MEGATRON_ARGS,
    max_mb: Sequence[float] = (1024.0, 1536.0), nan_at: int | None = None,
) -> str:  # fmt: skip
    """A whole log: arguments, one iteration line per elapsed time, memory after iteration 1
    and 2 (ranks 0 and 2, the two pipeline stages)."""
    lines = ["using world size: 4", *megatron_args_block(args)]
    total = len(elapsed_s)
    for i, t in enumerate(elapsed_s, start=1):
        lines.append(megatron_iteration(i, total, t, 12.5, int(str(args["global_batch_size"])),
                                        5.0 - 0.1 * i, 1 if nan_at == i else 0))  # fmt: skip
        if i <= 2:
            lines += [megatron_memory(r, i, mb * 0.8, mb * i / 2) for r, mb in
                      zip((0, 2), max_mb, strict=True)]  # fmt: skip
    return "\n".join(lines) + "\n"


class Color:
    """torchtitan/tools/utils.py `Color` (the codes the step line uses)."""

    red = "\033[31m"
    green = "\033[32m"
    blue = "\033[34m"
    magenta = "\033[35m"
    cyan = "\033[36m"
    reset = "\033[39m"
    orange = "\033[38;2;180;60;0m"
    turquoise = "\033[38;2;54;234;195m"


PREFIX = "[rank0]:[titan] 2026-09-03 03:51:00,000 - root - INFO - "


def titan_mesh(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=2) -> str:
    """torchtitan/distributed/parallel_dims.py's device-mesh line."""
    return PREFIX + (
        f"Building device mesh with parallelism: "
        f"pp={pp}, dp_replicate={dp_replicate}, dp_shard={dp_shard}, "
        f"cp={cp}, tp={tp}, ep={ep}"
    )


def titan_step(step: int, loss: float, max_reserved_gib: float, tps: float, tflops: float) -> str:
    """torchtitan/components/metrics.py `MetricsProcessor.log`'s console line."""
    color, grad_norm, mfu = Color, 0.5, 12.0
    max_reserved_pct = 100 * max_reserved_gib / 80
    mfu_str = f"{mfu:.2f}%" if mfu is not None else "N/A"
    return PREFIX + (
        f"{color.red}step: {step:2}  "
        f"{color.green}loss: {loss:8.5f}  "
        f"{color.orange}grad_norm: {grad_norm:7.4f}  "
        f"{color.turquoise}memory: {max_reserved_gib:5.2f}GiB"
        f"({max_reserved_pct:.2f}%)  "
        f"{color.blue}tps: {round(tps):,}  "
        f"{color.cyan}tflops: {tflops:,.2f}  "
        f"{color.magenta}mfu: {mfu_str}{color.reset}"
    )


def titan_log(tps: Sequence[float], memory_gib: Sequence[float], mesh: str | None = None) -> str:
    """A whole torchtitan log: the mesh line, then one step line per tps."""
    lines = [mesh or titan_mesh(), PREFIX + "Training starts at step 1"]
    for i, (t, m) in enumerate(zip(tps, memory_gib, strict=True), start=1):
        lines.append(titan_step(i, 8.0 - 0.1 * i, m, t, t * 1e-3))
    return "\n".join(lines) + "\n"
