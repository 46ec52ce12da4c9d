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

Save: after every `--checkpoint-every` steps and after the last, each rank copies its
tensors (its slices only) and hands them to `dcp.async_save` on a gloo group of its own (a
thread writes while training goes on; at most one save in flight, the next waits for it);
when it completes, rank 0 adds state.json and the manifest and renames the folder into place
(atomic).
Resume: rank 0 takes the newest intact checkpoint (a corrupt or partial one is refused in one
logged line and the one before is used) and broadcasts its state; every rank installs the
saved slot tables (same ep and slot counts) and asks DCP for the part of each key its own
parameters hold, which DCP reads from whichever saved slices overlap it. So any layout of
the same model reads the checkpoint: another pp / dp / ep or placement, tp 1 <-> 2, etp
1 <-> 2, FSDP on or off. Padding rows of a vocabulary-parallel slice are not saved and stay
zero. The data position is the step: batches are a function of (seed, step, dp rank).
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from planner.calibrate.metrics import EARLIER_LAYOUT
from planner.run.checkpoint_dir import (
    finish,
    layout_of,
    model_of,
    newest_valid,
    read_state,
    step_dir,
    tmp_dir,
)
from planner.run.spec import EMPTY, ExpertSlots, RunSpec
from runtime.parallel.mesh import Mesh
from runtime.weight_shards import pieces

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckpointOptions:
    """--checkpoint-dir, --checkpoint-every (0: after the last step only), --resume."""

    directory: str
    every: int = 0
    resume: bool = False


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


class Checkpointer:
    """Saves (async) and restores one rank's part of the run's checkpoints."""

    def __init__(self, options: CheckpointOptions, trainer) -> None:
        self.options, self.trainer = options, trainer
        self.group = dist.new_group(backend="gloo")  # the save thread's own collectives
        self.pending = None  # (future, tmp folder, final folder, state) of the save in flight
        self.saved: Path | None = None

    def after_step(self, step: int, lines: list, trace: dict) -> None:
        """Checkpoint after `step` when due (every N steps, and after the run's last)."""
        done, every = step + 1, self.options.every
        if done == self.trainer.spec.steps or (every > 0 and done % every == 0):
            self.save(done, lines, trace)

    def save(self, done: int, lines: list, trace: dict) -> None:
        """Start writing the checkpoint of `done` finished steps; returns once its tensors
        are copied."""
        self.wait()
        t = self.trainer
        root = Path(self.options.directory)
        tmp = tmp_dir(root, done)
        if t.rank == 0:  # a killed run's partial folder; the gather below waits for this
            shutil.rmtree(tmp, ignore_errors=True)
        parts = [None] * dist.get_world_size() if t.rank == 0 else None
        dist.gather_object(_rank_state(t, trace), parts, dst=0)
        tensors = state_tensors(t.module, t.optimizer, t.mesh, t.rank, copy=True)
        import torch.distributed.checkpoint as dcp  # here: a run without checkpoints skips it

        future = dcp.async_save(tensors, checkpoint_id=str(tmp), process_group=self.group)
        state = _assemble(done, t.spec, list(lines), parts) if t.rank == 0 else None
        self.pending = (future, tmp, step_dir(root, done), state)

    def wait(self) -> Path | None:
        """Finish the save in flight (rank 0 renames it into place); the newest saved."""
        if self.pending is None:
            return self.saved
        future, tmp, final, state = self.pending
        self.pending = None
        future.result()
        if state is not None:
            self.saved = finish(tmp, final, state)
        return self.saved

    def restore(self) -> tuple[int, list, dict]:
        """Load the newest intact checkpoint when resuming: (finished steps, metrics lines,
        trace) for rank 0's records; (0, [], {}) when there is none or not resuming."""
        if not self.options.resume:
            return 0, [], {}
        t = self.trainer
        box = [None]
        if t.rank == 0:
            path, refused = newest_valid(self.options.directory)
            for line in refused:
                log.warning("%s", line)
            box = [(str(path), read_state(path)) if path is not None else None]
        dist.broadcast_object_list(box, src=0)
        if box[0] is None:
            return 0, [], {}
        path, state = box[0]
        same = state["layout"] == layout_of(t.spec)
        _install_slots(t, state)
        _load(t, path, rng=same)
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


def _assemble(done: int, spec: RunSpec, lines: list, parts: list) -> dict:
    """state.json from rank 0's metrics lines and every rank's _rank_state."""
    leaders = [p for p in parts if "stage" in p]
    trace: dict = {}
    for p in parts:
        for *key, tokens in p["trace"]:
            trace[tuple(key)] = trace.get(tuple(key), 0) + tokens
    return {
        "step": done,
        "layout": layout_of(spec),
        "model": model_of(spec),
        "lines": lines,
        "trace": [[*k, v] for k, v in sorted(trace.items())],
        "stages": [{k: p[k] for k in ("stage", "history", "rows")} for p in leaders],
        "slots": {k: v for p in leaders for k, v in p["slots"].items()},
    }


def _install_slots(trainer, state: dict) -> None:
    """Put each MoE layer on its saved slot table where this layout can hold it (same ep,
    each rank its number of slots); free slots of the table are zeroed."""
    mesh = trainer.mesh
    ep = len(mesh.ep_ranks)
    to_plan = [mesh.ep_group_rank(i) for i in range(ep)]
    to_group = [mesh.ep_idx_of_group_rank(g) for g in range(ep)]
    for layer, moe in trainer.module.moe_layers().items():
        saved = state["slots"].get(str(layer))
        if saved is None:
            continue
        table = ExpertSlots(tuple(map(tuple, saved[0])), tuple(map(tuple, saved[1])))
        sizes = [len(r) for r in moe.slots.reorder(to_plan).slots_RS]
        if [len(r) for r in table.slots_RS] != sizes:
            continue  # another ep or slot count: the plan's placement, experts by id
        moe.set_slots(table.reorder(to_group))
        for slot, e in enumerate(moe.experts.expert_ids):
            if e == EMPTY:
                moe.experts.init_slot(slot, EMPTY)


def _fresh_adam_state(optimizer) -> None:
    """Zero Adam state for every parameter (what Adam itself creates at its first step)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.get_default_dtype()),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }


def _load(trainer, path: str, rng: bool) -> None:
    """Read this rank's tensors from the checkpoint at `path` into the live ones."""
    _fresh_adam_state(trainer.optimizer)
    t = trainer
    want = state_tensors(t.module, t.optimizer, t.mesh, t.rank if rng else None)
    import torch.distributed.checkpoint as dcp  # here: a run without checkpoints skips it

    saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    missing = sorted(k for k in want if k not in saved and not k.startswith("rng."))
    if missing:
        raise SystemExit(
            f"checkpoint {path} has no {missing[0]} ({len(missing)} missing): it is of another "
            "model; resume with that model's plan or use another --checkpoint-dir"
        )
    for k, v in want.items():
        size = getattr(saved.get(k), "size", None)
        if size is not None and tuple(size) != tuple(v.shape):
            raise SystemExit(
                f"checkpoint {path} holds {k} of shape {list(size)}, this run's is "
                f"{list(v.shape)}: it is of another model; resume with that model's plan or "
                "use another --checkpoint-dir"
            )
    rng_key = f"rng.rank{trainer.rank}"
    if rng_key in want and rng_key not in saved:
        del want[rng_key]
    dcp.load(want, checkpoint_id=path)
    if rng_key in want:
        torch.set_rng_state(want[rng_key])
