"""benchmarks/frontier_runs.py's X-MoE checks: the rows load at the layouts of X-MoE's scripts,
and their TFLOPS are converted from X-MoE's count to Megatron-Core's as X-MoE's own formula
(Megatron-DeepSpeed-X-MoE megatron/utils.py throughput_calculator) gives them by hand."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))

import frontier_runs as fr  # noqa: E402

from planner.calibrate.runs import load_runs  # noqa: E402


def _xmoe_count_per_token(run) -> float:
    """X-MoE's training FLOPs per token: 6 x [L (4 h^2 + 2 h s + 2 h f k) + V h]
    (MHA projections, the full s x s scores and context, two expert matrices, logits)."""
    m, s = run.model, run.training.seq_len
    h = m.hidden_size
    moe = m.layers[0].moe
    per_layer = 4 * h * h + 2 * h * s + 2 * h * moe.expert_ffn * moe.top_k
    return 6 * (m.num_layers * per_layer + m.vocab_size * h)


def test_checks_load_at_the_scripts_layouts_without_overlapped_reduction():
    runs = {r.label: r for r in load_runs(fr.CHECK_RUNS)}
    assert sorted(runs) == ["id 301", "id 302", "id 303", "id 304"]
    small, large, super_ = runs["id 301"], runs["id 303"], runs["id 304"]
    assert (small.parallel.ep, small.parallel.micro_batch) == (8, 4)
    assert small.training.global_batch == 8192
    assert (large.parallel.tp, large.parallel.ep, large.parallel.etp) == (2, 64, 1)
    assert (super_.parallel.world, super_.parallel.tp, super_.parallel.ep) == (1024, 8, 256)
    assert all(r.parallel.pp == 1 and not r.training.grad_overlap for r in runs.values())
    assert all(fr.XMOE_COUNT in r.field("note") for r in runs.values())


@pytest.mark.parametrize("label", ["id 301", "id 302", "id 303", "id 304"])
def test_xmoe_tflops_converted_to_megatron_count(label):
    (run,) = [r for r in load_runs(fr.CHECK_RUNS) if r.label == label]
    assert all(not layer.moe.gated for layer in run.model.layers)  # two-matrix experts
    converted, factor = fr.in_megatron_count(run)
    ours = fr.flops_per_token(run.model, run.training.seq_len).total
    assert factor == pytest.approx(ours / _xmoe_count_per_token(run), rel=1e-9)
    assert converted.measured == pytest.approx(run.measured * factor)
    assert 0.85 < factor < 1.0  # only the attention scores differ, and they count less here
    plain, one = fr.in_megatron_count(load_runs(fr.PAPER_RUNS)[0])
    assert one == 1.0 and plain.measured == load_runs(fr.PAPER_RUNS)[0].measured


def test_the_paper_rows_other_counts_bracket_megatron_cores():
    """The paper gives no FLOP formula: X-MoE's count (the full attention square) counts more
    than Megatron-Core's causal half, the 6 x parameters rule (no scores) less, by exactly
    the causal attention FLOPs per token."""
    for run in load_runs(fr.PAPER_RUNS):
        per_token = fr.flops_per_token(run.model, run.training.seq_len)
        full, f_full = fr.counted_as(run, "full-square attention")
        none, f_none = fr.counted_as(run, "no attention scores")
        core = per_token.attention_core
        assert f_full == pytest.approx(per_token.total / (per_token.total + core), rel=1e-12)
        assert f_none == pytest.approx(per_token.total / (per_token.total - core), rel=1e-12)
        assert f_full < 1.0 < f_none
        assert (full.measured, none.measured) == (run.measured * f_full, run.measured * f_none)


def test_node_run_has_id_301s_work_per_gcd_on_one_node():
    (node,) = load_runs(fr.NODE_RUNS)
    small = next(r for r in load_runs(fr.CHECK_RUNS) if r.label == "id 301")
    assert node.label == "id 300" and node.parallel.world == 8 and node.parallel.ep == 8
    same = ("micro_batch", "num_microbatches", "tp", "pp", "ep", "etp")
    assert all(getattr(node.parallel, k) == getattr(small.parallel, k) for k in same)
    assert node.training.seq_len == small.training.seq_len and not node.training.grad_overlap
    assert fr.XMOE_COUNT in node.field("note")
    assert node.label not in {r.label for r in load_runs(fr.CHECK_RUNS)}  # checks stay unfitted


def test_stack_term_reproduces_the_node_run_as_host_time_per_layer_and_micro_batch():
    preset = fr.load_cluster("frontier")
    node, stack = fr.xmoe_stack(preset)
    assert preset.layer_overhead_us == 0.0 < stack.layer_overhead_us
    assert fr.predict(node, stack) == pytest.approx(node.measured, rel=1e-6)
    assert stack == fr.replace(preset, layer_overhead_us=stack.layer_overhead_us)
    # with no pipeline and no overlap, the host term adds layers x micro-batches x host time
    before, after = fr.estimate_run(node, preset), fr.estimate_run(node, stack)
    added = node.model.num_layers * node.parallel.num_microbatches * stack.layer_overhead_us
    assert after.step_time_s - before.step_time_s == pytest.approx(added * 1e-6, rel=1e-9)


def test_solve_constant_refuses_a_measurement_out_of_reach():
    preset = fr.load_cluster("frontier")
    node, _ = fr.xmoe_stack(preset)
    fast = fr.replace(node, measured=10 * fr.predict(node, preset))
    with pytest.raises(ValueError, match="no layer_overhead_us"):
        fr.solve_constant(fast, preset, "layer_overhead_us", 0.0, 1e5)
    slow = fr.solve_constant(node, preset, "gemm_efficiency", 0.05, 1.0)
    assert fr.predict(node, fr.replace(preset, gemm_efficiency=slow)) == pytest.approx(
        node.measured, rel=1e-6
    )


def test_comm_budget_is_the_step_less_the_step_with_free_communication():
    """The Super row's communication budget: a row measured at the free-communication step
    leaves nothing; one measured at the line-rate step (no stragglers) leaves exactly the
    priced communication; HALO-dedup moves fewer bytes than HALO, so it needs less."""
    preset = fr.load_cluster("frontier")
    super_ = next(r for r in load_runs(fr.PAPER_RUNS) if r.label == "id 204")
    free = fr.network_free(preset)
    assert free.network_jitter_us == 0.0 and free.msg_overhead_us == 0.0
    assert fr.predict(super_, free) > fr.predict(super_, preset)
    at_free = fr.replace(super_, measured=fr.predict(super_, free))
    assert fr.comm_budget(at_free, preset)[0] == pytest.approx(0.0, abs=1e-12)
    calm = fr.replace(preset, network_jitter_us=0.0)
    at_line = fr.replace(super_, measured=fr.predict(super_, calm))
    left, halo, dedup = fr.comm_budget(at_line, preset)
    assert left == pytest.approx(halo, rel=1e-12)
    assert 0.0 < dedup < halo < 1.0
    # the step with free communication is unchanged by the stragglers' constant
    assert fr.predict(super_, fr.network_free(calm)) == fr.predict(super_, free)
