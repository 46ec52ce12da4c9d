"""Tensor parallelism in the runtime: sharded layers, token slices, and whole runs with tp = 2
that must train exactly like the single-device oracle (same model, same global batch)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from planner.calibrate.metrics import parse_metrics
from planner.migration.trace import trace_from_text, trace_rows
from planner.run.spec import run_spec_from_plan
from planner.specs import SpecError
from runtime.parallel.mesh import rank_coords
from runtime.parallel.tensor_parallel import chunk_sizes, shard_linear
from tests.runtime.tiny_plans import hand_plan, reference_losses, tiny_model, train_body

pytestmark = pytest.mark.usefixtures("corpus")  # forked ranks inherit the loaded corpus

STEPS = 12


class _FakeTP:  # the slicing helpers read only size and index
    def __init__(self, size: int, index: int) -> None:
        self.size, self.index = size, index


def test_chunk_sizes_cover_every_token_once():
    assert chunk_sizes(10, 4) == [3, 3, 2, 2]
    assert chunk_sizes(3, 4) == [1, 1, 1, 0]
    for rows in range(0, 40):
        for parts in (1, 2, 3, 8):
            sizes = chunk_sizes(rows, parts)
            assert sum(sizes) == rows and max(sizes) - min(sizes) <= 1


def test_column_and_row_shards_rebuild_the_whole_layer():
    torch.manual_seed(0)
    col = torch.nn.Linear(6, 8, bias=True)
    row = torch.nn.Linear(8, 6, bias=True)
    x = torch.randn(5, 6)
    shards = [(shard_linear(col, _FakeTP(2, i), 0, 4), _FakeTP(2, i)) for i in range(2)]
    # column parallel: the shards' outputs side by side are the whole layer's output
    assert torch.allclose(torch.cat([s(x) for s, _ in shards], dim=1), col(x), atol=1e-6)
    # row parallel: the partial products over the input halves sum to the whole product
    h = col(x)
    parts = []
    for i in range(2):
        r = shard_linear(row, _FakeTP(2, i), 1)
        assert r.weight.shape == (6, 4) and torch.equal(r.bias, row.bias)
        parts.append(torch.nn.functional.linear(h[:, 4 * i : 4 * i + 4], r.weight))
    assert torch.allclose(sum(parts) + row.bias, row(h), atol=1e-6)
    with pytest.raises(ValueError, match="tp=2"):
        shard_linear(torch.nn.Linear(6, 9), _FakeTP(2, 0), 0, 3)  # 3 heads over 2 ranks


def _collectives_body(rank: int, world: int):
    """A TP group whose plan order is not the sorted order, with uneven token slices."""
    import torch.distributed as dist

    from runtime.parallel.tensor_parallel import TPGroup

    ranks = [2, 0, 1]  # plan position -> physical rank
    tp = TPGroup(dist.group.WORLD, ranks, ranks.index(rank), tokens=5, seq_len=5)
    mine = torch.full((tp.sizes[tp.index], 2), float(tp.index))
    gathered = tp.all_gather_rows(mine)
    partial = torch.arange(10.0).reshape(5, 2) * (rank + 1)  # sums to 6x over the group
    return tp.index, tp.sizes, gathered.numpy(), tp.reduce_scatter_rows(partial).numpy()


@pytest.mark.slow
def test_gather_and_reduce_scatter_follow_the_plan_order(run_distributed):
    whole = torch.arange(10.0).reshape(5, 2) * 6
    for index, sizes, gathered, scattered in run_distributed(_collectives_body, 3):
        assert sizes == [2, 2, 1]
        # slices in plan order: plan position i's rows hold i
        assert gathered[:, 0].tolist() == [0.0, 0.0, 1.0, 1.0, 2.0]
        start = sum(sizes[:index])
        assert scattered.tolist() == whole[start : start + sizes[index]].tolist()


def _spec(pp, dp, tp, ep, g, model=None, **options):
    model = model or tiny_model()
    plan = hand_plan(
        model, pp, dp, ep, micro_batch=2, num_microbatches=2, seq_len=32, gpus_per_node=g, tp=tp
    )
    return run_spec_from_plan(plan, model, 1.0, g, steps=STEPS, **options)


def test_coordinates_with_tensor_parallelism():
    spec = _spec(pp=2, dp=2, tp=2, ep=2, g=4)
    assert spec.world == 8 and spec.edp == 2
    coords = rank_coords(spec)
    for c in coords:  # Megatron order: r = stage * (dp * tp) + dp_idx * tp + tp_idx
        assert c.logical == c.stage * 4 + c.dp_idx * 2 + c.tp_idx
        j = c.dp_idx * 2 + c.tp_idx
        assert (c.ep_idx, c.edp_idx) == (j % 2, j // 2)
    # an EP group is the two TP ranks of one data-parallel replica here
    groups: dict = {}
    for c in coords:
        groups.setdefault((c.stage, c.edp_idx), []).append((c.dp_idx, c.tp_idx))
    assert all(len({d for d, _ in g}) == 1 for g in groups.values())


def test_widths_that_tp_does_not_divide_are_refused():
    model = tiny_model()  # 4 heads, 2 kv heads
    plan = hand_plan(model, 1, 1, 1, gpus_per_node=4, tp=4)
    with pytest.raises(SpecError, match="tp=4 does not divide layer 0's num_kv_heads"):
        run_spec_from_plan(plan, model, 1.0, 4)
    # a shrunk model keeps its kv heads a multiple of tp
    from planner.inputs.models import load_model

    mixtral = load_model("mixtral-8x7b")  # 8 kv heads -> 1 at 1/8 scale, 2 with tp = 2
    spec = run_spec_from_plan(hand_plan(mixtral, 4, 2, 4, tp=2), mixtral, 0.125, 4)
    att = spec.model.layers[0].attention
    assert (att.num_kv_heads, att.num_heads) == (2, 8) and spec.tp == 2


def _featureful_model():
    """tiny_model with every replicated-but-partial weight: q/k norms, biases, router bias,
    a gated shared expert."""
    base = tiny_model(layers=3)
    layers = []
    for layer in base.layers:
        att = replace(layer.attention, bias=True, o_bias=True, qk_norm=True)
        moe = layer.moe and replace(layer.moe, router_bias=True, shared_gate=True)
        layers.append(replace(layer, attention=att, moe=moe))
    return replace(base, layers=tuple(layers))


def _check(spec, results):
    files = results[0][1]
    lines = parse_metrics(files["metrics.jsonl"])
    losses = [d["loss"] for d in lines]
    assert losses == pytest.approx(reference_losses(spec), rel=2e-3, abs=2e-3)
    # TP traffic is counted, and every routed token is counted once over the stage
    assert sum(v for k, v in lines[0]["bytes_by_kind"].items() if k.startswith("tp_")) > 0
    rows = trace_rows(trace_from_text(files["trace.csv"]))
    per_key: dict = {}
    for interval, layer, _e, tokens in rows:
        per_key[(interval, layer)] = per_key.get((interval, layer), 0) + tokens
    assert set(per_key.values()) == {spec.tokens_per_step * spec.model.top_k}
    return lines


def _expert_grads(module) -> dict:
    """(parameter name, expert id) -> gradient of that expert's slot."""
    out = {}
    for i, block in zip(module.layer_ids, module.blocks, strict=True):
        if block.moe is None:
            continue
        experts = block.moe.experts
        for pname, p in experts.named_parameters():
            for slot, e in enumerate(experts.expert_ids):
                out[(f"{i}.{pname}", e)] = p.grad[slot].numpy().copy()
    return out


def _grads_body(rank: int, world: int, spec):
    """One step's gradients after the gradient sync (no optimizer step), by parameter name,
    and the experts' by (name, expert id)."""
    from runtime.data import sample_batch
    from runtime.launch import build_trainer
    from runtime.parallel.pipeline import sync_gradients

    tr = build_trainer(spec, rank, torch.device("cpu"))
    batch = spec.micro_batch * spec.num_microbatches
    x, y = sample_batch(0, tr.mesh.me.dp_idx, spec.dp, batch, spec.seq_len, spec.seed)
    tr.runner.step(x, y)
    sync_gradients(tr.module, tr.mesh, spec.dp, tr.counter)
    named = tr.module.named_parameters()
    grads = {n: p.grad.numpy().copy() for n, p in named if "experts." not in n}  # no shm fds
    return tr.mesh.me.tp_idx, grads, _expert_grads(tr.module)


def _reference_grads(spec):
    from runtime.data import sample_batch
    from runtime.model.transformer import StageModule, lm_loss

    model = StageModule(spec.model, range(spec.model.num_layers), True, True, seed=spec.seed)
    batch, m = spec.micro_batch * spec.num_microbatches, spec.num_microbatches
    for j in range(spec.dp):
        x, y = sample_batch(0, j, spec.dp, batch, spec.seq_len, spec.seed)
        for xc, yc in zip(x.chunk(m), y.chunk(m), strict=True):
            (lm_loss(model(xc), yc) / (spec.dp * m)).backward()
    dense = {n: p.grad for n, p in model.named_parameters() if "experts." not in n}
    return dense, _expert_grads(model)


@pytest.mark.slow
@pytest.mark.parametrize(("dp", "recompute"), [(1, "none"), (2, "none"), (1, "full")])
def test_tp2_gradients_equal_the_single_device_gradients(run_distributed, dp, recompute):
    """Every gradient after the sync: a TP shard (the embedding's and head's vocabulary rows
    too) equals its slice of the oracle's gradient, a replicated weight (norms, router,
    biases) the whole of it, and each
    expert (EP over the TP pair, replicated over dp) its own; also with every layer
    recomputed (its TP collectives and all-to-alls rerun inside the backward)."""
    spec = _spec(pp=1, dp=dp, tp=2, ep=2, g=2, model=_featureful_model())
    if recompute != "none":
        spec = replace(spec, recompute=recompute, recompute_layers=(0, 1, 2))
    ref, ref_experts = _reference_grads(spec)
    sharded, experts_seen = 0, set()
    for tp_idx, grads, expert_grads in run_distributed(_grads_body, spec.world, spec):
        assert set(grads) == set(ref)
        for name, g in grads.items():
            g, want = torch.from_numpy(g), ref[name]
            if g.shape != want.shape:  # a shard: the dimension that differs is split
                dim = next(
                    i for i, (a, b) in enumerate(zip(g.shape, want.shape, strict=True)) if a != b
                )
                want = want.chunk(spec.tp, dim)[tp_idx]
                sharded += 1
            assert torch.allclose(g, want, rtol=1e-4, atol=1e-6), name
        for key, g in expert_grads.items():
            assert torch.allclose(torch.from_numpy(g), torch.from_numpy(ref_experts[key]),
                                  rtol=1e-4, atol=1e-6), key  # fmt: skip
            experts_seen.add(key)
    assert experts_seen == set(ref_experts)
    # per layer q, k, v (weight and bias) and o's weight; up, gate, down of the dense MLP
    # and of both shared experts; the embedding and head; on every rank
    assert sharded == spec.world * (3 * 7 + 3 + 2 * 3 + 2)


@pytest.mark.slow
def test_tp2_ep2_two_ranks_trains_like_the_oracle(run_distributed):
    spec = _spec(pp=1, dp=1, tp=2, ep=2, g=2, model=_featureful_model())
    _check(spec, run_distributed(train_body, spec.world, spec, timeout_s=240))


@pytest.mark.slow
def test_pp2_dp2_tp2_ep2_eight_ranks_trains_like_the_oracle(run_distributed):
    # pipeline x data x tensor x expert: EP groups are TP pairs, experts replicated over dp
    spec = _spec(pp=2, dp=2, tp=2, ep=2, g=4, dispatcher="flat")
    lines = _check(spec, run_distributed(train_body, spec.world, spec, timeout_s=300))
    # sequence parallelism: every TP rank sends its 1/tp slice of the activations between
    # stages, so the stages exchange exactly what they do without TP
    act = spec.micro_batch * spec.seq_len * spec.model.hidden_size * 4
    p2p = sum(v for k, v in lines[0]["bytes_by_kind"].items() if k.startswith("p2p"))
    assert p2p == act * spec.num_microbatches * 2 * spec.dp * (spec.pp - 1)
    # TP collectives, by hand: per layer and micro-batch, attention and each MLP (dense or
    # shared expert) gather before and reduce-scatter after, forward and backward (4 ring
    # passes each); the vocab-parallel embedding reduce-scatters forward and all-gathers
    # backward, the head gathers forward and reduce-scatters backward (2 passes each). A
    # pass sends (n-1)/n of [B S, D]. The cross entropy all-reduces 3 fp32 numbers per token
    # (max, sum of exponentials, target logit; 2 passes each).
    passes = 0
    for layers in spec.stage_layers:
        passes += 2
        for i in layers:
            layer = spec.model.layers[i]
            passes += 4 + 4 * bool(layer.dense_ffn) + 4 * bool(layer.moe and layer.moe.shared_ffn)
    per_pass = (spec.tp - 1) / spec.tp * act
    loss_passes = 3 * 2 * (spec.tp - 1) / spec.tp * spec.micro_batch * spec.seq_len * 4
    tp_bytes = sum(v for k, v in lines[-1]["bytes_by_kind"].items() if k.startswith("tp_"))
    per_rank = passes * per_pass + loss_passes
    assert tp_bytes == pytest.approx(per_rank * spec.dp * spec.tp * spec.num_microbatches, abs=64)


@pytest.mark.slow
def test_tp2_with_live_migration_keeps_every_expert_equal_to_the_oracle(run_distributed):
    """dp=2 x tp=2, ep=2 (EP over each TP pair, edp=2): rotate every 2 steps; the stage's
    decision is shared by all four ranks and the moved experts equal the oracle's."""
    from tests.runtime.tiny_plans import assert_experts_match_oracle, reference_run, rotate_policy

    spec = _spec(pp=1, dp=2, tp=2, ep=2, g=2, migrate_every=2)
    spec = replace(spec, steps=5)
    results = run_distributed(train_body, spec.world, spec, -1, rotate_policy, timeout_s=240)
    ref_losses, ref_model, ref_opt = reference_run(spec)
    lines = parse_metrics(results[0][1]["metrics.jsonl"])
    assert [d["loss"] for d in lines] == pytest.approx(ref_losses, rel=1e-4, abs=1e-4)
    assert [d["migrated_experts"] for d in lines] == [0, 24, 0, 24, 0]  # 3 MoE layers x 8
    assert_experts_match_oracle(results, ref_model, ref_opt, edp=2)


def _vocab_grads_body(rank: int, world: int, model, x, y):
    """Two TP ranks' loss and gradients of one vocab-parallel stage (embedding, the final
    norm and the head only), gradients summed over the group where partial."""
    import torch.distributed as dist

    from runtime.model.transformer import StageModule
    from runtime.parallel.tensor_parallel import TPGroup

    tp = TPGroup(dist.group.WORLD, list(range(world)), rank, x.numel(), x.shape[1])
    module = StageModule(model, [], True, True, tp=tp)
    logits = module(x)
    loss = module.loss(logits, y)
    loss.backward()
    for p in module.tp_partial_parameters():
        dist.all_reduce(p.grad)
    grads = {n: p.grad.numpy().copy() for n, p in module.named_parameters()}
    return loss.item(), tuple(logits.shape), grads


@pytest.mark.parametrize("tied", [False, True])
def test_vocab_parallel_embedding_head_and_loss_equal_one_device(run_distributed, tied):
    """tp = 2 over a vocabulary of 257 (ceil(257 / 2) = 129 rows a rank, one zero pad row on
    rank 1): the loss equals the single-device cross entropy and every gradient is the
    rank's rows of the single-device one (pad rows zero), untied and tied."""
    from runtime.model.transformer import StageModule, lm_loss
    from runtime.parallel.tensor_parallel import vocab_shard

    model = replace(tiny_model(layers=1), vocab_size=257, tie_word_embeddings=tied)
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(0, 257, (2, 8), generator=gen)
    y = torch.randint(0, 257, (2, 8), generator=gen)
    y[0, :3] = torch.tensor([0, 128, 256])  # the first and last id of each rank's rows
    ref = StageModule(model, [], True, True)
    ref_loss = lm_loss(ref(x), y)
    ref_loss.backward()
    ref_grads = dict(ref.named_parameters())
    results = run_distributed(_vocab_grads_body, 2, model, x, y)
    for rank, (loss, shape, grads) in enumerate(results):
        assert loss == pytest.approx(ref_loss.item(), rel=1e-6)
        assert shape == (2, 8, (129, 128)[rank])  # the real rows' logits
        assert set(grads) == set(ref_grads)
        for name, g in grads.items():
            want = ref_grads[name].grad
            if name != "norm.weight":  # embedding and head: this rank's rows, padded
                want = vocab_shard(want, _FakeTP(2, rank))
            assert torch.allclose(torch.from_numpy(g), want, rtol=1e-5, atol=1e-7), name
    assert "head.weight" not in results[0][2] if tied else "head.weight" in results[0][2]
