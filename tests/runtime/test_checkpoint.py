"""Checkpoints on torch.distributed.checkpoint: a run resumed from one trains exactly as the
run that never stopped, migration crossing the boundary; another plan of the same model
reads it; a corrupt or partial checkpoint is refused and the one before is used."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from planner.calibrate.metrics import EARLIER_LAYOUT
from planner.migration import MigrationDecision
from planner.run.checkpoint_dir import (
    MANIFEST,
    checkpoints,
    newest_valid,
    problem,
    read_state,
    resume_point,
    step_dir,
)
from planner.specs import SpecError
from runtime.checkpoint import CheckpointOptions
from runtime.data import load_corpus
from runtime.launch import build_trainer  # imported here, not in each forked rank: fast
from runtime.migrate import MigrationPolicy
from runtime.train import train
from tests.runtime.tiny_plans import rotate_policy, tiny_spec

pytestmark = pytest.mark.slow  # one module fixture: three 2-rank runs, 40 steps, ~15 s


def history_policy(current_LE, load_history_TLE, costs=None, options=None):
    """Rotate (rotate_policy) or keep, decided by the whole history the policy is given (its
    rows and the tokens sent to expert 0), so a resume that lost any of it decides otherwise."""
    history = np.asarray(load_history_TLE)
    if (len(history) + int(history[..., 0].sum())) % 2:
        return MigrationDecision(np.asarray(current_LE), (), 0.0)
    return rotate_policy(current_LE, load_history_TLE)


def _body(rank, world, spec, options, policy=None):
    migration = MigrationPolicy(choose=policy) if policy else MigrationPolicy()
    saves = CheckpointOptions(*options) if options else None
    r = train(build_trainer(spec, rank, migration=migration), checkpoints=saves)
    state = {k: v.numpy().copy() for k, v in r.expert_state.items()}
    return r.losses, r.files, state, r.slots, str(r.checkpoint)


def _losses(files) -> list[float]:
    return [json.loads(x)["loss"] for x in files["metrics.jsonl"].splitlines()]


@pytest.fixture(scope="module")
def straight_and_resumed(tmp_path_factory):
    """dp = ep = 2, a decision every 3 steps: 20 steps straight, and 10 + resume to 20."""
    from tests.runtime.conftest import run_distributed

    load_corpus()
    root = tmp_path_factory.mktemp("ckpt")
    spec = tiny_spec(pp=1, dp=2, ep=2, ranks_per_node=2, steps=20, layers=3, migrate_every=3)
    first = tiny_spec(pp=1, dp=2, ep=2, ranks_per_node=2, steps=10, layers=3, migrate_every=3)
    straight = run_distributed(_body, 2, spec, None, history_policy, timeout_s=120)
    part = run_distributed(_body, 2, first, (str(root), 5, False), history_policy, timeout_s=120)
    resumed = run_distributed(_body, 2, spec, (str(root), 0, True), history_policy, timeout_s=120)
    return spec, root, straight, part, resumed


def test_ten_steps_and_a_resume_train_bitwise_like_twenty_straight(straight_and_resumed):
    spec, root, straight, part, resumed = straight_and_resumed
    # checkpoints after 5 and 10 steps; the resumed run left one after 20 (newest 2 kept)
    assert [p.name for p in checkpoints(root)] == ["step-000020", "step-000010"]
    assert part[0][4] == str(step_dir(root, 10))
    assert len(resumed[0][0]) == 10  # steps 10..19 only were run
    assert _losses(resumed[0][1]) == _losses(straight[0][1])  # bitwise, all 20 lines
    assert resumed[0][0] == straight[0][0][10:]
    # decisions after steps 3, 6, 9 (before the checkpoint) and 12, 15, 18 (after), each
    # from the whole history: the resumed run moves exactly when the straight run did
    moved = [
        [json.loads(x)["migrated_experts"] for x in r[0][1]["metrics.jsonl"].splitlines()]
        for r in (straight, resumed)
    ]
    print("steps that moved experts", [i for i, m in enumerate(moved[0]) if m])
    assert moved[0] == moved[1]
    assert {i for i, m in enumerate(moved[0]) if m} & {11, 14, 17}  # moves after the resume
    assert resumed[0][1]["trace.csv"] == straight[0][1]["trace.csv"]
    for a, b in zip(straight, resumed, strict=True):
        assert a[3] == b[3]  # the same slot tables at the end
        assert a[2].keys() == b[2].keys()
        for key in a[2]:  # every expert's weights, grads and Adam moments, bitwise
            assert (a[2][key] == b[2][key]).all(), key
    state = read_state(step_dir(root, 10))
    assert state["step"] == 10 and len(state["lines"]) == 10
    rotations = sum(1 for m in moved[0][:10] if m)  # ep = 2: odd -> every expert moved
    assert state["slots"]["1"][0] == [[0, 1, 2, 3], [4, 5, 6, 7]][:: -1 if rotations % 2 else 1]


@pytest.mark.parametrize("pp, ep", [(1, 1), (2, 2)])
def test_another_plan_of_the_model_resumes_from_the_checkpoint(
    straight_and_resumed, tmp_path, pp, ep
):
    """ep = 1 (every expert on both dp ranks), or pp = 2 (4 ranks, the layers over two
    stages), reads the pp = 1, dp = ep = 2 checkpoint taken with the experts placed by the
    policy: DCP hands each rank the tensors its keys name. (dp stays 2: the data is sharded
    by data-parallel rank.)"""
    from tests.runtime.conftest import run_distributed

    spec, root, straight, _, _ = straight_and_resumed
    shutil.copytree(step_dir(root, 10), step_dir(tmp_path, 10))
    other = tiny_spec(pp=pp, dp=2, ep=ep, ranks_per_node=2, steps=20, layers=3)
    out = run_distributed(_body, pp * 2, other, (str(tmp_path), 0, True), None, timeout_s=120)
    losses = _losses(out[0][1])
    assert losses[:10] == _losses(straight[0][1])[:10]  # the lines it resumed with
    # ... marked as another layout's, which the summary and calibration leave out
    lines = [json.loads(x) for x in out[0][1]["metrics.jsonl"].splitlines()]
    assert [bool(x.get(EARLIER_LAYOUT)) for x in lines] == [True] * 10 + [False] * 10
    # the same math; the gradients are summed in another order
    assert losses[10:] == pytest.approx(_losses(straight[0][1])[10:], rel=1e-5, abs=1e-5)


def test_a_corrupt_or_partial_checkpoint_is_refused_and_the_one_before_used(
    straight_and_resumed, tmp_path
):
    spec, root, *_ = straight_and_resumed
    for step in (10, 20):
        shutil.copytree(step_dir(root, step), step_dir(tmp_path, step))
    newest = step_dir(tmp_path, 20)
    victim = sorted(newest.glob("*.distcp"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one byte flipped
    victim.write_bytes(bytes(data))
    path, refused = newest_valid(tmp_path)
    assert path == step_dir(tmp_path, 10)
    assert refused == [
        f"checkpoint {newest} refused: file {victim.name} does not match its SHA-256 in "
        f"{MANIFEST}; trying the one before"
    ]
    (newest / MANIFEST).unlink()  # as a crash before the manifest would leave it
    assert problem(newest) == f"{MANIFEST} missing or unreadable (a partial checkpoint)"
    path, done, lines = resume_point(str(tmp_path), spec)
    assert (path, done) == (step_dir(tmp_path, 10), 10)
    # the refused one is set aside, so pruning to the newest two keeps the intact step 10
    aside = tmp_path / f"refused-{newest.name}"
    assert lines == [
        f"checkpoint {newest} refused: {MANIFEST} missing or unreadable (a partial "
        f"checkpoint); trying the one before; set aside as {aside}"
    ]
    assert aside.is_dir() and not newest.exists()
    assert checkpoints(tmp_path) == [step_dir(tmp_path, 10)]
    with pytest.raises(SpecError, match="has 10 steps done and --steps is 10; raise --steps"):
        resume_point(str(tmp_path), tiny_spec(pp=1, dp=2, ep=2, ranks_per_node=2, steps=10,
                                              layers=3))  # fmt: skip
    four_layers = tiny_spec(pp=1, dp=2, ep=2, ranks_per_node=2, steps=20, layers=4)
    with pytest.raises(SpecError, match="holds another model .* --scale and --data it was"):
        resume_point(str(tmp_path), four_layers)
    shutil.rmtree(step_dir(tmp_path, 10))
    with pytest.raises(SpecError, match="no intact checkpoint in"):
        resume_point(str(tmp_path), spec)


def test_replicas_and_free_slots_resume_bitwise(tmp_path):
    """Redundant slots (expert 0 twice, then a free slot) with a new slot table every 2
    steps: 5 steps + resume to 9 equal 9 straight, moves, tables and every copy's state."""
    from tests.runtime.conftest import run_distributed
    from tests.runtime.test_replicas import CYCLE, _spec_with_slots
    from tests.runtime.tiny_plans import cycle_policy

    def spec(steps):
        return _spec_with_slots(CYCLE[0], dp=2, ep=2, ranks_per_node=2, steps=steps,
                                migrate_every=2)  # fmt: skip

    policy, saves = cycle_policy(CYCLE), (str(tmp_path), 0, False)
    straight = run_distributed(_body, 2, spec(9), None, policy, timeout_s=120)
    run_distributed(_body, 2, spec(5), saves, policy, timeout_s=120)
    resumed = run_distributed(_body, 2, spec(9), (str(tmp_path), 0, True), policy, timeout_s=120)
    assert _losses(resumed[0][1]) == _losses(straight[0][1])
    moved = [json.loads(x)["migrated_experts"] for x in resumed[0][1]["metrics.jsonl"].split("\n")
             if x]  # fmt: skip
    assert moved == [0, 2, 0, 6, 0, 6, 0, 2, 0]  # copies made before and after step 5
    for a, b in zip(straight, resumed, strict=True):
        assert a[3] == b[3] and a[2].keys() == b[2].keys()
        assert all((a[2][k] == b[2][k]).all() for k in a[2])


def test_interleaved_chunks_resume_bitwise(tmp_path):
    """pp = 2 x vp = 2: each rank's two chunks save and load their layers by run-model
    index; 3 steps + resume to 6 equal 6 straight."""
    from planner.run.spec import run_spec_from_plan
    from tests.runtime.conftest import run_distributed
    from tests.runtime.tiny_plans import hand_plan, tiny_model

    model = tiny_model(layers=4)
    plan = hand_plan(model, 2, 1, 1, micro_batch=2, num_microbatches=2, seq_len=32,
                     gpus_per_node=2, vp=2)  # fmt: skip

    def spec(steps):
        return run_spec_from_plan(plan, model, 1.0, 2, steps=steps)

    straight = run_distributed(_body, 2, spec(6), None, None, timeout_s=120)
    run_distributed(_body, 2, spec(3), (str(tmp_path), 0, False), None, timeout_s=120)
    resumed = run_distributed(_body, 2, spec(6), (str(tmp_path), 0, True), None, timeout_s=120)
    assert len(resumed[0][0]) == 3 and _losses(resumed[0][1]) == _losses(straight[0][1])
