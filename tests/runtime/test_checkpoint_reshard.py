"""Checkpoints of layouts that split weights (tp, etp, FSDP): each rank saves its slices as
DTensors of the whole weights (runtime/weight_shards.py), so a run resumes bitwise on its
own layout and another layout of the same model loads the same checkpoint.

Oracles: the uninterrupted run (losses, bitwise); the writing run's own weights, which each
loading rank's slices must equal exactly (the slice of the whole at the rank's tp_idx /
etp_idx, tests/runtime/parallel/grads.py); the writing layout's losses for the steps after
the checkpoint (to 1e-5: the same weights and Adam state, gradients summed in another
order).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace

import pytest

from planner.run.spec import run_spec_from_plan
from planner.specs import SpecError
from runtime.checkpoint import Checkpointer, CheckpointOptions
from runtime.launch import build_trainer  # imported here, not in each forked rank: fast
from runtime.train import train
from tests.runtime.parallel.grads import assert_match_oracle, named_tensors
from tests.runtime.tiny_plans import hand_plan, tiny_model

pytestmark = pytest.mark.usefixtures("corpus")  # forked ranks inherit the loaded corpus

STEPS = 4  # straight; the checkpoint is taken after STEPS // 2

# name -> (dp, tp, ep, etp, fsdp, vocabulary): every layout keeps its own dp (the data is
# sharded by it)
LAYOUTS = {
    "tp1": (1, 1, 1, 1, False, 256),
    "tp2": (1, 2, 2, 1, False, 256),  # the EP group folds over the TP pair
    "etp1": (2, 1, 2, 1, False, 256),
    "etp2": (2, 1, 1, 2, False, 256),
    "fsdp": (2, 1, 1, 1, True, 256),  # experts chunked over the expert-DP pair by slot
    "fsdp_tp2": (2, 2, 1, 1, True, 256),  # dense weights: FSDP chunks of TP slices (2-D mesh)
    "tp1_v257": (1, 1, 1, 1, False, 257),
    "tp2_v257": (1, 2, 2, 1, False, 257),  # vocabulary slices of 129 and 128 + 1 padding row
}


def _spec(layout: str, steps: int = STEPS):
    dp, tp, ep, etp, fsdp, vocab = LAYOUTS[layout]
    model = replace(tiny_model(layers=3), vocab_size=vocab)  # the byte data uses ids < 256
    plan = hand_plan(model, 1, dp, ep, micro_batch=2, num_microbatches=2, seq_len=32,
                     gpus_per_node=dp * tp, tp=tp, etp=etp, fsdp=fsdp)  # fmt: skip
    return run_spec_from_plan(plan, model, 1.0, dp * tp, steps=steps)


def _losses(files) -> list[float]:
    return [json.loads(x)["loss"] for x in files["metrics.jsonl"].splitlines()]


def _train_body(rank, world, spec, options):
    """Train (checkpointing with `options`); losses, rank 0's metrics lines and the final
    weights by whole-model name with (tp_idx, etp_idx)."""
    trainer = build_trainer(spec, rank)
    r = train(trainer, checkpoints=CheckpointOptions(*options) if options else None)
    coord = (trainer.mesh.me.tp_idx, trainer.mesh.me.etp_idx)
    return r.losses, r.files, (coord, named_tensors(trainer.module, weights=True))


def _load_body(rank, world, spec, directory):
    """Restore the newest checkpoint in `directory`, take the weights, run the steps left."""
    trainer = build_trainer(spec, rank)
    start, _, _ = Checkpointer(CheckpointOptions(directory, 0, True), trainer).restore()
    coord = (trainer.mesh.me.tp_idx, trainer.mesh.me.etp_idx)
    weights = (coord, named_tensors(trainer.module, weights=True))
    losses = [trainer.step(step)[0] for step in range(start, spec.steps)]
    return start, weights, losses


_written: dict = {}


def _written_by(layout: str, root):
    """(straight run, run of STEPS // 2 that saved its checkpoint under root / layout),
    each a list over ranks of _train_body's values; run once per layout."""
    from tests.runtime.conftest import run_distributed

    if layout not in _written:
        spec = _spec(layout)
        directory = str(root / layout)
        straight = run_distributed(_train_body, spec.world, spec, None, timeout_s=120)
        half = _spec(layout, STEPS // 2)
        part = run_distributed(_train_body, spec.world, half, (directory, 0, False),
                               timeout_s=120)  # fmt: skip
        _written[layout] = (straight, part, directory)
    return _written[layout]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("reshard")


@pytest.mark.parametrize("layout", ["tp2", "etp2", "fsdp"])
def test_a_split_layout_resumes_bitwise_like_the_straight_run(root, layout):
    """STEPS // 2 steps, then a resume to STEPS: the losses of STEPS straight, bitwise."""
    from tests.runtime.conftest import run_distributed

    straight, _, directory = _written_by(layout, root)
    copy = root / f"{layout}-resumed"  # the resumed run adds its own checkpoint
    shutil.copytree(directory, copy)
    spec = _spec(layout)
    resumed = run_distributed(_train_body, spec.world, spec, (str(copy), 0, True),
                              timeout_s=120)  # fmt: skip
    assert len(resumed[0][0]) == STEPS - STEPS // 2  # only the steps after the checkpoint
    assert _losses(resumed[0][1]) == _losses(straight[0][1])  # bitwise, every line
    for a, b in zip(straight, resumed, strict=True):  # every rank's final weights, bitwise
        assert a[2][1].keys() == b[2][1].keys()
        assert all((a[2][1][k] == b[2][1][k]).all() for k in a[2][1]), layout


def _whole(results) -> dict:
    """Whole weights by name from the ranks of a layout without TP slices."""
    out: dict = {}
    for _, named in results:
        out.update(named)
    return out


@pytest.mark.parametrize(
    ("writer", "reader", "whole_side", "tp", "etp"),
    [
        ("tp1", "tp2", "writer", 2, 1),
        ("tp2", "tp1", "reader", 2, 1),
        ("etp2", "etp1", "reader", 1, 2),
        ("fsdp", "etp1", "reader", 1, 1),  # FSDP -> whole weights, experts spread by EP
        ("fsdp", "fsdp_tp2", "writer", 2, 1),  # FSDP chunks -> FSDP chunks of TP slices
    ],
)
def test_another_layout_loads_the_checkpoint_and_continues_the_run(
    root, writer, reader, whole_side, tp, etp
):
    """The loaded slices equal the written weights exactly; the steps after the checkpoint
    give the writing layout's losses (1e-5)."""
    from tests.runtime.conftest import run_distributed

    straight, part, directory = _written_by(writer, root)
    spec = _spec(reader)
    loaded = run_distributed(_load_body, spec.world, spec, directory, timeout_s=120)
    assert {start for start, _, _ in loaded} == {STEPS // 2}
    written = [r[2] for r in part]
    read = [weights for _, weights, _ in loaded]
    if whole_side == "writer":  # every slice the reader holds against the written whole
        seen = assert_match_oracle(read, _whole(written), tp, etp, rtol=0, atol=0)
    else:
        seen = assert_match_oracle(written, _whole(read), tp, etp, rtol=0, atol=0)
    assert seen == set(_whole(written if whole_side == "writer" else read))  # every weight
    want = straight[0][0][STEPS // 2 :]
    assert loaded[0][2] == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_a_padded_vocabulary_slice_is_saved_without_its_padding_row(root):
    """V = 257 over tp = 2: rank 0 holds ids 0..128, rank 1 ids 129..256 and a zero padding
    row. The tp = 1 run that loads the tp = 2 checkpoint holds the two real slices end to
    end, and continues with the tp = 2 run's losses."""
    import numpy as np

    from tests.runtime.conftest import run_distributed

    straight, part, directory = _written_by("tp2_v257", root)
    [(start, (_, whole), losses)] = run_distributed(_load_body, 1, _spec("tp1_v257"), directory)
    by_tp = {coord[0]: named for coord, named in (r[2] for r in part)}
    for key in (("embed", "weight"), ("head", "weight")):
        first, second = by_tp[0][key], by_tp[1][key]
        assert first.shape == second.shape == (129, 32)
        assert not second[128].any()  # the padding row
        assert whole[key].shape == (257, 32)
        assert (np.concatenate([first, second[:128]]) == whole[key]).all()
    assert start == STEPS // 2
    assert losses == pytest.approx(straight[0][0][STEPS // 2 :], rel=1e-5, abs=1e-5)


def test_only_fsdp_over_a_padded_vocabulary_is_refused():
    from planner.run.checkpoint_dir import check_checkpointable

    for layout in LAYOUTS:
        check_checkpointable(_spec(layout))  # every other layout: fine (V = 257 without FSDP)
    spec = _spec("fsdp_tp2")
    odd = replace(spec, model=replace(spec.model, vocab_size=257))
    check_checkpointable(replace(odd, fsdp=False))  # TP pads the last slice: still slices
    with pytest.raises(SpecError, match=r"FSDP and tp=2 needs the vocabulary \(257\) divisible"):
        check_checkpointable(odd)


def test_every_layout_writes_the_same_keys_of_the_same_whole_shapes(root):
    """tp, etp and FSDP slices are saved under the whole weight's key and shape: the
    checkpoints of every layout describe the same tensors (the RNG keys are per process)."""
    import torch.distributed.checkpoint as dcp

    from planner.run.checkpoint_dir import checkpoints

    def described(layout: str) -> dict:
        path = checkpoints(_written_by(layout, root)[2])[-1]  # the step-2 checkpoint
        saved = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
        return {k: tuple(v.size) for k, v in saved.items() if not k.startswith("rng.")}

    whole = described("tp1")
    assert any(k.startswith("model.layers.1.experts.7.") for k in whole)
    for layout in ("tp2", "etp2", "fsdp"):
        assert described(layout) == whole, layout
