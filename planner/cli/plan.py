"""`piper plan`: search the best layout and placement, write plan.json, CSVs, summary and plots.

Defaults (planner/PLANNING.md): mixtral-8x7b on 64 GPUs of frontier, sequence 4096, global
batch 1024 sequences, CP-SAT, output in results/<model>-<cluster>-<gpus>/.
"""

from __future__ import annotations

import argparse
import atexit
import errno
import functools
import gc
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

from planner.cli.estimate import DTYPES
from planner.cli.optimizer_args import add_optimizer_state_arguments, optimizer_state
from planner.cli.plan_shortlist import (
    PlanInputs,
    add_shortlist_arguments,
    check_shortlist_folder,
    shortlist_count,
    shortlist_files,
    with_odds,
)
from planner.cli.plan_warnings import plan_warnings
from planner.cli.target_args import add_target_arguments, resolve
from planner.outputs.console import Phases, phases, print_table
from planner.parallel import RECOMPUTE_MODULES, budget_module
from planner.search.space import DISPATCHERS, sharding_choices
from planner.specs import CUDA_GRAPHS, ModelSpec, SpecError, TrainingSpec
from planner.targets import Target

DEFAULTS = {"model": "mixtral-8x7b", "cluster": "frontier", "gpus": 64}


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "plan",
        help="find the best parallel layout and placement (writes plan.json and reports)",
        description="Search (pp, dp, tp, cp, ep, etp, vp, micro-batch, recompute and its "
        "modules, optimizer sharding, the all-to-all overlap and the dispatcher), solve the "
        "stage, expert and rank integer programs, and write plan.json, candidates.csv, "
        "stages.csv, memory.csv, comm.csv, summary.md and plots. See planner/PLANNING.md.",
    )
    p.add_argument("--model", default=DEFAULTS["model"], help="preset name or config.json path")
    p.add_argument("--cluster", default=DEFAULTS["cluster"], help="preset name or cluster YAML")
    p.add_argument(
        "--gpus",
        type=int,
        default=None,
        help=f"devices to plan for (default: every GPU of --nodes or of a cluster YAML file, "
        f"else {DEFAULTS['gpus']})",
    )
    p.add_argument(
        "--nodes",
        type=int,
        default=None,
        help="resize the cluster to N nodes: its outermost level(s) scaled to N x GPUs per "
        "node (default: the profile's num_nodes)",
    )
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per sequence")
    p.add_argument("--global-batch", type=int, default=1024, help="sequences per step")
    sizes = {"vp": "interleaved chunks per pipeline rank", "cp": "context-parallel size",
             "etp": "expert tensor-parallel size"}  # fmt: skip
    for name in ("pp", "dp", "tp", "ep", "vp", "cp", "etp"):
        what = sizes.get(name, name)
        p.add_argument(f"--{name}", type=int, default=None, help=f"fix {what} (default: search)")
    p.add_argument("--micro-batch", type=int, default=None, help="fix the micro-batch size")
    p.add_argument(
        "--recompute",
        choices=("none", "selective", "full"),
        default=None,
        help="activation recompute policy (default: search none, full and selective module "
        "sets, chosen per layer)",
    )
    p.add_argument(
        "--recompute-modules",
        nargs="+",
        default=None,
        metavar="MODULE",
        help="fix the selective recompute modules, Megatron-Core's names, space- or "
        f"comma-separated: {', '.join(RECOMPUTE_MODULES)}",
    )
    p.add_argument("--memory-budget", type=float, default=None, metavar="B",
                   help="torchtitan's memory-budget AC at budget B in [0, 1] (steps of 0.05; "
                   "--target torchtitan)")  # fmt: skip
    p.add_argument("--max-ep", type=int, default=None, help="largest EP group allowed")
    p.add_argument(
        "--zero",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fix the distributed optimizer on (or off with --no-zero; default: search it "
        "against --fsdp)",
    )
    p.add_argument(
        "--fsdp",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fix FSDP (weights, gradients and optimizer sharded) on or off (default: "
        "searched without pipelining)",
    )
    p.add_argument(
        "--a2a-overlap",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="fix the 1F1B all-to-all overlap on or off (default: searched where Megatron-LM "
        "allows it)",
    )
    p.add_argument(
        "--cuda-graphs",
        choices=CUDA_GRAPHS,
        default=None,
        help="CUDA graphs: none, partial (static modules) or full; sets the per-layer host "
        "time priced (default: the cluster's cuda_graphs)",
    )
    p.add_argument(
        "--dispatcher",
        choices=DISPATCHERS,
        default=None,
        help="fix the MoE dispatcher priced (default: search flat, halo-dedup and, where "
        "the fabric runs it, deepep)",
    )
    p.add_argument(
        "--mtp-layers", type=int, default=None, help="MTP layers trained (default: the config's)"
    )
    p.add_argument(
        "--dtype",
        choices=DTYPES,
        default="bf16",
        help="fp8/mxfp8/fp8_blockwise/nvfp4/mxfp4: the linear GEMMs in low precision "
        "(planner/RESOURCE_MODEL.md, FP8 / FP4)",
    )
    p.add_argument(
        "--optimizer-dtype", choices=("fp32", "bf16"), default="fp32", help="Adam moments dtype"
    )
    add_optimizer_state_arguments(p)
    add_target_arguments(p)
    p.add_argument("--solver", choices=("cpsat", "cbc"), default="cpsat")
    p.add_argument("--time-limit-s", type=float, default=10.0, help="limit for each IP solve")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="candidates solved concurrently (at most 4: the batch size)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--allocation", default=None, help="node allocation file for the rank IP")
    p.add_argument("--trace", default=None, help="expert-load trace CSV for the expert IP")
    p.add_argument(
        "--redundant-slots",
        type=int,
        default=None,
        help="extra expert slots per MoE layer over the EP group for replicas of hot experts "
        "(default: E/8, at most one per EP rank, where memory allows, none with FSDP; 0 = "
        "none; N > 0 keeps FSDP off)",
    )
    p.add_argument("--out", default=None, help="output dir (default results/MODEL-CLUSTER-GPUS)")
    p.add_argument(
        "--score",
        choices=("dp", "ip"),
        default="dp",
        help="find candidates' splits with the exact DP (default; the winner is re-solved by "
        "the stage IP) or with the stage IP for every candidate (slower, same plan)",
    )
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument(
        "--no-plots",
        dest="plots",
        action="store_false",
        help="write no PNG plots (they take most of the time spent writing the files)",
    )
    add_shortlist_arguments(p)
    p.set_defaults(func=run, plan_parser=p)


def trace_loads(path: str, model: ModelSpec) -> dict[int, tuple[float, ...]]:
    """Tokens per expert summed over the trace's intervals, per transformer layer index."""
    from planner.migration.trace import load_trace

    trace = load_trace(path)
    moe = set(model.moe_layers)
    out = {}
    for j, layer in enumerate(trace.layer_ids):
        if layer not in moe:
            raise SpecError(
                f"{path}: layer {layer} is not an MoE layer of {model.name} (MoE layers: "
                f"{min(moe)}..{max(moe)}); was the trace recorded for another model?"
            )
        per_e = trace.tokens_ILE[:, j, :].sum(axis=0)
        experts = model.layers[layer].moe.num_experts  # type: ignore[union-attr]
        if len(per_e) != experts:
            raise SpecError(f"{path}: {len(per_e)} experts per layer, {model.name} has {experts}")
        out[layer] = tuple(float(x) for x in per_e)
    return out


def _inputs(args: argparse.Namespace) -> tuple[Any, Any, TrainingSpec, Target]:
    from planner.inputs.cluster_init import is_cluster_file
    from planner.inputs.clusters import check_dtype, load_cluster_nodes
    from planner.inputs.models import load_model

    model = load_model(args.model)
    cluster = load_cluster_nodes(args.cluster, args.nodes)
    if args.gpus is None:  # a cluster file describes the user's machine: plan all of it
        whole = args.nodes or is_cluster_file(args.cluster)
        args.gpus = cluster.total_gpus if whole else DEFAULTS["gpus"]
    check_dtype(cluster, args.dtype, args.cluster)
    target, margin = resolve(args, cluster)
    training = TrainingSpec(
        seq_len=args.seq_len,
        global_batch=args.global_batch,
        dtype=args.dtype,
        recompute=args.recompute or "none",
        mtp_layers=args.mtp_layers,
        optimizer_dtype=args.optimizer_dtype,
        cuda_graphs=args.cuda_graphs,
        memory_margin_gib=margin,
        **optimizer_state(args),
    )
    return model, cluster, training, target  # make_plan applies the target's conventions


def recompute_modules(values: list[str] | None, budget: float | None = None) -> list[str] | None:
    """`--recompute-modules a b` or `a,b` as one list, or `--memory-budget B` as its module
    (None when neither is given)."""
    if budget is not None:
        if values is not None:
            raise SpecError("--memory-budget and --recompute-modules: give one of them")
        return [budget_module(budget)]
    if values is None:
        return None
    return [m for v in values for m in v.split(",") if m]


def run(args: argparse.Namespace) -> int:
    from planner.outputs.export.stamp import stale_warning
    from planner.outputs.pick_lines import pick_lines
    from planner.outputs.reports import (
        BASELINE_CONSOLE_COLUMNS,
        baseline_console_rows,
        summary_dict,
        summary_text,
    )

    _freeze_heap_at_exit()
    if "," in args.cluster:  # several clusters side by side
        from planner.cli.plan_cross import run_cross

        return run_cross(args, _plan)
    with phases("piper plan") as clock:
        result, out = _plan(args, clock)
    if result is None:
        print(
            "piper plan: interrupted before any candidate was solved; nothing written",
            file=sys.stderr,
        )
        return 130
    if args.json:
        print(json.dumps({**summary_dict(result), "out": out}, indent=2, sort_keys=True))
    else:
        print(summary_text(result, out, args.plots))
        pick = result.best.estimate.tokens_per_s / result.gpus
        print("\n".join(pick_lines(result.plan.extra, pick)))
        print_table("vs baselines", BASELINE_CONSOLE_COLUMNS, baseline_console_rows(result))
    for line in plan_warnings(args, result.plan.cluster.gpus_per_node):
        print(f"piper plan: warning: {line}", file=sys.stderr)
    stale = stale_warning(out, result.plan)  # exports in --out made from another plan
    if stale:
        print(stale, file=sys.stderr)
    if result.interrupted:
        print("piper plan: interrupted; wrote the best plan found so far", file=sys.stderr)
    return 0


@functools.cache
def _freeze_heap_at_exit() -> None:
    """At exit, move every object to gc's permanent generation (gc.freeze) so the
    interpreter's last collections skip the search's millions of objects, which the OS
    frees anyway: they took 1.5 s after a 24-layer plan's files were written, outside every
    phase of timings.json."""
    atexit.register(gc.freeze)


def _plan(args: argparse.Namespace, clock: Phases) -> tuple[Any, str]:
    """Plan, place the redundant slots and write the files (with --shortlist, the trials'
    folder too), each phase timed by `clock` into timings.json; (None, "") when interrupted
    before any candidate was solved."""
    from planner.calibrate.error_bars import with_intervals
    from planner.outputs.files import write_files
    from planner.outputs.reports import render_files, timings_json

    ask = shortlist_count(args)  # before the search: a bad K writes nothing
    found = _search(args, clock)
    if found is None:
        return None, ""
    result, inputs = found
    out = out_dir(args, inputs.model, inputs.cluster)
    trials = {}
    if ask:
        size = ask.count or f"P(best) {ask.probability:g} of"
        clock.start("shortlist", f"shortlist: {size} trial layouts")
        result, odds = with_odds(result, inputs)  # the pick's P(best), published measurements
        result, trials = shortlist_files(args, result, inputs, ask, out, _search, odds)
    clock.start("render", "writing plan.json, tables and plots")
    if not ask:
        result, _ = with_odds(result, inputs)
    result = with_intervals(result, inputs.cluster)
    files = render_files(result, args.plots)
    result = replace(result, timings=command_timings(result.timings, clock.times()))
    files["timings.json"] = timings_json(result)
    write_files(out, files)
    if trials:
        write_files(f"{out}/shortlist", trials)
        written = sum(name.endswith("/plan.json") for name in trials)
        print(f"piper plan: wrote {out}/shortlist/ ({written} trials, shortlist.md): run "
              f"run_all.sh, then collect.sh", file=sys.stderr)  # fmt: skip
    return result, out


def _search(args: argparse.Namespace, clock: Phases) -> tuple[Any, PlanInputs] | None:
    """make_plan for the flags, with the redundant slots placed: (the PlanResult, its inputs);
    None when interrupted before any candidate was solved."""
    from planner.ip.solvers import SolverOptions
    from planner.search.advice import memory_floor_message
    from planner.search.assemble import (
        check_slots_without_fsdp,
        estimate_with_slots,
        with_redundant_slots,
    )
    from planner.search.make_plan import make_plan
    from planner.targets import with_conventions

    clock.start("inputs", "reading the model, cluster and inputs")
    model, cluster, training, target = _inputs(args)
    options = SolverOptions(args.solver, args.time_limit_s, args.threads, args.seed)
    allocation = None
    if args.allocation:
        from planner.inputs.allocation import load_allocation

        allocation = load_allocation(args.allocation)
        room = len(allocation) * cluster.gpus_per_node
        if args.gpus > room:
            raise SpecError(
                f"{args.allocation}: {len(allocation)} nodes hold {room} GPUs but --gpus is "
                f"{args.gpus}; lower --gpus or allocate more nodes"
            )
    loads = trace_loads(args.trace, model) if args.trace else None
    if not target.expert_placement:
        if args.redundant_slots:
            raise SpecError(
                f"--redundant-slots {args.redundant_slots}: {target.engine} loads experts in its "
                "own placement, with no replicas; drop it or use --target piper"
            )
        args.redundant_slots = 0
    check_slots_without_fsdp(args.redundant_slots, args.fsdp)
    fsdp = False if args.redundant_slots else args.fsdp  # slots keep FSDP out of the search
    fixed = {k: getattr(args, k) for k in ("pp", "dp", "tp", "ep", "vp", "cp", "etp")}
    fixed["micro_batch"] = args.micro_batch
    if args.gpus > 0:  # make_plan names a GPU count below 1
        floor = memory_floor_message(model, cluster, with_conventions(training, target), args.gpus)
        if floor:  # refused before the search: no layout can hold the model's state
            raise SpecError(floor)
    out = out_dir(args, model, cluster)  # a file in the way, a bad name: before the search
    check_out_dir(out)
    check_shortlist_folder(args, out)
    clock.start("search", "search: candidates solved")
    result = make_plan(
        model,
        cluster,
        training,
        args.gpus,
        fixed,
        options,
        allocation,
        loads,
        clock.update,
        recompute=[args.recompute] if args.recompute else None,
        recompute_modules=recompute_modules(args.recompute_modules, args.memory_budget),
        sharding=sharding_choices(args.zero, fsdp),
        a2a_overlap=args.a2a_overlap,
        dispatchers=[args.dispatcher] if args.dispatcher else None,
        max_ep=args.max_ep,
        score=args.score,
        target=target,
        label=clock.label,
    )
    if result.plan is None:
        if result.interrupted:
            return None
        raise SpecError(result.message)
    clock.start("redundant_slots", "redundant slots: expert IP with replicas")
    plan = with_redundant_slots(result.plan, model, loads, options, args.redundant_slots)
    best = result.best
    if best is not None and best.estimate is not None:
        best = replace(best, estimate=estimate_with_slots(best.estimate, result.plan, plan))
    result = replace(result, plan=plan, best=best)
    return result, PlanInputs(model, cluster, training, target)


def out_dir(args: argparse.Namespace, model: ModelSpec, cluster: Any) -> str:
    """--out, else results/MODEL-CLUSTER-GPUS."""
    return args.out or f"results/{model.name}-{cluster.name}-{args.gpus}"


def check_out_dir(out: str) -> None:
    """Refuse an --out folder that is a file or lies under one before the search runs (the
    files are written after it): NotADirectoryError naming the file, as writing would."""
    for path in (Path(out), *Path(out).parents):
        if path.exists():
            if not path.is_dir():
                raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(path))
            return


def command_timings(
    search: tuple[tuple[str, float], ...], phases_s: dict[str, float]
) -> tuple[tuple[str, float], ...]:
    """timings.json: make_plan's breakdown of the search (space_s, enumerate_s, screen_s,
    stage_search_s, baselines_s, placement_s, summing to search_s) and counts, with the
    command's phases (startup_s, inputs_s, search_s, redundant_slots_s, render_s) and
    total_s, their sum: the command's wall time up to writing the files."""
    out = {k: v for k, v in search if k != "total_s"}
    out.update({f"{name}_s": s for name, s in phases_s.items()})
    out["total_s"] = sum(phases_s.values())
    return tuple(sorted(out.items()))
