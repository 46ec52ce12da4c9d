"""Property tests: any valid trace round-trips and replays within its constraints; any
corrupted one is a one-line SpecError, never another exception."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from planner.migration.api import uniform_costs
from planner.migration.placement import default_rank_of_expert, initial_slots
from planner.migration.policies import POLICIES
from planner.migration.run import replay_all
from planner.migration.trace import Trace, load_trace, trace_to_csv
from planner.specs import SpecError


@st.composite
def traces(draw):
    intervals = draw(st.integers(1, 4))
    layers = draw(st.lists(st.integers(0, 50), min_size=1, max_size=3, unique=True))
    ranks = draw(st.sampled_from([1, 2, 4]))
    experts = ranks * draw(st.integers(1, 3))
    tokens = draw(
        st.lists(
            st.integers(0, 10_000),
            min_size=intervals * len(layers) * experts,
            max_size=intervals * len(layers) * experts,
        )
    )
    arr = np.array(tokens, dtype=np.int64).reshape(intervals, len(layers), experts)
    return Trace(arr, tuple(sorted(layers)), "prop"), ranks


@settings(max_examples=25, deadline=None)
@given(traces())
def test_valid_traces_round_trip_and_replay_within_constraints(tmp_path_factory, case):
    trace, ranks = case
    path = tmp_path_factory.mktemp("t") / "t.csv"
    path.write_text(trace_to_csv(trace))
    again = load_trace(path)
    assert np.array_equal(again.tokens_ILE, trace.tokens_ILE)
    assert again.layer_ids == trace.layer_ids
    start = initial_slots(default_rank_of_expert(trace.num_experts, ranks), ranks)
    initial = np.stack([start] * trace.num_layers)
    for run in replay_all(
        trace, initial, uniform_costs(trace.num_layers, ranks), POLICIES
    ).values():
        for slots_RS in run.slots_ILRS.reshape(-1, *start.shape):
            assert sorted(slots_RS.ravel().tolist()) == list(range(trace.num_experts))
        assert (run.imbalance_IL >= 1.0 - 1e-9).all()


@settings(max_examples=40, deadline=None)
@given(traces(), st.integers(0, 10_000), st.sampled_from(["drop", "negative", "text", "dup"]))
def test_corrupted_traces_are_spec_errors(tmp_path_factory, case, where, fault):
    trace, _ = case
    lines = trace_to_csv(trace).splitlines()
    i = 1 + where % (len(lines) - 1)
    fields = lines[i].split(",")
    if fault == "drop":
        del lines[i]
    elif fault == "negative":
        lines[i] = ",".join([*fields[:3], "-1"])
    elif fault == "text":
        lines[i] = ",".join([*fields[:3], "many"])
    else:
        lines.append(lines[i])
    path = tmp_path_factory.mktemp("t") / "bad.csv"
    path.write_text("\n".join(lines) + "\n")
    try:
        load_trace(path)
    except SpecError as exc:
        assert str(path) in str(exc) and "\n" not in str(exc)
    else:
        # a dropped row goes unnoticed only when its expert, interval or layer is in no other
        # row: the rest is then a valid, smaller trace
        n_i, n_l, n_e = trace.tokens_ILE.shape
        hidden = fault == "drop" and 1 in (n_i * n_l, n_l * n_e, n_i * n_e)
        assert hidden, f"{fault} at line {i} was accepted"
