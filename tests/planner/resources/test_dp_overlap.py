"""The data-parallel gradient reduction as Megatron-Core's DDP overlaps it, against hand oracles.

Megatron-Core (megatron/core/distributed/param_and_grad_buffer.py, `register_grad_ready`)
launches a bucket's reduce-scatter once the last micro-batch's backward has produced all of
its gradients; buckets hold max(40M, 1M x dp) parameters, only on chunk 0 of pipeline rank 0
(megatron/training/training.py); the interleaved schedule reduces each model chunk after its
last backward (megatron/core/pipeline_parallel/schedules.py)."""

from __future__ import annotations

import pytest

from planner.parallel import ParallelConfig
from planner.resources import comm
from planner.resources.cost import estimate
from planner.resources.layer_cost import first_extras, last_extras, layer_costs
from planner.resources.memory import grad_bytes_per_param
from planner.resources.overlap import queued_reduce_exposed_s
from planner.resources.schedule import bucket_params, held_params, reduce_units
from planner.specs import TrainingSpec
from tests.planner.resources.resource_specs import make_cluster, make_model


def test_queue_runs_units_one_after_another_from_their_ready_times():
    # the first unit is ready at -3 and ends at -2; the second waits for its own ready time
    assert queued_reduce_exposed_s([(1.0, -3.0), (1.0, -0.5)]) == pytest.approx(0.5)
    # a long first unit delays the second past its ready time: -3 + 3 = 0, then + 1
    assert queued_reduce_exposed_s([(3.0, -3.0), (1.0, -0.5)]) == pytest.approx(1.0)
    # order of the list does not matter, only the ready times
    assert queued_reduce_exposed_s([(1.0, -0.5), (3.0, -3.0)]) == pytest.approx(1.0)
    # everything done before the backward ends: nothing exposed
    assert queued_reduce_exposed_s([(1.0, -5.0), (1.0, -2.0)]) == 0.0
    assert queued_reduce_exposed_s([]) == 0.0


def test_bucket_size_is_megatrons_default():
    assert bucket_params(ParallelConfig(pp=1, dp=8)) == 40e6  # max(40M, 8M)
    assert bucket_params(ParallelConfig(pp=1, dp=64, tp=2)) == 64e6  # 1M per dp rank
    assert bucket_params(ParallelConfig(pp=1, dp=32, cp=2)) == 64e6  # the dp x cp group


def test_units_interleaved_by_hand():
    # vp 2, pp 4, m 8: the last group runs 4 micro-batches of chunk 1, then 4 of chunk 0.
    # Stage 0 holds 160M parameters, 80M per chunk: chunk 0 in k = ceil(80M / 40M) = 2 buckets.
    par = ParallelConfig(pp=4, dp=8, vp=2, num_microbatches=8)
    units = reduce_units(4.0, 160e6, par, chunk_bwd_s=1.0, bucketed=True)
    assert sorted(units, key=lambda u: u[1]) == [(2.0, -4.0), (1.0, -0.5), (1.0, 0.0)]
    # chunk 1 ends at -2; bucket 1 of chunk 0 runs -0.5 .. 0.5, bucket 2 0.5 .. 1.5
    assert queued_reduce_exposed_s(units) == pytest.approx(1.5)
    # pipeline rank > 0: chunk 0 in one piece, ready at the end
    units = reduce_units(4.0, 160e6, par, chunk_bwd_s=1.0, bucketed=False)
    assert queued_reduce_exposed_s(units) == pytest.approx(2.0)


def test_one_stage_distributed_optimizer_exposes_reduce_scatter_and_first_gather():
    # pp 1, a model far below one 40M bucket: the whole reduce-scatter of the fp32 gradients
    # (Megatron's 18 B accounting) is launched when the backward ends, and the first (only)
    # bucket's all-gather of the bf16 weights precedes the next forward: one ring pass each,
    # over dp for the dense and over edp for the expert parameters.
    model, cl = make_model(layers=2), make_cluster()
    tr = TrainingSpec(seq_len=32, zero=True, bytes_per_param=18)
    par = ParallelConfig(pp=1, dp=8, ep=2, num_microbatches=2)
    est = estimate(model, cl, tr, par)
    costs = layer_costs(model, cl, tr, par, "flat", "piper")
    ends = [first_extras(model, cl, tr, par, "piper"), last_extras(model, cl, tr, par, "piper")]
    dense, expert = held_params((0, 1), costs, ends)
    want = 0.0
    for nbytes in (4, 2):  # reduce-scatter of fp32 gradients, all-gather of bf16 weights
        want += comm.ring_allreduce_s(cl, 8, 1, nbytes * dense, 1.0)[0]
        want += comm.ring_allreduce_s(cl, par.edp, 2, nbytes * expert, 1.0)[0]
    assert grad_bytes_per_param(tr) == 4 and want > 0
    assert est.dp_exposed_s == pytest.approx(want)


def test_all_reduce_without_distributed_optimizer():
    model, cl = make_model(layers=2), make_cluster()
    tr = TrainingSpec(seq_len=32, zero=False)
    par = ParallelConfig(pp=1, dp=8, ep=2, num_microbatches=2)
    est = estimate(model, cl, tr, par)
    costs = layer_costs(model, cl, tr, par, "flat", "piper")
    ends = [first_extras(model, cl, tr, par, "piper"), last_extras(model, cl, tr, par, "piper")]
    dense, expert = held_params((0, 1), costs, ends)
    g = grad_bytes_per_param(tr)
    want = comm.ring_allreduce_s(cl, 8, 1, g * dense)[0]
    want += comm.ring_allreduce_s(cl, par.edp, 2, g * expert)[0]
    assert est.dp_exposed_s == pytest.approx(want)  # one all-reduce, no gather


def test_interleaving_hides_all_chunks_but_the_last():
    # with vp 2 the first chunk's reduction runs behind chunk 0's backward: less is exposed
    model, cl = make_model(layers=8), make_cluster()
    tr = TrainingSpec(seq_len=32, zero=True)
    plain = estimate(model, cl, tr, ParallelConfig(pp=2, dp=4, ep=2, num_microbatches=8))
    inter = estimate(model, cl, tr, ParallelConfig(pp=2, dp=4, ep=2, num_microbatches=8, vp=2))
    assert 0 < inter.dp_exposed_s < plain.dp_exposed_s


def test_without_distributed_optimizer_one_all_reduce_after_each_stage():
    # Piper's runtime all-reduces once after the backward: no chunks, no buckets; stage i still
    # ends its backward i / vp chunk-slots (2/3 of them backward) before stage 0
    model, cl = make_model(layers=8), make_cluster()
    tr = TrainingSpec(seq_len=32, zero=False)
    par = ParallelConfig(pp=2, dp=4, ep=2, num_microbatches=8, vp=2)
    est = estimate(model, cl, tr, par)
    costs = layer_costs(model, cl, tr, par, "flat", "piper")
    ends = [first_extras(model, cl, tr, par, "piper"), last_extras(model, cl, tr, par, "piper")]
    g, want = grad_bytes_per_param(tr), 0.0
    for st in est.stages:
        roles = [ends[0]] if st.stage == 0 else [ends[1]]
        dense, expert = held_params(st.layers, costs, roles)
        total = comm.ring_allreduce_s(cl, 4, 1, g * dense)[0]
        total += comm.ring_allreduce_s(cl, par.edp, 2, g * expert)[0]
        want = max(want, total - st.stage / 2 * est.slot_s * 2 / 3)
    assert est.dp_exposed_s == pytest.approx(max(want, 0.0)) and want > 0


def _forward_stall_by_simulation(gathers: list[tuple[float, float]]) -> float:
    """Oracle: gathers (seconds, needed at) run one after another from t = 0 in the order
    they are needed; the forward reaches each need point `needed` seconds of compute after
    the start and waits there until that gather is done. Returns the total wait."""
    stream_end, wait = 0.0, 0.0
    for seconds, needed in sorted(gathers, key=lambda g: g[1]):
        stream_end += seconds
        wait = max(wait, stream_end - needed)  # compute reached `needed` at needed + wait
    return wait


def test_parameter_gather_is_the_mirror_of_the_reduction_queue():
    # the forward waiting for gathers that run one bucket ahead equals the reduction queue
    # with ready = -needed (reduce_units reused with forward times, _gather_exposed_s)
    cases = [
        [(1.0, 0.0), (1.0, 0.5), (2.0, 4.0)],
        [(0.2, 0.0), (0.2, 1.0), (0.2, 2.0)],
        [(3.0, 0.0), (0.5, 0.1), (0.5, 0.2), (4.0, 8.0)],
    ]
    for gathers in cases:
        want = _forward_stall_by_simulation(gathers)
        got = queued_reduce_exposed_s([(t, -n) for t, n in gathers])
        assert got == pytest.approx(want)
    par = ParallelConfig(pp=4, dp=8, vp=2, num_microbatches=8)
    units = reduce_units(4.0, 160e6, par, chunk_bwd_s=1.0, bucketed=True)
    gathers = [(t, -r) for t, r in units]  # chunk 1 needed at 4, chunk 0's buckets at 0, 0.5
    assert _forward_stall_by_simulation(gathers) == pytest.approx(1.5)


def test_without_grad_overlap_the_distributed_optimizer_exposes_whole_stages():
    # grad_overlap False (Megatron-LM without --overlap-grad-reduce, DeepSpeed ZeRO-1/2's
    # default): each stage reduce-scatters its fp32 gradients in one piece after its backward
    # and all-gathers its bf16 weights in one piece before its first forward; stage i starts
    # the reduction i / vp chunk-slots (2/3 backward) and its forward i chunk-forwards (1/3 of
    # a chunk-slot) after stage 0, so that much hides.
    model, cl = make_model(layers=8), make_cluster()
    par = ParallelConfig(pp=2, dp=4, ep=2, num_microbatches=8, vp=2)
    over = estimate(model, cl, TrainingSpec(seq_len=32, zero=True, bytes_per_param=18), par)
    tr = TrainingSpec(seq_len=32, zero=True, bytes_per_param=18, grad_overlap=False)
    est = estimate(model, cl, tr, par)
    costs = layer_costs(model, cl, tr, par, "flat", "piper")
    ends = [first_extras(model, cl, tr, par, "piper"), last_extras(model, cl, tr, par, "piper")]
    reduce, gather = 0.0, 0.0
    for st in est.stages:
        roles = [ends[0]] if st.stage == 0 else [ends[1]]
        dense, expert = held_params(st.layers, costs, roles)
        t = {
            nbytes: comm.ring_allreduce_s(cl, 4, 1, nbytes * dense, 1.0)[0]
            + comm.ring_allreduce_s(cl, par.edp, 2, nbytes * expert, 1.0)[0]
            for nbytes in (4, 2)
        }
        reduce = max(reduce, t[4] - st.stage / 2 * est.slot_s * 2 / 3)
        gather = max(gather, t[2] - st.stage * est.slot_s / 2 / 3)
    assert est.dp_exposed_s == pytest.approx(reduce + gather)
    assert est.dp_exposed_s > over.dp_exposed_s > 0
    # the slots are the same: the step differs by the exposed reduction alone
    assert est.step_time_s - over.step_time_s == pytest.approx(est.dp_exposed_s - over.dp_exposed_s)
