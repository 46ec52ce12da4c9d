"""The single-device MoE transformer: routing and experts against brute force, placement- and
split-invariant initialization, the byte corpus, and a falling loss on real text."""

from __future__ import annotations

import json

import pytest
import torch

from runtime.data import load_corpus, sample_batch
from runtime.dispatch.local import LocalDispatcher
from runtime.model.moe import Experts, MoELayer
from runtime.model.transformer import StageModule, lm_loss
from tests.runtime.tiny_plans import tiny_model


def _brute_force_moe(layer: MoELayer, x_TD: torch.Tensor) -> torch.Tensor:
    """Per token: softmax over all experts, top-k, renormalize, sum of gated SwiGLU experts."""
    ex = layer.experts
    out = torch.zeros_like(x_TD)
    probs = torch.softmax(x_TD @ layer.router.weight.T, dim=-1)
    for t in range(x_TD.shape[0]):
        top = torch.topk(probs[t], layer.spec.top_k).indices.tolist()
        gates = probs[t, top] / probs[t, top].sum()
        for g, e in zip(gates, top, strict=True):
            slot = ex.expert_ids.index(e)
            h = torch.nn.functional.silu(x_TD[t] @ ex.w_gate[slot]) * (x_TD[t] @ ex.w_in[slot])
            out[t] += g * (h @ ex.w_out[slot])
    return out


def test_moe_layer_equals_brute_force():
    spec = tiny_model().layers[1].moe
    layer = MoELayer(32, spec, [0] * spec.num_experts, 0, seed=3, layer=1)
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(0))
    y = layer(x)
    want = _brute_force_moe(layer, x.reshape(-1, 32)).reshape(2, 5, 32)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)
    # every token chose top_k experts, counted once each
    assert int(layer.tokens_E.sum()) == 10 * spec.top_k


def test_local_dispatcher_round_trip_and_grouping():
    d = LocalDispatcher()
    x = torch.arange(12.0).reshape(6, 2)
    expert_TK = torch.tensor([[3, 0], [1, 3], [0, 2], [2, 1], [3, 3], [0, 0]])
    rows, counts, handle = d.dispatch(x, expert_TK, torch.zeros(4, dtype=torch.long))
    assert counts.tolist() == [4, 2, 2, 4]
    assert rows[:4].tolist() == [x[0].tolist(), x[2].tolist(), x[5].tolist(), x[5].tolist()]
    back = d.combine(rows, handle)
    assert torch.equal(back, x[:, None, :].expand(6, 2, 2))


def test_expert_weights_depend_only_on_expert_identity():
    spec = tiny_model().layers[1].moe
    full = Experts(32, spec, list(range(8)), seed=5, layer=2)
    part = Experts(32, spec, [1, 6], seed=5, layer=2)
    for a, b in zip(full.slot_params(), part.slot_params(), strict=True):
        assert torch.equal(a[1], b[0]) and torch.equal(a[6], b[1])


def test_two_stages_compose_to_the_whole_model():
    model = tiny_model()
    x, _ = sample_batch(0, 0, 1, 2, 16)
    whole = StageModule(model, range(4), True, True, seed=1)
    first = StageModule(model, [0, 1], True, False, seed=1)
    last = StageModule(model, [2, 3], False, True, seed=1)
    torch.testing.assert_close(last(first(x)), whole(x))


def test_corpus_and_sampling_are_deterministic_and_sliced_per_dp_rank():
    corpus = load_corpus()
    assert corpus.numel() >= 2**20 and bytes(corpus[:3].tolist()).isascii()
    a = sample_batch(3, 1, 4, 8, 32, seed=7)
    b = sample_batch(3, 1, 4, 8, 32, seed=7)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1][:, :-1], a[0][:, 1:])
    assert not torch.equal(a[0], sample_batch(4, 1, 4, 8, 32, seed=7)[0])
    slice_len = corpus.numel() // 4
    for j in range(4):  # rank j reads only its slice [j*L, (j+1)*L)
        x, _ = sample_batch(0, j, 4, 64, 32, seed=0)
        hay = bytes(corpus[j * slice_len : (j + 1) * slice_len].tolist())
        assert all(bytes(row.tolist()) in hay for row in x[:4])


def test_loss_falls_on_real_text_single_device():
    model = tiny_model()
    module = StageModule(model, range(4), True, True)
    opt = torch.optim.Adam(module.parameters(), lr=3e-3)
    losses = []
    for step in range(30):
        x, y = sample_batch(step, 0, 1, 4, 32)
        opt.zero_grad()
        loss = lm_loss(module(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(5.55, abs=0.5)  # ~ln(256): uniform over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - 1.5


def test_layer_bench_cpu_smoke(tmp_path):
    from runtime.bench import layer_bench

    rc = layer_bench.main(
        [
            "--model",
            "tiny-moe",
            "--cluster",
            "cpu-gloo",
            "--seq-len",
            "32",
            "--iters",
            "1",
            "--out",
            str(tmp_path / "lb"),
        ]
    )
    assert rc == 0
    rows = json.loads((tmp_path / "lb.json").read_text())
    assert [r["kind"] for r in rows] == ["dense", "moe"]
    for r in rows:
        assert r["fwd_s"] > 0 and r["pred_fwd_bwd_s"] > r["pred_fwd_s"] > 0
        assert r["time_ratio_measured_over_pred"] == pytest.approx(
            (r["fwd_s"] + r["bwd_s"]) / r["pred_fwd_bwd_s"]
        )


@pytest.mark.gpu
def test_layer_bench_on_cuda(tmp_path):
    from runtime.bench import layer_bench

    assert (
        layer_bench.main(
            [
                "--model",
                "mixtral-8x7b",
                "--seq-len",
                "2048",
                "--iters",
                "3",
                "--out",
                str(tmp_path / "lb"),
            ]
        )
        == 0
    )
    rows = json.loads((tmp_path / "lb.json").read_text())
    for r in rows:
        assert r["device"].startswith("cuda") and r["mem_bytes"] > 0
        # within an order of magnitude of the planner's prediction
        assert 0.1 < r["time_ratio_measured_over_pred"] < 10
        assert 0.1 < r["mem_ratio_measured_over_pred"] < 10


def test_router_bias_update_moves_selection_toward_cold_experts():
    from runtime.train import update_router_bias

    module = StageModule(tiny_model(), [1], first=False, last=False, seed=2)
    moe = module.moe_layers()[1]
    tokens_LE = torch.tensor([[10, 0, 0, 0, 0, 0, 0, 30]])  # mean 5
    update_router_bias(module, tokens_LE, rate=0.25)
    assert moe.router.bias_E.tolist() == [-0.25] + [0.25] * 6 + [-0.25]
    # the bias shifts selection only: gates are still the softmax of the chosen experts
    x = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    moe.router.bias_E.copy_(torch.tensor([0.0] * 7 + [10.0]))
    expert_TK, gate_TK = moe.router(x)
    assert (expert_TK == 7).any(dim=1).all()  # expert 7 always chosen
    probs = torch.softmax(x @ moe.router.weight.T, dim=-1)
    chosen = probs.gather(1, expert_TK)
    torch.testing.assert_close(gate_TK, chosen / chosen.sum(dim=1, keepdim=True))
