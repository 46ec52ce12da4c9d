"""Checkpoints and resume on torch.distributed.checkpoint (DCP).

What a checkpoint holds, keyed so that it does not depend on the plan that wrote it:
- `model.<key>`: every weight, named by the run model's layer (`layers.3.attn.q.weight`,
  `embed.weight`, `head.weight`), a routed expert by layer and expert id
  (`layers.3.experts.5.w_in`), whichever rank and slot holds it; `optim.{exp_avg,
  exp_avg_sq,step}.<key>`: its Adam state; `buffers.layers.3.router.bias_E`: the
  aux-loss-free selection bias; `rng.rank<r>`: each process's torch RNG state.
  Every key is the whole weight's shape. A rank that holds a slice of it (a TP or expert-TP
  slice, an FSDP chunk, an FSDP chunk of a TP slice) writes only its slice, as a DTensor
  that tells DCP where the slice sits in the whole (runtime/weight_shards.py); nothing is
  gathered. Replicated tensors and slices (dense weights over data-parallel ranks, an expert
  over its expert-DP replicas and copies) have one key and offset, so DCP writes them once.
- `state.json` (rank 0, planner/run/checkpoint_dir.py): finished steps, the layout and model
  it came from, the live slot table of every MoE layer, each stage's migration history (the
  leader's interval rows and the window of per-step counts), metrics.jsonl's lines and the
  trace rows so far.

The folder: rank 0 holds its lock for the run's life; a fresh run refuses one holding another
run's checkpoints unless --force, and any folder holding a symbolic link
(planner/run/checkpoint_dir.py).
Save: after every `--checkpoint-every` steps and after the last, each rank copies its
tensors (its slices only) and hands them to `dcp.async_save` on a gloo group of its own (a
thread writes while training goes on; at most one save in flight, the next waits for it).
Each step polls it: once written, rank 0 adds state.json and the manifest and renames the
folder into place (atomic), so a run killed after that step finds it. A save that fails
(a full disk) is one logged line naming the folder, the step and the cause; its partial
folder is removed and training goes on.
Resume: rank 0 takes the newest checkpoint that passes its manifest and whose `.metadata`
is data (runtime/checkpoint_load.py, runtime/checkpoint_safety.py) and broadcasts its state;
every rank installs the saved slot tables (same ep and slot counts) and asks DCP for the
part of each key its own parameters hold, which DCP reads from whichever saved slices
overlap it. So any layout of
the same model reads the checkpoint: another pp / dp / ep or placement, tp 1 <-> 2, etp
1 <-> 2, FSDP on or off. Padding rows of a vocabulary-parallel slice are not saved and stay
zero. The data position is the step: batches are a function of (seed, step, dp rank).
"""

from __future__ import annotations

import errno
import logging
import os
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from planner.calibrate.metrics import EARLIER_LAYOUT
from planner.run.checkpoint_dir import (
    check_folder,
    finish,
    layout_of,
    lock_folder,
    model_of,
    remove_inside,
    run_record,
    step_dir,
    tmp_dir,
    write_identity,
)
from planner.run.spec import RunSpec
from planner.specs import SpecError
from runtime.parallel.mesh import Mesh
from runtime.weight_shards import pieces

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointOptions:
    """--checkpoint-dir, --checkpoint-every (0: after the last step only), --resume;
    `force`: a fresh run may set aside another run's checkpoints in the folder; `data`:
    --data, recorded in the checkpoints and checked on resume."""

    directory: str
    every: int = 0
    resume: bool = False
    force: bool = False
    data: str | None = None


@dataclass(frozen=True)
class _Save:
    """A save in flight: DCP's future, its folders, and (rank 0) the state.json to add."""

    future: object
    done: int
    tmp: Path
    final: Path
    state: dict | None


def state_tensors(module, optimizer, mesh: Mesh, rank: int | None, copy: bool = False) -> dict:
    """This rank's checkpoint tensors (rank None: no RNG state): views of the live ones, or
    with `copy` copies of them; a slice of a weight as a DTensor of the whole weight's shape
    (runtime/weight_shards.py)."""

    def kept(t: torch.Tensor) -> torch.Tensor:
        return t.clone() if copy else t

    out = {}
    for piece in pieces(module, mesh):
        out[f"model.{piece.key}"] = piece.saved(kept(piece.local(piece.param)))
        state = optimizer.state.get(piece.param, {})
        for name in ("exp_avg", "exp_avg_sq"):
            if name in state:
                out[f"optim.{name}.{piece.key}"] = piece.saved(kept(piece.local(state[name])))
        if "step" in state:
            out[f"optim.step.{piece.key}"] = kept(state["step"])
    for layer, moe in module.moe_layers().items():
        out[f"buffers.layers.{layer}.router.bias_E"] = kept(moe.router.bias_E)
    if rank is not None:
        out[f"rng.rank{rank}"] = torch.get_rng_state()
    return out


def _rank_state(trainer, trace: dict) -> dict:
    """What this rank adds to state.json: its trace rows so far; a stage leader also its
    stage's migration history and slot tables (plan EP order)."""
    out = {"trace": [[*k, v] for k, v in trace.items()]}
    if not trainer.leader:
        return out
    mesh = trainer.mesh
    to_plan = [mesh.ep_group_rank(i) for i in range(len(mesh.ep_ranks))]
    slots = {}
    for layer, moe in trainer.module.moe_layers().items():
        table = moe.slots.reorder(to_plan)
        slots[str(layer)] = [[list(r) for r in table.slots_RS], [list(r) for r in table.share_RS]]
    rows = [r.tolist() for r in trainer.rows]
    return {**out, "stage": mesh.me.stage, "history": trainer.history, "rows": rows, "slots": slots}


def _agree(line: str | None, rank: int) -> None:
    """Every rank: stop the run (exit 2) when rank 0 found `line`, logged once by rank 0."""
    box = [line]
    dist.broadcast_object_list(box, src=0)
    if box[0] is not None:
        if rank == 0:
            log.error("%s", box[0])
        raise SystemExit(2)


def failure_cause(exc: BaseException, directory: Path) -> str:
    """What made a save fail, as a reason: the OSError in the exception, DCP's per-rank
    failures or their causes ("No space left on device"); else, since torch's writer reports
    a full disk as a bare RuntimeError, ENOSPC found by writing a probe into the folder;
    else the exception's first line."""
    todo, seen = [exc], []
    while todo:
        e = todo.pop()
        if e is None or any(e is s for s in seen):
            continue
        seen.append(e)
        if isinstance(e, OSError) and e.strerror:
            return e.strerror
        failures = getattr(e, "failures", None) or {}
        todo += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
        todo += [e.__cause__, e.__context__]
    probe = directory / ".space-probe"
    try:
        with open(probe, "wb") as f:
            f.write(b"\0" * (1 << 20))
            os.fsync(f.fileno())
    except OSError as err:
        if err.errno == errno.ENOSPC:
            return os.strerror(errno.ENOSPC)
    finally:
        probe.unlink(missing_ok=True)
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]


class Checkpointer:
    """Saves (async) and restores one rank's part of the run's checkpoints; rank 0 holds
    the folder's lock from here to `close`."""

    def __init__(self, options: CheckpointOptions, trainer) -> None:
        self.options, self.trainer = options, trainer
        self.root = Path(options.directory)
        self.group = dist.new_group(backend="gloo")  # the save thread's own collectives
        self.pending: _Save | None = None
        self.saved: Path | None = None
        self.lock_fd: int | None = None
        self.record = run_record(trainer.spec, options.data, uuid.uuid4().hex)
        self.identity_written = False
        _agree(self._open_folder() if trainer.rank == 0 else None, trainer.rank)

    def _open_folder(self) -> str | None:
        """Rank 0: lock the folder, check it (check_folder); a refusal line or None."""
        try:
            self.lock_fd = lock_folder(self.root)
            for line in check_folder(self.root, self.options.resume, self.options.force):
                log.warning("%s", line)
        except SpecError as exc:
            return str(exc)
        except OSError as exc:
            return f"--checkpoint-dir {self.root}: {exc.strerror}; use another folder"
        return None

    def close(self) -> Path | None:
        """Finish the save in flight and let go of the folder; the newest checkpoint saved."""
        saved = self.wait()
        if self.lock_fd is not None:
            os.close(self.lock_fd)
            self.lock_fd = None
        return saved

    def after_step(self, step: int, lines: list, trace: dict) -> None:
        """Finalise a save whose write completed; checkpoint after `step` when due (every
        N steps, and after the run's last)."""
        self.poll()
        done, every = step + 1, self.options.every
        if done == self.trainer.spec.steps or (every > 0 and done % every == 0):
            self.save(done, lines, trace)

    def poll(self) -> None:
        """Finalise the save in flight if its write has completed (never waits)."""
        if self.pending is not None and self.pending.future.done():
            self._complete()

    def save(self, done: int, lines: list, trace: dict) -> None:
        """Start writing the checkpoint of `done` finished steps; returns once its tensors
        are copied. A folder that cannot be prepared fails the save (one line)."""
        self.wait()
        t = self.trainer
        tmp = tmp_dir(self.root, done)
        box = [self._prepare(tmp) if t.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is not None:
            self._failed(done, tmp, box[0])
            return
        parts = [None] * dist.get_world_size() if t.rank == 0 else None
        dist.gather_object(_rank_state(t, trace), parts, dst=0)
        tensors = state_tensors(t.module, t.optimizer, t.mesh, t.rank, copy=True)
        import torch.distributed.checkpoint as dcp  # here: a run without checkpoints skips it

        future = dcp.async_save(tensors, checkpoint_id=str(tmp), process_group=self.group)
        state = _assemble(done, t.spec, list(lines), parts, self.record) if t.rank == 0 else None
        self.pending = _Save(future, done, tmp, step_dir(self.root, done), state)

    def _prepare(self, tmp: Path) -> OSError | None:
        """Rank 0: a fresh, empty `tmp` inside the folder (a killed run's partial one is
        removed) and, at the first save, run-identity.json; the error when that fails."""
        try:
            if tmp.exists() or tmp.is_symlink():
                remove_inside(self.root, tmp)
            tmp.mkdir(parents=True)
            if not self.identity_written:
                write_identity(self.root, self.record)
                self.identity_written = True
        except OSError as exc:
            return exc
        return None

    def wait(self) -> Path | None:
        """Finish the save in flight (rank 0 renames it into place); the newest saved."""
        if self.pending is not None:
            self._complete()
        return self.saved

    def _complete(self) -> None:
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

        save, self.pending = self.pending, None
        try:
            save.future.result()
            if save.state is not None:
                self.saved = finish(save.tmp, save.final, save.state)
        except (Exception, CheckpointException) as exc:  # the write's or the rename's
            self._failed(save.done, save.tmp, exc)

    def _failed(self, done: int, tmp: Path, exc: BaseException) -> None:
        """One line (rank 0) on a save that failed; its partial folder is removed."""
        if self.trainer.rank != 0:
            return
        cause = failure_cause(exc, self.root)
        try:
            remove_inside(self.root, tmp)
        except (OSError, ValueError):
            pass  # nothing to remove, or it cannot be: the next run's save replaces it
        newest = self.saved or "none"
        log.error(
            "checkpoint save to %s failed at step %d: %s; training goes on (newest checkpoint: %s)",
            self.root,
            done,
            cause,
            newest,
        )

    def restore(self) -> tuple[int, list, dict]:
        """Load the newest checkpoint that is intact and data when resuming: (finished
        steps, metrics lines, trace) for rank 0's records; (0, [], {}) when there is none
        or not resuming."""
        if not self.options.resume:
            return 0, [], {}
        # here: a run without checkpoints does not import torch.distributed.checkpoint
        from runtime.checkpoint_load import (
            candidate,
            fresh_adam_state,
            install_slots,
            keys_refused,
            load_into,
        )

        t = self.trainer
        touched = False  # slot tables installed from a checkpoint later refused
        while True:
            box = [candidate(str(self.root), self.record, t.spec) if t.rank == 0 else None]
            dist.broadcast_object_list(box, src=0)
            if box[0] is None and touched:
                _agree(f"--resume: no checkpoint left in {self.root} to load", t.rank)
            if box[0] is None:
                return 0, [], {}
            if box[0][0] == "stop":
                _agree(box[0][1], t.rank)
            _, path, state = box[0]
            same = state["layout"] == layout_of(t.spec)
            install_slots(t, state)
            touched = True
            fresh_adam_state(t.optimizer)
            want = state_tensors(t.module, t.optimizer, t.mesh, t.rank if same else None)
            if not keys_refused(path, want, t.rank):
                break
        load_into(want, path, t.rank)
        self.record = {**self.record, "run_id": state["run"]["run_id"]}
        return self._restored(path, state, same)

    def _restored(self, path: str, state: dict, same: bool) -> tuple[int, list, dict]:
        """The loaded checkpoint's migration history, metrics lines and trace rows."""
        t = self.trainer
        if same:
            stage = next((s for s in state["stages"] if s["stage"] == t.mesh.me.stage), None)
            if stage is not None:
                t.history = stage["history"]
                t.rows = [np.asarray(r, dtype=np.int64) for r in stage["rows"]] if t.leader else []
        if t.rank == 0:
            log.warning("resumed from %s after step %d", path, state["step"] - 1)
        trace = {tuple(r[:3]): r[3] for r in state["trace"]} if t.rank == 0 else {}
        lines = state["lines"] if t.rank == 0 else []
        if not same:  # they measured the checkpoint's layout: marked so calibration skips them
            lines = [{**line, EARLIER_LAYOUT: True} for line in lines]
        return state["step"], lines, trace


def _assemble(done: int, spec: RunSpec, lines: list, parts: list, record: dict) -> dict:
    """state.json from rank 0's metrics lines, every rank's _rank_state and the run's
    record (run_record)."""
    leaders = [p for p in parts if "stage" in p]
    trace: dict = {}
    for p in parts:
        for *key, tokens in p["trace"]:
            trace[tuple(key)] = trace.get(tuple(key), 0) + tokens
    return {
        "step": done,
        "layout": layout_of(spec),
        "model": model_of(spec),
        "run": record,
        "lines": lines,
        "trace": [[*k, v] for k, v in sorted(trace.items())],
        "stages": [{k: p[k] for k in ("stage", "history", "rows")} for p in leaders],
        "slots": {k: v for p in leaders for k, v in p["slots"].items()},
    }
