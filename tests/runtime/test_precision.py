"""bf16 compute with fp32 master weights (`--precision bf16`, or `plan` with a bf16 plan):
the GEMMs run in bf16, the weights and Adam state stay fp32, and the loss curve follows the
fp32 run's within the stated tolerance through every parallelism; the activations on the
wire are bf16 (pipeline sends, expert all-to-all flat and HALO, TP and expert-TP
collectives, FSDP's parameter all-gather: exactly half the fp32 run's bytes where the bytes
do not depend on the routing) and the gradient reductions fp32 (the same bytes); a bf16
run resumed from its checkpoint equals the uninterrupted one bitwise."""

from __future__ import annotations

import contextlib
import json
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from planner.run.options import RunOptions
from planner.run.spec import run_spec_from_plan
from runtime.checkpoint import CheckpointOptions
from runtime.data import sample_batch
from runtime.launch import build_trainer  # imported here, not in each forked rank: fast
from runtime.model.layers import RMSNorm
from runtime.model.transformer import StageModule, lm_loss
from runtime.train import autocast, train
from tests.runtime.tiny_plans import hand_plan, tiny_model, tiny_spec

# |loss_bf16 - loss_fp32| per step over these tests' 6-8 steps of the tiny model (losses
# 5.8 -> 4.5): bf16 keeps 8 bits of mantissa (relative rounding 2^-9 per operand); measured
# 0.8e-3 to 3.1e-3 on this machine (printed with -s); the bound leaves 3x
TOLERANCE = 0.01


def test_plan_precision_follows_the_plans_dtype():
    opts = RunOptions("p.json", precision="plan")
    assert [opts.compute_dtype({"dtype": d}) for d in ("bf16", "fp8", "mxfp8", "fp32")] == [
        "bf16",
        "bf16",
        "bf16",
        "fp32",
    ]
    assert opts.compute_dtype({}) == "fp32"  # a plan without a dtype: fp32
    assert RunOptions("p.json", precision="bf16").compute_dtype({"dtype": "fp32"}) == "bf16"
    assert RunOptions("p.json").compute_dtype({"dtype": "bf16"}) == "bf16"  # default: plan


@pytest.mark.parametrize("gemm", ["grouped", "loop"])
def test_bf16_and_fp16_gemms_with_fp32_master_weights_follow_the_fp32_curve(gemm):
    spec = tiny_spec(pp=1, dp=1, ep=1, ranks_per_node=1, steps=8, layers=3)
    curves, seen = {}, []
    for dtype in ("fp32", "bf16", "fp16"):
        model = StageModule(spec.model, range(3), True, True, seed=spec.seed)
        for moe in model.moe_layers().values():
            moe.experts.gemm = gemm
            moe.experts.register_forward_hook(lambda m, i, out: seen.append(out.dtype))
        opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
        curves[dtype] = []
        for step in range(spec.steps):
            opt.zero_grad()
            x, y = sample_batch(step, 0, 1, 4, spec.seq_len, spec.seed)
            with autocast(torch.device("cpu"), dtype):
                loss = lm_loss(model(x), y)
            loss.backward()
            opt.step()
            curves[dtype].append(float(loss.detach()))
        assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights
        assert all(p.grad.dtype == torch.float32 for p in model.parameters())
        assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())
    assert set(seen) == {torch.float32, torch.bfloat16, torch.float16}  # experts ran in each
    for dtype in ("bf16", "fp16"):
        diffs = [abs(a - b) for a, b in zip(curves["fp32"], curves[dtype], strict=True)]
        print(f"max |{dtype} - fp32| loss", max(diffs))
        assert 0 < max(diffs) < TOLERANCE, diffs
        assert curves[dtype][-1] < curves[dtype][0] - 0.5  # and it trains


def test_the_expert_weights_are_cast_once_per_step_and_recast_after_the_update():
    """Experts.operands: the micro-batches of a step share one bf16 copy of the expert
    weights (autocast's cache does not see them); Adam's in-place step makes a new one."""
    spec = tiny_spec(pp=1, dp=1, ep=1, ranks_per_node=1, steps=1, layers=2)
    model = StageModule(spec.model, range(2), True, True, seed=spec.seed)
    experts = model.blocks[1].moe.experts
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    copies = []
    experts.register_forward_hook(lambda m, i, out: copies.append(m.operands(out.dtype)["w_in"]))
    x, y = sample_batch(0, 0, 1, 4, spec.seq_len, spec.seed)
    with autocast(torch.device("cpu"), "bf16"):
        for xc, yc in zip(x.chunk(2), y.chunk(2), strict=True):
            (lm_loss(model(xc), yc) / 2).backward()
    assert copies[0] is copies[1] and copies[0].dtype == torch.bfloat16
    assert torch.equal(copies[0], experts.w_in.detach().to(torch.bfloat16))
    assert experts.w_in.grad.dtype == torch.float32 and experts.w_in.grad.abs().sum() > 0
    opt.step()
    with autocast(torch.device("cpu"), "bf16"):
        model(x[:2])
    assert copies[2] is not copies[0]
    assert torch.equal(copies[2], experts.w_in.detach().to(torch.bfloat16))  # the new weights


def test_a_bf16_norm_keeps_bf16_x_and_fp32_statistics_and_its_gradients_follow_fp64():
    """RMSNorm of bf16 activations saves x in bf16 and 1 / rms in fp32 (one per row), not fp32
    copies of x; output and gradients against autograd through the fp64 formula."""
    torch.manual_seed(0)
    x = torch.randn(4, 6, 32).to(torch.bfloat16).requires_grad_()
    norm = RMSNorm(32, 1e-6)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = norm(x)
    assert y.dtype == torch.bfloat16
    shapes = {(t.dtype, tuple(t.shape)) for t in saved}
    assert shapes == {
        (torch.bfloat16, (4, 6, 32)),
        (torch.float32, (32,)),
        (torch.float32, (4, 6, 1)),
    }
    grad_y = torch.randn(4, 6, 32).to(torch.bfloat16)
    y.backward(grad_y)
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + 1e-6) * w64
    y64.backward(grad_y.double())
    # bf16 outputs: one rounding, relative 2^-9; grad_x subtracts, so an absolute term too
    torch.testing.assert_close(y.double(), y64, rtol=2**-8, atol=0)
    atol = 2**-8 * float(x64.grad.abs().max())
    torch.testing.assert_close(x.grad.double(), x64.grad, rtol=2**-8, atol=atol)
    assert norm.weight.grad.dtype == torch.float32  # fp32 sums of bf16 products
    torch.testing.assert_close(norm.weight.grad.double(), w64.grad, rtol=1e-5, atol=1e-5)


_COLLECTIVES = (
    "all_to_all_single",
    "all_gather",
    "all_gather_single",
    "reduce_scatter_single",
    "all_reduce",
    "batch_isend_irecv",
)


@contextlib.contextmanager
def wire_dtypes():
    """The (collective, dtype) pairs of the floating-point tensors this process hands to
    torch.distributed's collectives and point-to-point batches while inside."""
    seen: set[tuple[str, str]] = set()

    def tensors(value):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, dist.P2POp):
            yield value.tensor
        elif isinstance(value, (list, tuple)):
            for v in value:
                yield from tensors(v)

    def wrap(name, fn):
        def call(*args, **kwargs):
            for t in tensors([*args, *kwargs.values()]):
                if t.is_floating_point():
                    seen.add((name, str(t.dtype).removeprefix("torch.")))
            return fn(*args, **kwargs)

        return call

    originals = {name: getattr(dist, name) for name in _COLLECTIVES}
    try:
        for name, fn in originals.items():
            setattr(dist, name, wrap(name, fn))
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _kinds(line: dict) -> dict[str, int]:
    """A metrics line's bytes by kind, intra- and inter-node summed."""
    out: dict[str, int] = {}
    for key, n in line["bytes_by_kind"].items():
        kind = key.rsplit("_", 1)[0]
        out[kind] = out.get(kind, 0) + n
    return out


def _fp32_and_bf16_body(rank, world, spec):
    """The same run in fp32, then in bf16: (losses, last step's bytes by kind) from rank 0
    and this rank's wire dtypes, per dtype."""
    out = {}
    for dtype in ("fp32", "bf16"):
        trainer = build_trainer(spec, rank, compute_dtype=dtype)
        with wire_dtypes() as seen:
            files = train(trainer).files
        lines = [json.loads(x) for x in files.get("metrics.jsonl", "").splitlines()]
        losses = [d["loss"] for d in lines]
        out[dtype] = (losses, _kinds(lines[-1]) if lines else {}, seen)
    return out


def _hand_spec(dp=1, tp=1, ep=1, etp=1, pp=1, fsdp=False, model=None, rpn=2, **options):
    model = model or tiny_model(layers=3)
    plan = hand_plan(
        model, pp, dp, ep, micro_batch=2, num_microbatches=2, seq_len=32, gpus_per_node=rpn,
        tp=tp, etp=etp, fsdp=fsdp,
    )  # fmt: skip
    return run_spec_from_plan(plan, model, 1.0, rpn, steps=6, **options)


def _vocab_loss_bytes(spec) -> int:
    """Bytes the vocab-parallel cross entropy sends per step, all ranks (fp32 in both runs):
    three ring all-reduces of one fp32 number per token of each micro-batch."""
    n, tokens = spec.tp, spec.micro_batch * spec.seq_len
    return int(3 * 2 * (n - 1) / n * 4 * tokens) * spec.num_microbatches * n * spec.dp


BF16, FP32 = "bfloat16", "float32"
# layout -> (spec, collective -> dtypes of its floating-point payloads in the bf16 run,
# kinds whose bytes halve exactly, kinds whose bytes stay equal)
LAYOUTS = {
    "pp2": (
        lambda: _hand_spec(pp=2),
        {"batch_isend_irecv": {BF16}},
        ["p2p"],
        [],
    ),
    "pp2-mtp": (
        lambda: _hand_spec(pp=2, model=replace(tiny_model(layers=3), num_mtp_layers=1)),
        {"batch_isend_irecv": {BF16, FP32}},  # fp32: the embedding copies' gradients
        ["p2p"],
        ["grad_embedding"],
    ),
    "dp2-ep2-flat": (
        lambda: _hand_spec(dp=2, ep=2, dispatcher="flat"),
        {"all_to_all_single": {BF16}, "all_reduce": {FP32}},
        [],
        ["grad_dense"],  # ep = dp: no expert-DP group
    ),
    "dp2-ep2-halo-dedup": (
        lambda: _hand_spec(dp=2, ep=2, rpn=1, dispatcher="halo-dedup", halo_direct_below_bytes=0),
        {"batch_isend_irecv": {BF16}, "all_reduce": {FP32}},  # its phases, not the direct path
        [],
        ["grad_dense"],
    ),
    "tp2-sp": (
        lambda: _hand_spec(tp=2),
        {"all_gather": {BF16}, "reduce_scatter_single": {BF16}, "all_reduce": {FP32}},
        [],
        ["grad_tp"],
    ),
    "dp2-etp2": (
        lambda: _hand_spec(dp=2, etp=2),
        {"all_gather": {BF16}, "reduce_scatter_single": {BF16}, "all_reduce": {FP32}},
        [],
        ["grad_dense"],
    ),
    "dp2-fsdp": (
        lambda: _hand_spec(dp=2, fsdp=True),
        {"all_gather_single": {BF16}, "reduce_scatter_single": {FP32}},
        ["param_gather"],
        ["grad_dense", "grad_expert"],
    ),
}


@pytest.mark.slow
@pytest.mark.usefixtures("corpus")
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_bf16_follows_fp32_with_bf16_activations_and_fp32_gradients_on_the_wire(
    run_distributed, layout
):
    make_spec, wire, halved, equal = LAYOUTS[layout]
    spec = make_spec()
    results = run_distributed(_fp32_and_bf16_body, spec.world, spec, timeout_s=120)
    fp32_losses, fp32_bytes, _ = results[0]["fp32"]
    losses, bf16_bytes, _ = results[0]["bf16"]
    diffs = [abs(a - b) for a, b in zip(losses, fp32_losses, strict=True)]
    print(layout, "max |bf16 - fp32| loss", max(diffs))
    assert len(losses) == spec.steps and 0 < max(diffs) < TOLERANCE, diffs
    assert losses[-1] < losses[0] - 0.3  # and it trains
    seen: dict[str, set[str]] = {}
    for rank in results:
        for name, dtype in rank["bf16"][2]:
            seen.setdefault(name, set()).add(dtype)
    assert seen == wire  # every floating-point payload, by collective
    assert all(dtype == FP32 for r in results for _, dtype in r["fp32"][2])
    for kind in halved:  # shapes fixed by the micro-batch: exactly half
        assert fp32_bytes[kind] > 0 and bf16_bytes[kind] * 2 == fp32_bytes[kind], kind
    for kind in equal:  # gradient reductions in fp32
        assert fp32_bytes[kind] > 0 and bf16_bytes[kind] == fp32_bytes[kind], kind
    if spec.tp > 1:  # the activations' collectives halve; the loss's fp32 all-reduces do not
        assert 2 * bf16_bytes["tp"] - fp32_bytes["tp"] == _vocab_loss_bytes(spec)


def _resume_body(rank, world, spec, first, root):
    """bf16: `spec` straight; `first` saving a checkpoint at its end; `spec` resumed."""

    def run(s, options):
        trainer = build_trainer(s, rank, compute_dtype="bf16")
        return train(trainer, checkpoints=options).losses

    straight = run(spec, None)
    run(first, CheckpointOptions(root, first.steps, False))
    return straight, run(spec, CheckpointOptions(root, 0, True))


@pytest.mark.slow
@pytest.mark.usefixtures("corpus")
def test_a_bf16_run_resumed_from_its_checkpoint_equals_the_uninterrupted_run(
    run_distributed, tmp_path
):
    """The checkpoint holds the fp32 master weights and moments; the bf16 operands are
    rounded from them again, so the resumed losses are the straight run's bit for bit."""
    spec = _hand_spec(dp=2, ep=2, dispatcher="flat")
    first = replace(spec, steps=3)
    results = run_distributed(_resume_body, 2, spec, first, str(tmp_path), timeout_s=120)
    for straight, resumed in results:
        assert len(resumed) == spec.steps - first.steps
        assert resumed == straight[first.steps :]
    straight = results[0][0]
    assert straight[-1] is not None and straight[-1] < straight[0]
