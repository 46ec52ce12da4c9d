"""Multi-token prediction (runtime/model/mtp.py) against the formula written out by hand.

Oracles: DeepSeek-V3's MTP loss (arXiv 2412.19437 section 2.2) as Megatron-Core computes it
(embedding first in the concatenation, a final norm per module, the last k positions of
module k dropped, lambda = 0.1 over D), in plain torch from the model's weights, gives the
runtime's loss and every gradient; MTP leaves the main model's logits bitwise unchanged;
2-rank runs (ep = 2; pp = 2 with the last stage's embedding copy) give the single-device
gradients of every weight, the MTP modules' included, and log the MTP losses beside the
main loss. transformers' DeepSeek-V3 has no MTP, so there is no Hugging Face oracle.
"""

from __future__ import annotations

import copy
import json
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from planner.run.spec import run_spec_from_plan
from runtime.model.transformer import StageModule
from tests.runtime.tiny_plans import hand_plan, tiny_model, tiny_spec

LAMBDA = 0.1  # Megatron-Core's mtp_loss_scaling_factor default


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_loss(model: StageModule, tokens_BS1: torch.Tensor):
    """(objective, main CE, [CE_k]) of tokens t_0 .. t_S from the model's weights: the main
    model's layers run as they are (Blocks are checked elsewhere); the MTP math by hand."""
    x, s = tokens_BS1[:, :-1], tokens_BS1.shape[1] - 1
    emb, head = model.embed.weight, model.head.weight
    h = emb[x]
    for block in model.blocks:
        h = block(h)
    h = _rms(h, model.norm.weight)
    main = F.cross_entropy((h @ head.T).flatten(0, 1), tokens_BS1[:, 1:].flatten())
    ces = []
    for k, m in enumerate(model.mtp, start=1):
        ids = torch.zeros_like(x)
        ids[:, : s - k] = tokens_BS1[:, k:s]  # t_{i+k}; the last k positions have no target
        joined = torch.cat([_rms(emb[ids], m.enorm.weight), _rms(h, m.hnorm.weight)], dim=-1)
        h = _rms(m.block(joined @ m.eh_proj.weight.T), m.final_norm.weight)
        logits = (h @ head.T)[:, : s - k]
        ces.append(F.cross_entropy(logits.flatten(0, 1), tokens_BS1[:, k + 1 :].flatten()))
    return main + LAMBDA / len(ces) * sum(ces), main, ces


def _mtp_model(depth: int, **changes):
    return replace(tiny_model(), num_mtp_layers=depth, **changes)


@pytest.mark.parametrize("depth", [1, 2])
def test_loss_and_gradients_equal_the_hand_written_formula(depth):
    model = StageModule(_mtp_model(depth), range(4), True, True, seed=4)
    ref = copy.deepcopy(model)
    tokens = torch.randint(0, 256, (2, 17), generator=torch.Generator().manual_seed(depth))
    loss = model.loss(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    want, main, ces = reference_loss(ref, tokens)
    want.backward()
    torch.testing.assert_close(loss, want, rtol=1e-6, atol=1e-6)
    got_main, got_ces = model.loss_parts[-1]
    torch.testing.assert_close(got_main, main.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(got_ces, torch.stack(ces).detach(), rtol=1e-6, atol=1e-6)
    grads = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert sum(n.startswith("mtp.") for n in names) >= depth * 5  # norms, eh_proj, block
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-6, atol=1e-6, msg=name)
    assert all(model.mtp[k].eh_proj.weight.grad.abs().sum() > 0 for k in range(depth))


def test_mtp_leaves_the_main_model_bitwise_and_a_too_short_sequence_scores_nothing():
    tokens = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(0))
    on = StageModule(_mtp_model(2), range(4), True, True, seed=2)
    off = StageModule(tiny_model(), range(4), True, True, seed=2)
    logits, _ = on(tokens)
    assert torch.equal(logits, off(tokens))
    assert on.moe_layers().keys() == {1, 2, 3, 4, 5}  # the MTP blocks are MoE like layer 3
    short = tokens[:, :2]  # S = 2: depth 1 scores position 0 against t_2, depth 2 nothing
    on.loss(on(short), tokens[:, 1:3])
    assert on.loss_parts[-1][1][1] == 0.0 and on.loss_parts[-1][1][0] > 0.0


def test_tied_embedding_feeds_the_head_and_the_mtp_input():
    model = StageModule(_mtp_model(1, tie_word_embeddings=True), range(4), True, True, seed=1)
    ref = copy.deepcopy(model)
    assert model.head.weight is model.embed.weight
    tokens = torch.randint(0, 256, (2, 13), generator=torch.Generator().manual_seed(5))
    model.loss(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    reference_loss(ref, tokens)[0].backward()
    torch.testing.assert_close(model.embed.weight.grad, ref.embed.weight.grad, rtol=1e-6, atol=1e-6)


def _named_grads(module) -> dict:
    """Gradients by whole-model name: embedding (either copy), dense weights, experts by id
    (FSDP shards gathered)."""
    from runtime.parallel.pipeline import chunks_of
    from tests.runtime.parallel.grads import _whole

    out = {}
    for chunk in chunks_of(module):
        experts = {id(p) for m in chunk.moe_layers().values() for p in m.experts.parameters()}
        for name, p in chunk.named_parameters():
            if id(p) in experts:
                continue
            if name.startswith("mtp_embed."):
                name = "embed." + name.split(".", 1)[1]
            if name.startswith("blocks."):
                _, i, rest = name.split(".", 2)
                name = f"layer{chunk.layer_ids[int(i)]}.{rest}"
            out[name] = _whole(p.grad)
        for layer, moe in chunk.moe_layers().items():
            for pname, p in moe.experts.named_parameters():
                whole = _whole(p.grad)
                for slot, e in enumerate(moe.experts.expert_ids):
                    out[f"layer{layer}.expert{e}.{pname}"] = whole[slot]
    return out


def _step_body(rank: int, world: int, spec):
    from runtime.data import sample_batch
    from runtime.launch import build_trainer
    from runtime.parallel.pipeline import sync_gradients

    tr = build_trainer(spec, rank, torch.device("cpu"))
    batch = spec.micro_batch * spec.num_microbatches
    x, y = sample_batch(0, tr.mesh.me.dp_idx, spec.dp, batch, spec.seq_len, spec.seed)
    tr.optimizer.zero_grad(set_to_none=False)
    loss = tr.runner.step(x, y)
    sync_gradients(tr.module, tr.mesh, spec.dp, tr.counter)
    return loss, tr.runner.mtp_losses, _named_grads(tr.module), tr.mesh.me.tp_idx


def _single_device(spec):
    """The whole model on the global batch, each micro-batch's objective / (dp m)."""
    from runtime.data import sample_batch

    model = StageModule(spec.model, range(spec.model.num_layers), True, True, seed=spec.seed)
    batch, m = spec.micro_batch * spec.num_microbatches, spec.num_microbatches
    for j in range(spec.dp):
        x, y = sample_batch(0, j, spec.dp, batch, spec.seq_len, spec.seed)
        for xc, yc in zip(x.chunk(m), y.chunk(m), strict=True):
            (model.loss(model(xc), yc) / (spec.dp * m)).backward()
    return model, _named_grads(model)


@pytest.mark.slow
@pytest.mark.usefixtures("corpus")
@pytest.mark.parametrize(
    ("pp", "dp", "tp", "ep", "fsdp"),
    [(1, 2, 1, 2, False), (2, 1, 1, 1, False), (1, 2, 1, 2, True), (1, 1, 2, 2, False)],
    ids=["ep2", "pp2", "ep2-fsdp", "tp2-ep2"],
)
def test_two_ranks_give_the_single_device_gradients(run_distributed, pp, dp, tp, ep, fsdp):
    model = _mtp_model(1)
    plan = hand_plan(model, pp, dp, ep, 2, 2, seq_len=16, gpus_per_node=2, tp=tp, fsdp=fsdp)
    spec = run_spec_from_plan(plan, model, 1.0, 2, steps=1)
    assert spec.model.num_mtp_layers == 1 and spec.fsdp == fsdp
    model, ref = _single_device(spec)
    results = run_distributed(_step_body, spec.world, spec, timeout_s=120)
    seen = set()
    for _, _, grads, tp_idx in results:
        for name, got in grads.items():
            want = ref[name]
            if got.shape != want.shape:  # a TP shard: its slice of the differing axis
                axis = [g != w for g, w in zip(got.shape, want.shape, strict=True)].index(True)
                want = np.split(want, tp, axis=axis)[tp_idx]
            np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6, err_msg=name)
            seen.add(name)
    assert seen == set(ref)
    assert any(n.startswith("mtp.0.block.moe") for n in seen)
    # the last stage reports the main CE and CE_1: the single-device loss_parts' means
    main = float(torch.stack([p[0] for p in model.loss_parts]).mean())
    depth = float(torch.stack([p[1][0] for p in model.loss_parts]).mean())
    last = [r for r in results if r[0] is not None]
    for loss, mtp, _, _ in last:
        assert loss == pytest.approx(main, rel=1e-5) if dp == 1 else loss is not None
        assert len(mtp) == 1 and (dp > 1 or mtp[0] == pytest.approx(depth, rel=1e-5))


def _reference_training(spec) -> list[tuple[float, float]]:
    """(main CE, CE_1) per step of the single-device model trained with Adam on the global
    batch (every dp rank's), each the mean over all micro-batches (the logged metrics)."""
    from runtime.data import sample_batch

    model = StageModule(spec.model, range(spec.model.num_layers), True, True, seed=spec.seed)
    opt = torch.optim.Adam(model.parameters(), lr=spec.lr)
    batch, m, out = spec.micro_batch * spec.num_microbatches, spec.num_microbatches, []
    for step in range(spec.steps):
        opt.zero_grad()
        model.loss_parts.clear()
        for j in range(spec.dp):
            x, y = sample_batch(step, j, spec.dp, batch, spec.seq_len, spec.seed)
            for xc, yc in zip(x.chunk(m), y.chunk(m), strict=True):
                (model.loss(model(xc), yc) / (spec.dp * m)).backward()
        opt.step()
        main, depth = zip(*model.loss_parts, strict=True)
        out.append((float(torch.stack(main).mean()), float(torch.stack(depth).mean())))
    return out


@pytest.mark.slow
@pytest.mark.usefixtures("corpus")
def test_piper_run_logs_the_mtp_loss_beside_the_main_loss(run_distributed):
    from planner.migration.trace import trace_from_text, trace_rows
    from tests.runtime.tiny_plans import train_body

    spec = tiny_spec(2, 1, 1, ranks_per_node=2, steps=3, seq_len=16)
    spec = replace(spec, model=replace(spec.model, num_mtp_layers=1))
    files = run_distributed(train_body, spec.world, spec, timeout_s=120)[0][1]
    lines = [json.loads(x) for x in files["metrics.jsonl"].splitlines()]
    want = _reference_training(spec)
    assert [d["loss"] for d in lines] == pytest.approx([w[0] for w in want], rel=1e-4)
    assert [d["mtp_losses"] for d in lines] == [pytest.approx([w[1]], rel=1e-4) for w in want]
    # the MTP block routes every token like a layer: trace layer 4 (after plan layers 0-3)
    per_layer: dict = {}
    for interval, layer, _e, tokens in trace_rows(trace_from_text(files["trace.csv"])):
        per_layer[(interval, layer)] = per_layer.get((interval, layer), 0) + tokens
    tokens = spec.tokens_per_step * spec.model.top_k
    assert per_layer == {(s, i): tokens for s in range(3) for i in (1, 2, 3, 4)}


def _with_mtp_weights(path, n: int) -> dict:
    """Rewrite checkpoint `path` (a tiny DeepSeek-V3 of n layers) with one MTP module:
    config num_nextn_predict_layers 1, layer n = a copy of layer n - 1's tensors plus drawn
    enorm, hnorm, eh_proj and shared_head norm / head. Returns the drawn tensors."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(path / "model.safetensors"))
    last, pre = f"model.layers.{n - 1}.", f"model.layers.{n}."
    tensors |= {pre + k[len(last) :]: v.clone() for k, v in tensors.items() if k.startswith(last)}
    gen = torch.Generator().manual_seed(11)
    d = tensors["model.norm.weight"].shape[0]
    drawn = {
        f"{pre}enorm.weight": 1 + 0.2 * torch.randn(d, generator=gen),
        f"{pre}hnorm.weight": 1 + 0.2 * torch.randn(d, generator=gen),
        f"{pre}eh_proj.weight": torch.randn(d, 2 * d, generator=gen) / d,
        f"{pre}shared_head.norm.weight": 1 + 0.2 * torch.randn(d, generator=gen),
        f"{pre}shared_head.head.weight": tensors["lm_head.weight"].clone(),
    }
    save_file(tensors | drawn, str(path / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return drawn


def test_deepseek_mtp_weights_load_into_the_mtp_module(tmp_path, caplog):
    from runtime.model.hf_weights import hf_model, load_hf_weights
    from tests.runtime.model.test_hf_equivalence import hf_reference

    hf = hf_reference("deepseek_v3")
    hf.save_pretrained(tmp_path)
    n = hf.config.num_hidden_layers
    drawn = _with_mtp_weights(tmp_path, n)
    spec, arch = hf_model(tmp_path)
    assert spec.num_mtp_layers == 1
    module = StageModule(spec, range(n), True, True, arch=arch)
    load_hf_weights(module, tmp_path, spec.family)
    mtp = module.mtp[0]
    pre = f"model.layers.{n}."
    assert torch.equal(mtp.enorm.weight, drawn[f"{pre}enorm.weight"])
    assert torch.equal(mtp.hnorm.weight, drawn[f"{pre}hnorm.weight"])
    assert torch.equal(mtp.eh_proj.weight, drawn[f"{pre}eh_proj.weight"])
    assert torch.equal(mtp.final_norm.weight, drawn[f"{pre}shared_head.norm.weight"])
    # the block holds layer n - 1's tensors, the copy the checkpoint was given
    main = dict(module.blocks[-1].named_parameters())
    for name, p in mtp.block.named_parameters():
        assert torch.equal(p, main[name]), name
    assert module.moe_layers()[n].router.bias_E.equal(module.moe_layers()[n - 1].router.bias_E)
    # a checkpoint without them (transformers' save_pretrained): initial weights, one warning
    hf.save_pretrained(tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (tmp_path / "plain" / "config.json").write_text(json.dumps(config))
    fresh = StageModule(spec, range(n), True, True, arch=arch)
    initial = copy.deepcopy(fresh.mtp.state_dict())
    with caplog.at_level("WARNING"):
        load_hf_weights(fresh, tmp_path / "plain", spec.family)
    assert all(torch.equal(v, initial[k]) for k, v in fresh.mtp.state_dict().items())
    assert f"no MTP weights {pre}*" in caplog.text


@pytest.mark.slow
@pytest.mark.usefixtures("corpus")
def test_migration_moves_the_mtp_layers_experts_and_trains_like_one_device(run_distributed):
    from tests.runtime.tiny_plans import rotate_policy, train_body

    spec = tiny_spec(1, 2, 2, ranks_per_node=2, steps=5, seq_len=16, migrate_every=2)
    spec = replace(spec, model=replace(spec.model, num_mtp_layers=1))
    results = run_distributed(train_body, spec.world, spec, -1, rotate_policy, timeout_s=120)
    lines = [json.loads(x) for x in results[0][1]["metrics.jsonl"].splitlines()]
    want = _reference_training(spec)
    assert [d["loss"] for d in lines] == pytest.approx([w[0] for w in want], rel=1e-4)
    assert [d["mtp_losses"][0] for d in lines] == pytest.approx([w[1] for w in want], rel=1e-4)
    # every expert of the 3 MoE layers and of the MTP layer moves at steps 1 and 3
    assert [d["migrated_experts"] for d in lines] == [0, 32, 0, 32, 0]
    assert results[0][3][4] == results[0][3][3]  # placed and moved like the last layer


@pytest.mark.slow
@pytest.mark.usefixtures("corpus")
def test_a_resume_trains_the_mtp_modules_bitwise_like_a_straight_run(run_distributed, tmp_path):
    from tests.runtime.test_checkpoint import _body

    def spec_of(steps):
        spec = tiny_spec(2, 1, 1, ranks_per_node=2, steps=steps, seq_len=16)
        return replace(spec, model=replace(spec.model, num_mtp_layers=1))

    straight = run_distributed(_body, 2, spec_of(6), None, timeout_s=120)
    run_distributed(_body, 2, spec_of(3), (str(tmp_path), 0, False), timeout_s=120)
    resumed = run_distributed(_body, 2, spec_of(6), (str(tmp_path), 0, True), timeout_s=120)

    def metrics(results):
        lines = [json.loads(x) for x in results[0][1]["metrics.jsonl"].splitlines()]
        return [(d["loss"], d["mtp_losses"]) for d in lines]

    assert len(metrics(straight)) == 6
    assert metrics(resumed) == metrics(straight)  # the embedding copy and MTP layer restored
