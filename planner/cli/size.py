"""`piper size`: how many GPUs, of which kind, for how long, at what cost, failures priced.

Plans every candidate size on every cluster (planner.size.sweep), then writes sizes.csv,
sizes.png and summary.md to --out (default results/size-MODEL-CLUSTERS/) and prints the
summary. planner/SIZING.md describes the figures, defaults and flags.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import sys

from planner.cli.estimate import DTYPES
from planner.cli.plan import check_out_dir
from planner.cli.target_args import add_target_arguments
from planner.size.request import (
    BATCH_RULES,
    CHECKPOINT_MODES,
    CRITICAL_BATCH_TOKENS,
    FAILURES_PER_GPU_HOUR,
    MIN_MFU,
    RESTART_S,
    STORAGE_GBPS,
    FailureModel,
    SizeRequest,
    parse_clusters,
    parse_duration_s,
    parse_gpus,
    parse_tokens,
)
from planner.specs import SpecError

LOG = logging.getLogger("piper.size")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "size",
        help="GPUs, days, GPU-hours, cost and energy per cluster size, failures priced",
        description="Plan the model at each size on each cluster and report tokens/s, days to "
        "the tokens, GPU-hours, cost and energy with intervals, the time lost to failures at "
        "the Young/Daly checkpoint interval, the Pareto set of days vs cost and the smallest "
        "size that meets --deadline. See planner/SIZING.md.",
    )
    p.add_argument("--model", required=True, help="preset name or config.json path")
    p.add_argument("--tokens", required=True, help="training tokens, e.g. 15T, 500B")
    p.add_argument("--cluster", default="h100", help="preset(s) or YAML, comma-separated")
    p.add_argument(
        "--gpus",
        default=None,
        help="LO..HI (powers of two) or a comma list "
        "(default: 8 powers of two from twice the GPUs that hold the state)",
    )
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument(
        "--global-batch",
        type=int,
        default=1024,
        help="sequences per step (at the smallest size under --batch-rule sqrt)",
    )
    p.add_argument(
        "--batch-rule",
        choices=BATCH_RULES,
        default="fixed",
        help="fixed: the batch at every size; sqrt: scaled with sqrt(GPUs) up to "
        "--critical-batch-tokens",
    )
    p.add_argument(
        "--critical-batch-tokens",
        type=parse_tokens_flag,
        default=CRITICAL_BATCH_TOKENS,
        help="the sqrt rule's cap (default 15,360 x 4,096: DeepSeek-V3's batch)",
    )
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    add_target_arguments(p)
    p.add_argument(
        "--price-per-gpu-hour",
        type=float,
        default=None,
        help="USD per GPU-hour for every cluster (default: a preset's public list "
        "price where one is on record, else no cost)",
    )
    p.add_argument("--deadline", default=None, help="wall-clock target, e.g. 60d, 12h")
    p.add_argument("--min-mfu", type=float, default=MIN_MFU, help="flag sizes below this MFU")
    p.add_argument(
        "--failures-per-gpu-hour",
        type=float,
        default=FAILURES_PER_GPU_HOUR,
        help="failure rate (default: Llama 3 405B's, 419 in 54 days on 16,384 GPUs)",
    )
    p.add_argument(
        "--restart-s",
        type=float,
        default=RESTART_S,
        help="relaunch time after a failure, s, before the reload",
    )
    p.add_argument(
        "--storage-gbps",
        type=float,
        default=STORAGE_GBPS,
        help="checkpoint storage bandwidth, GB/s aggregate (default: Llama 3's 2 TB/s)",
    )
    p.add_argument(
        "--checkpoint-mode",
        choices=CHECKPOINT_MODES,
        default=None,
        help="blocking or async saves (default: as the target saves)",
    )
    p.add_argument("--solver", choices=("cpsat", "cbc"), default="cpsat")
    p.add_argument("--time-limit-s", type=float, default=1.0, help="limit for each IP solve")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help="sizes planned at once, one process each (default: the CPUs this process may "
        "use); the files do not depend on it",
    )
    p.add_argument("--out", default=None, help="output dir (default results/size-MODEL-CLUSTERS)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    p.add_argument("--no-plots", dest="plots", action="store_false", help="write no sizes.png")
    p.set_defaults(func=run)


def parse_tokens_flag(text: str) -> float:
    """argparse type of --critical-batch-tokens: parse_tokens, errors as argparse's."""
    try:
        return parse_tokens(text, "--critical-batch-tokens")
    except SpecError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def request_of(args: argparse.Namespace) -> SizeRequest:
    """The SizeRequest of the flags; SpecError naming a flag out of its range."""
    positive = {
        "--seq-len": args.seq_len,
        "--global-batch": args.global_batch,
        "--storage-gbps": args.storage_gbps,
        "--time-limit-s": args.time_limit_s,
    }
    for flag, value in positive.items():
        if not value > 0:
            raise SpecError(f"{flag} {value}: must be positive; pass a number above 0")
    at_least_0 = {
        "--restart-s": args.restart_s,
        "--failures-per-gpu-hour": args.failures_per_gpu_hour,
        "--min-mfu": args.min_mfu,
    }
    for flag, value in at_least_0.items():
        if not (value >= 0 and math.isfinite(value)):
            raise SpecError(f"{flag} {value}: must be 0 or more; pass a number >= 0")
    price = args.price_per_gpu_hour
    if price is not None and not price > 0:
        raise SpecError(f"--price-per-gpu-hour {price}: must be positive; e.g. 2.5")
    failures = FailureModel(
        args.failures_per_gpu_hour, args.restart_s, args.storage_gbps, args.checkpoint_mode
    )
    return SizeRequest(
        model=args.model,
        clusters=parse_clusters(args.cluster),
        tokens=parse_tokens(args.tokens),
        gpus=None if args.gpus is None else parse_gpus(args.gpus),
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        batch_rule=args.batch_rule,
        critical_batch_tokens=args.critical_batch_tokens,
        dtype=args.dtype,
        target=args.target,
        memory_margin=args.memory_margin,
        price_usd=price,
        deadline_s=None if args.deadline is None else parse_duration_s(args.deadline),
        min_mfu=args.min_mfu,
        failures=failures,
        solver=args.solver,
        time_limit_s=args.time_limit_s,
        seed=args.seed,
    )


def run(args: argparse.Namespace) -> int:
    from planner.outputs.files import write_files
    from planner.size.report import size_csv, size_json, summary_text
    from planner.size.sweep import size_sweep

    request = request_of(args)  # every flag checked before the search
    out = args.out or "results/size-{}-{}".format(
        args.model.replace("/", "_"), "-".join(c.replace("/", "_") for c in request.clusters)
    )
    check_out_dir(out)
    jobs = len(os.sched_getaffinity(0)) if args.jobs is None else args.jobs
    if jobs < 1:
        raise SpecError(f"--jobs {jobs}: must be 1 or more; pass e.g. 2")
    report = size_sweep(request, progress=lambda text: LOG.info("planned %s", text), jobs=jobs)
    text = summary_text(report)
    files: dict[str, str | bytes] = {"sizes.csv": size_csv(report), "summary.md": text}
    if args.plots:
        from planner.size.plots import sizes_png

        files["sizes.png"] = sizes_png(report)
    write_files(out, files)
    if args.json:
        print(json.dumps({**size_json(report), "out": out}, indent=2, sort_keys=True))
    else:
        print(text, end="")
    print(f"piper size: wrote {out}/ ({', '.join(sorted(files))})", file=sys.stderr)
    return 0
