"""The local experts in grouped GEMMs (torch._grouped_mm) against the slot-by-slot loop:
the same outputs and gradients, biases, empty slots and free slots included."""

from __future__ import annotations

import pytest
import torch

from planner.run.spec import EMPTY
from planner.specs import MoESpec
from runtime.model.moe import Experts, grouped_mm_fits


def _experts(gated: bool, bias: bool, ids=(3, EMPTY, 0, 5), d=32, f=48) -> Experts:
    spec = MoESpec(8, 2, expert_ffn=f, gated=gated, expert_bias=bias)
    experts = Experts(d, spec, list(ids), seed=7, layer=2)
    if bias:  # biases start at zero: make them count
        with torch.no_grad():
            for p in (experts.b_in, experts.b_gate, experts.b_out):
                if p is not None:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)))
    return experts


def _run(experts: Experts, gemm: str, x_ND, counts, w_ND):
    experts.gemm = gemm
    experts.zero_grad(set_to_none=True)
    x = x_ND.clone().requires_grad_(True)
    y = experts(x, counts)
    (y * w_ND).sum().backward()
    grads = {n: p.grad.clone() for n, p in experts.named_parameters()}
    return y.detach(), x.grad, grads


@pytest.mark.parametrize("gated, bias", [(True, False), (False, True), (True, True)])
@pytest.mark.parametrize("counts", [[5, 0, 9, 2], [0, 0, 0, 0], [1, 1, 1, 13]])
def test_grouped_gemms_give_the_loops_outputs_and_gradients(gated, bias, counts):
    experts = _experts(gated, bias)
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(sum(counts), 32, generator=gen)
    w = torch.randn(sum(counts), 32, generator=gen)  # a loss that weighs every output
    y_loop, gx_loop, g_loop = _run(experts, "loop", x, counts, w)
    y_grp, gx_grp, g_grp = _run(experts, "grouped", x, counts, w)
    torch.testing.assert_close(y_grp, y_loop, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(gx_grp, gx_loop, rtol=1e-6, atol=1e-6)
    names = {"w_in", "w_out"} | ({"w_gate"} if gated else set())
    names |= {"b_in", "b_out"} | ({"b_gate"} if gated else set()) if bias else set()
    assert set(g_grp) == set(g_loop) == names
    for name in g_loop:
        torch.testing.assert_close(g_grp[name], g_loop[name], rtol=1e-6, atol=1e-6)
    assert not g_grp["w_in"][1].any()  # the free slot got no rows, so no gradient


def test_shapes_grouped_mm_cannot_take_run_the_loop():
    odd = _experts(True, False, d=30, f=48)  # 30 fp32 values: a 120-byte row, not 16-aligned
    x = torch.randn(6, 30)
    assert not grouped_mm_fits(x, odd.w_in, odd.w_out)
    fits = _experts(True, False)
    assert grouped_mm_fits(torch.randn(6, 32), fits.w_in, fits.w_out)
    odd.gemm = "grouped"
    y = odd(x, [2, 0, 4, 0])  # falls back to the loop
    odd.gemm = "loop"
    assert torch.equal(y, odd(x, [2, 0, 4, 0]))


def test_grouped_gemm_output_is_no_view_and_takes_an_expanded_gradient():
    """A sum's gradient is expanded (stride 0), which torch._grouped_mm's backward refuses:
    _gmm makes it contiguous through a hook on a plain (non-view) output, the kind FSDP2
    accepts from the modules it wraps without a warning."""
    from runtime.model.moe import _gmm

    torch.manual_seed(0)
    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(2, 16, 16, requires_grad=True)
    offs = torch.tensor([4, 8], dtype=torch.int32)
    with pytest.raises(RuntimeError):
        torch._grouped_mm(x, w, offs=offs).sum().backward()
    x.grad = w.grad = None
    y = _gmm(x, w, offs, None, None)
    assert not y._is_view()
    y.sum().backward()
    ones = torch.ones(8, 16)
    assert torch.allclose(x.grad[:4], ones[:4] @ w[0].detach().T)
    assert torch.allclose(w.grad[1], x[4:].detach().T @ ones[4:])
