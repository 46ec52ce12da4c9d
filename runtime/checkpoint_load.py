"""Resume: choose the checkpoint every rank can load as data, then load it.

Rank 0 walks the checkpoints of the folder newest first: one that fails its manifest
(planner/run/checkpoint_dir.py) or whose `.metadata` is not data Piper writes
(runtime/checkpoint_safety.py) is refused in one logged line, set aside as
`refused-step-N`, and the one before is tried; one of another model config, --data or
--seed ends the run in one line naming what differs (it is not damaged: the run is the
wrong one). Every rank then checks the keys it will ask for (tensor storage, its shape and
dtype); if any rank finds one that is not, the checkpoint is refused and set aside the
same way. Only then does DCP read it, through SafeReader.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
import torch.distributed as dist

from planner.run.checkpoint_dir import (
    check_record,
    model_of,
    newest_valid,
    read_state,
    set_aside,
)
from planner.run.spec import EMPTY, ExpertSlots
from planner.specs import SpecError
from runtime.checkpoint_safety import SafeReader, keys_problem, metadata_problem

log = logging.getLogger(__name__)


def _refuse(path: Path, why: str) -> None:
    log.warning(
        "checkpoint %s refused: %s; trying the one before; set aside as %s",
        path,
        why,
        set_aside(path),
    )


def candidate(directory: str, record: dict, spec) -> tuple | None:
    """Rank 0: ("ok", path, state) of the newest checkpoint whose manifest and metadata
    pass, ("stop", line) when it is of another run's model config, data or seed, or None."""
    while True:
        path, refused = newest_valid(directory)
        for line in refused:
            log.warning("%s", line)
        if path is None:
            return None
        why = metadata_problem(path)
        if why is not None:
            _refuse(path, why)
            continue
        state = read_state(path)
        try:
            if state.get("model") != model_of(spec):
                raise SpecError(
                    f"--resume: checkpoint {path} holds another model ({state.get('model')}); "
                    "resume with the plan, --scale and --data it was written with, or use "
                    "another --checkpoint-dir"
                )
            check_record(path, state, record)
        except SpecError as exc:
            return ("stop", str(exc))
        return ("ok", str(path), state)


def keys_refused(path: str, want: dict, rank: int) -> bool:
    """Every rank: whether any rank cannot fill its `want` from the checkpoint at `path`
    (rank 0 then refuses it and sets it aside); drops an RNG key the checkpoint lacks."""
    metadata = SafeReader(path).read_metadata()
    rng_key = f"rng.rank{rank}"
    if rng_key in want and rng_key not in metadata.state_dict_metadata:
        del want[rng_key]
    whys = [None] * dist.get_world_size()
    dist.all_gather_object(whys, keys_problem(metadata, want))
    why = next((w for w in whys if w is not None), None)
    if why is not None and rank == 0:
        _refuse(Path(path), why)
    return why is not None


def load_into(want: dict, path: str, rank: int) -> None:
    """Read `want` (checked by keys_refused) from the checkpoint at `path` in place."""
    import torch.distributed.checkpoint as dcp  # here: a run without checkpoints skips it

    dcp.load(want, storage_reader=SafeReader(path))
    rng_key = f"rng.rank{rank}"
    if rng_key in want:
        torch.set_rng_state(want[rng_key])


def install_slots(trainer, state: dict) -> None:
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


def fresh_adam_state(optimizer) -> None:
    """Zero Adam state for every parameter (what Adam itself creates at its first step)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            optimizer.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.get_default_dtype()),
                "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
            }
