"""Activation recomputation as the plan asks for it: the same math, the layer rerun in
backward (its all-to-all included), and routed tokens counted once."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from planner.calibrate.metrics import parse_metrics
from planner.migration.trace import trace_from_text, trace_rows
from planner.run.spec import run_spec_from_plan
from runtime.data import load_corpus, sample_batch
from runtime.model.transformer import StageModule, lm_loss
from tests.runtime.tiny_plans import hand_plan, reference_losses, tiny_model, train_body


def _grads_and_tokens(recompute: dict[int, str] | None):
    model = tiny_model(layers=3)
    module = StageModule(model, range(3), True, True, seed=3, recompute=recompute)
    x, y = sample_batch(0, 0, 1, 4, 32, 3)
    loss = lm_loss(module(x), y)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in module.named_parameters()}
    tokens = {i: m.tokens_E.clone() for i, m in module.moe_layers().items()}
    return float(loss.detach()), grads, tokens


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_recomputed_layers_give_the_same_loss_gradients_and_token_counts(mode):
    load_corpus()
    loss, grads, tokens = _grads_and_tokens(None)
    loss_r, grads_r, tokens_r = _grads_and_tokens({0: mode, 2: mode})
    assert loss_r == loss
    for name, g in grads.items():
        assert torch.allclose(grads_r[name], g, rtol=1e-5, atol=1e-7), name
    assert all(torch.equal(tokens_r[i], tokens[i]) for i in tokens)  # not counted twice
    assert sum(int(t.sum()) for t in tokens.values()) == 2 * 4 * 32 * 2  # 2 MoE layers, top-2


def test_the_plans_recompute_layers_reach_the_run():
    model = tiny_model()
    plan = hand_plan(model, 2, 2, 2, gpus_per_node=2)
    stages = tuple(replace(s, recompute_layers=s.layers[-1:]) for s in plan.stages)
    full = replace(plan, stages=stages, parallel=replace(plan.parallel, recompute="full"))
    spec = run_spec_from_plan(full, model, 1.0, 2)
    assert (spec.recompute, spec.recompute_layers) == ("full", (1, 3))
    # policy "none" keeps every activation whatever the stages list
    none = replace(full, parallel=replace(plan.parallel, recompute="none"))
    assert run_spec_from_plan(none, model, 1.0, 2).recompute_layers == ()
    # a shrunk run keeps the recomputed layers it keeps (source layer 1 -> run layer 0)
    shrunk = run_spec_from_plan(full, model, 0.5, 2)
    assert shrunk.source_layers == (1, 2) and shrunk.recompute_layers == (0,)


@pytest.mark.slow
def test_full_recompute_trains_like_the_oracle_and_resends_the_all_to_all(run_distributed):
    load_corpus()
    model = tiny_model()
    plan = hand_plan(model, 2, 2, 2, micro_batch=2, num_microbatches=2, seq_len=32,
                     gpus_per_node=2)  # fmt: skip
    moe_layers = set(model.moe_layers)
    stages = tuple(
        replace(s, recompute_layers=tuple(i for i in s.layers if i in moe_layers))
        for s in plan.stages
    )
    runs = {}
    for policy in ("none", "full"):
        p = replace(plan, stages=stages, parallel=replace(plan.parallel, recompute=policy))
        spec = run_spec_from_plan(p, model, 1.0, 2, steps=6, dispatcher="flat")
        files = run_distributed(train_body, spec.world, spec, timeout_s=240)[0][1]
        runs[policy] = (spec, parse_metrics(files["metrics.jsonl"]), files["trace.csv"])
    spec, lines, trace = runs["full"]
    assert [d["loss"] for d in lines] == pytest.approx(reference_losses(spec), rel=2e-3)
    # tokens counted once
    assert trace_rows(trace_from_text(trace)) == trace_rows(trace_from_text(runs["none"][2]))

    def dispatch_bytes(lines):
        kinds = lines[-1]["bytes_by_kind"]
        return kinds["dispatch_intra"] + kinds["dispatch_inter"]

    # every MoE layer recomputed: forward, recomputed forward and backward all-to-alls (3)
    # instead of forward and backward (2)
    ratio = dispatch_bytes(lines) / dispatch_bytes(runs["none"][1])
    assert ratio == pytest.approx(1.5, rel=0.05)


def _saved_bytes(recompute: dict[int, str] | None) -> int:
    """Bytes autograd keeps for backward after one forward (what recompute saves)."""
    model = tiny_model(layers=3)
    module = StageModule(model, range(3), True, True, seed=3, recompute=recompute)
    x, _ = sample_batch(0, 0, 1, 4, 32, 3)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return sum(seen.values())


def test_recompute_keeps_fewer_activations():
    load_corpus()
    none = _saved_bytes(None)
    selective = _saved_bytes({i: "selective" for i in range(3)})
    full = _saved_bytes({i: "full" for i in range(3)})
    assert full < selective < none
    assert full < 0.2 * none  # full keeps the layer inputs (and the embedding's), little else
