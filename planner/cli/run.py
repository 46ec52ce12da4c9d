"""`piper run PLAN`: train a plan with the PyTorch runtime, launched through torchrun.

This module never imports torch or the runtime: it checks that torch is installed, validates
the plan (the plan's model and cluster files must be unchanged since planning unless --force;
then the RunSpec the runtime will build, planner.run.spec), then starts torchrun,
`torch.distributed.run --standalone --nproc-per-node N -m runtime.launch ...`
(RunOptions.to_launch_argv) through planner.run.options.run_torchrun, which dies with this
process, and summarizes metrics.jsonl when it is done. On many nodes, start
`python -m runtime.launch` with torchrun or srun directly.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from planner.calibrate.metrics import this_layout
from planner.outputs.console import progress
from planner.plan import Plan, load_plan
from planner.run.checkpoint_dir import (
    check_checkpointable,
    checkpoints,
    prepare_folder,
    resume_point,
)
from planner.run.migration import run_move_costs
from planner.run.options import RunOptions, add_run_arguments, check_torch, torchrun_command
from planner.run.spec import RunSpec, checked_spec
from planner.run.token_data import check_windows, open_token_file, spec_for_data
from planner.size.checkpoint_interval import interval_or_reason
from planner.specs import SpecError

log = logging.getLogger(__name__)


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="train a plan on this machine (torchrun; gloo on CPU, NCCL on GPUs)",
        description="Train PLAN (plan.json) with the PyTorch runtime. On a CPU machine each "
        "process emulates one device; --ranks-per-node declares the emulated node size.",
    )
    add_run_arguments(p)
    p.set_defaults(func=run)


def _canonical(obj: Any) -> str:
    """JSON of `obj` with its floats as plan.json stores them (9 significant digits), so a
    file read afresh compares equal to the copy a plan recorded."""
    from planner.plan.schema import round_floats

    return json.dumps(round_floats(obj), sort_keys=True, default=str)


def changed_inputs(plan: Plan) -> list[str]:
    """Inputs whose current file no longer matches what the plan recorded (inputs_sha256)."""
    from planner.inputs.clusters import cluster_to_dict, list_cluster_presets, load_cluster
    from planner.inputs.models import load_model, model_config

    changed = []
    source = plan.model.source
    name = source.removeprefix("preset:") if source.startswith("preset:") else source
    if name and plan.model.config:
        try:
            fresh = model_config(load_model(name))
        except SpecError:
            fresh = None
        if fresh is not None and _canonical(fresh) != _canonical(plan.model.config):
            changed.append(f"model '{name}'")
    csrc = plan.cluster.source
    cname = csrc if Path(csrc).is_file() else plan.cluster.name
    if cname and (Path(cname).is_file() or cname in list_cluster_presets()):
        fresh_c = cluster_to_dict(load_cluster(cname))
        recorded = plan.cluster.to_dict()
        diff = [
            k
            for k in fresh_c
            if k in recorded and _canonical(recorded[k]) != _canonical(fresh_c[k]) and k != "source"
        ]
        if diff:
            changed.append(f"cluster '{cname}' ({', '.join(diff)})")
    return changed


# Host memory of one runtime process besides its model's state: the torch import and gloo
# buffers; measured 0.35-0.38 GiB peak RSS per rank for tiny-moe on CPU at 2-8 ranks (its
# state is ~1 MB).
PROCESS_GIB = 0.38
LAUNCHER_GIB = 0.3  # torchrun's own process
MEMORY_SHARE = 0.9  # of MemAvailable the run may take; the rest stays for the machine
# Bytes per parameter a rank holds on CPU: fp32 weights (the master) 4, fp32 gradients 4,
# Adam's two fp32 moments 8, the bf16 copies a step computes with 2 (runtime/RUNTIME.md).
RUN_BYTES_PER_PARAM = 18


def _available_gib() -> float | None:
    """MemAvailable from /proc/meminfo in GiB (None where it cannot be read)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return None
    return None


def rank_state_gib(spec: RunSpec) -> list[float]:
    """Each pipeline rank's model state (GiB) in the run as launched (the scaled model):
    its layers' non-expert parameters (over tp, and over dp with FSDP) and its share of the
    routed experts (over ep x etp, and over the experts' data-parallel group with FSDP), the
    embedding on the first rank and the head on the last (one table when tied on one stage),
    at RUN_BYTES_PER_PARAM; spare expert slots are not counted."""
    from planner.parallel import ParallelConfig
    from planner.resources.memory import layer_param_split

    model = spec.model
    edp = max(spec.dp * spec.tp // (spec.ep * spec.etp), 1)  # the experts' data-parallel group
    par = ParallelConfig(
        spec.pp, spec.dp, spec.tp, spec.ep, spec.micro_batch, spec.num_microbatches,
        vp=spec.vp, etp=spec.etp,
    )  # fmt: skip
    vocab_rows = -(-model.vocab_size // spec.tp) * model.hidden_size
    out = []
    for stage, layers in enumerate(spec.stage_layers):
        dense = expert = 0.0
        for i in layers:
            d, e = layer_param_split(model, model.layers[i], par)
            dense, expert = dense + d, expert + e
        tied_whole = model.tie_word_embeddings and spec.pp == 1  # one table for both
        dense += vocab_rows * ((stage == 0) + (stage == spec.pp - 1) - tied_whole)
        if spec.fsdp:  # fully_shard over the data-parallel ranks, the experts over edp
            dense, expert = dense / spec.dp, expert / edp
        out.append(RUN_BYTES_PER_PARAM * (dense + expert) / 2**30)
    return out


def _check_memory(spec: RunSpec) -> None:
    """Refuse to start more processes on this machine than its memory holds: torchrun, then
    each process PROCESS_GIB plus its rank's model state (rank_state_gib), within
    MEMORY_SHARE of the memory available."""
    available = _available_gib()
    states = rank_state_gib(spec)
    per_stage = spec.world // spec.pp
    need = LAUNCHER_GIB + spec.world * PROCESS_GIB + per_stage * sum(states)
    if available is not None and need > MEMORY_SHARE * available:
        raise SpecError(
            f"{spec.world} processes need about {need:.1f} GiB on this machine "
            f"({PROCESS_GIB} GiB each for torch, plus up to {max(states):.2f} GiB of model "
            f"state) but {available:.1f} GiB is available (a run takes at most "
            f"{MEMORY_SHARE:.0%} of it); run them on several machines "
            "(torchrun or srun with python -m runtime.launch, see RUNTIME.md), plan for fewer "
            "GPUs, use a smaller --scale, or pass --force to try anyway"
        )


def _summary(out: Path, checkpoint: str | None = None) -> str:
    """One line on a finished run from its metrics.jsonl: steps, loss from first to last,
    median tokens/s, the last step's bytes, the migrations made (steps that moved experts),
    the expert copies and bytes they moved, and the checkpoint the run left."""
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    if not lines:
        return f"no steps recorded in {out}"
    first, last = lines[0], lines[-1]
    mine = this_layout(lines)  # without steps a resume carried over from another layout
    tps = sorted(x["tokens_per_s"] for x in mine)[len(mine) // 2]
    earlier = len(lines) - len(mine)
    other = (f" over this layout's {len(mine)} steps ({earlier} earlier ones ran on another "
             "layout)") if earlier else ""  # fmt: skip
    moved_per_step = [x.get("migrated_experts", 0) for x in lines]
    moved_bytes = sum(
        v for x in lines for k, v in x.get("bytes_by_kind", {}).items() if k.startswith("migrate_")
    )
    made = sum(1 for m in moved_per_step if m)
    saved = f"; checkpoint {checkpoint}" if checkpoint else ""
    return (
        f"{len(lines)} steps: loss {first['loss']:.3f} -> {last['loss']:.3f}; median "
        f"{tps:,.0f} tokens/s{other}; last step sent {last['bytes_intra_node']:,} B intra-node, "
        f"{last['bytes_inter_node']:,} B inter-node; {made} migrations "
        f"moved {sum(moved_per_step)} expert copies ({moved_bytes:,} B){saved}; "
        f"wrote {out}/metrics.jsonl, trace.csv"
    )


def _steps_done(metrics: Path) -> int:
    """Steps recorded so far in metrics.jsonl (one line per step; 0 before the first)."""
    try:
        return metrics.read_bytes().count(b"\n")
    except OSError:
        return 0


STOP_GRACE_S = 60.0  # torchrun's time to stop its processes after a forwarded SIGTERM


def _train(cmd: list[str], env: dict[str, str], out: Path, steps: int) -> tuple[int, bool]:
    """torchrun the run; on a terminal a progress bar follows metrics.jsonl. (exit code,
    stopped): a SIGTERM sent to `piper run` alone (a scheduler's, `kill PID`) is passed on to
    torchrun, which stops its processes; after STOP_GRACE_S it is killed (and its processes
    with it, planner.run.options.die_with_torchrun). After a Ctrl-C it waits for torchrun's
    stop (_let_stop), then raises the KeyboardInterrupt."""
    metrics = out / "metrics.jsonl"
    stop: list[float] = []

    def forward(signum: int, _frame: object) -> None:
        if not stop:
            stop.append(time.monotonic())
            proc.send_signal(signum)

    with progress("training steps", total=steps) as update:
        proc = subprocess.Popen(cmd, env=env)
        previous = signal.signal(signal.SIGTERM, forward)
        try:
            while True:
                try:
                    code = proc.wait(timeout=0.5)
                    break
                except subprocess.TimeoutExpired:
                    update(min(_steps_done(metrics), steps))
                    if stop and time.monotonic() - stop[0] > STOP_GRACE_S:
                        proc.kill()
        except KeyboardInterrupt:
            _let_stop(proc)
            raise
        finally:
            signal.signal(signal.SIGTERM, previous)
        update(min(_steps_done(metrics), steps))
    return code, bool(stop)


def _let_stop(proc: subprocess.Popen) -> None:
    """After a Ctrl-C (which reached torchrun too: the same process group), wait for torchrun
    to stop its processes; it dies with `piper run`, and they with it. Killed after
    STOP_GRACE_S or at a second Ctrl-C."""
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        proc.kill()
        proc.wait()


def _with_data(options: RunOptions, spec):
    """The run on --data's tokens (its vocabulary), after the file's checks."""
    try:
        data = open_token_file(options.data)
        check_windows(data, spec.dp, spec.seq_len)
        return spec_for_data(spec, data, options.scale)
    except SpecError as exc:
        raise SpecError(f"{options.plan}: {exc}") from None


def _check_checkpoints(options: RunOptions, spec) -> None:
    """The layout can be checkpointed; with --resume, a checkpoint to continue from (newer
    corrupt or partial ones are named on stderr, the launcher skips them as well)."""
    try:
        check_checkpointable(spec)
        for line in prepare_folder(options.checkpoint_dir, options.resume, options.force):
            print(f"piper run: {line}", file=sys.stderr)
        if options.resume:
            path, done, refused = resume_point(options.checkpoint_dir, spec, options.data)
            for line in refused:
                print(f"piper run: {line}", file=sys.stderr)
            print(f"piper run: resuming from {path} ({done} steps done)", flush=True)
    except SpecError as exc:
        raise SpecError(f"{options.plan}: {exc}") from None


def _checkpoint_every(options: RunOptions, plan: Plan) -> tuple[RunOptions, str]:
    """(the options with --checkpoint-every resolved, the line saying why): the given value,
    else the interval that minimises lost time for Piper's runtime (async saves) on the plan
    (planner.size.checkpoint_interval), or after the last step only (0) when the run is no
    longer than one interval or the plan gives none."""
    interval, why = interval_or_reason(plan, target="piper")
    if interval is None:
        return replace(options, checkpoint_every=0), f"checkpoint after the last step only: {why}"
    why = f"the interval that minimises lost time is {interval.steps} steps ({interval.inputs()})"
    if interval.steps < options.steps:
        every, head = interval.steps, f"checkpoint every {interval.steps} steps"
    else:
        every, head = 0, f"checkpoint after the last step only ({options.steps} steps)"
    return replace(options, checkpoint_every=every), (
        f"{head}: {why}; --checkpoint-every N overrides it"
    )


def _launch_cmd(options: RunOptions, world: int) -> list[str]:
    """torchrun (standalone, one machine) running runtime.launch with the run's options; it
    and its processes die with this process (planner.run.options.run_torchrun)."""
    torchrun = [*torchrun_command(os.getpid()), "--standalone"]
    if options.max_restarts:
        torchrun += ["--max-restarts", str(options.max_restarts)]
    return [*torchrun, "--nproc-per-node", str(world), *options.to_launch_argv()]


def run(args: argparse.Namespace) -> int:
    """Validate the plan, launch torchrun, print a summary; returns the exit code."""
    check_torch()
    options = RunOptions.from_args(args)
    plan = load_plan(options.plan)
    options.check()
    changed = changed_inputs(plan)
    if changed and not options.force:
        raise SpecError(
            f"{options.plan}: {' and '.join(changed)} changed since planning "
            "(inputs_sha256); re-run 'piper plan' or pass --force"
        )
    spec = checked_spec(options)
    if options.data:
        spec = _with_data(options, spec)
    if spec.migrate_every > 0:  # every rank prices its moves from the plan's cluster
        try:
            run_move_costs(load_plan(options.plan), spec, options.plan)
        except SpecError as exc:
            raise SpecError(f"{options.plan}: {exc}") from None
    if options.checkpoint_dir:
        _check_checkpoints(options, spec)
        if options.checkpoint_every is None:
            options, line = _checkpoint_every(options, plan)
            print(f"piper run: {line}", flush=True)
    if not options.force:
        _check_memory(spec)
    print(
        f"piper run: {spec.world} processes (pp={spec.pp} dp={spec.dp} "
        f"tp={spec.tp} ep={spec.ep} edp={spec.edp}, {spec.ranks_per_node} per node), "
        f"{spec.model.num_layers} layers d={spec.model.hidden_size} seq={spec.seq_len}, "
        f"{spec.tokens_per_step:,} tokens per step, {spec.dispatcher} dispatcher, "
        f"{options.compute_dtype(plan.training)} compute, numerics from {spec.arch_source}",
        flush=True,
    )
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    code, stopped = _train(_launch_cmd(options, spec.world), env, options.out_dir, options.steps)
    if stopped:
        again = " (continue with --resume)" if options.checkpoint_dir else ""
        print(
            f"piper run: stopped by SIGTERM after {_steps_done(options.out_dir / 'metrics.jsonl')} "
            f"steps; the processes were stopped{again}",
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM
    if code != 0:
        print(f"piper run: training failed (torchrun exit {code})", file=sys.stderr)
        return 1
    saved = checkpoints(options.checkpoint_dir) if options.checkpoint_dir else []
    print(f"piper run: {_summary(options.out_dir, str(saved[0]) if saved else None)}")
    return 0
