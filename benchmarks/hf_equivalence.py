"""How far the runtime's one-stage model is from Hugging Face `transformers`, per family.

For each tiny config of tests/runtime/model/test_hf_equivalence.py (the HF model saved with
save_pretrained, the runtime's model built and loaded from that directory), runs one batch
through both in fp32 on the CPU and prints: the largest |logit| and |logit difference|, the
loss difference, the share of (token, MoE layer) pairs routed to the same expert set; and,
side by side, the largest logit difference when the runtime computes with its own numerics
(ModelArch(): RoPE theta 1e4, softmax top-k renormalised, plain SwiGLU) instead of the
family's, which says how much each family's conventions matter.

Usage: OMP_NUM_THREADS=1 python3 benchmarks/hf_equivalence.py [--seed 0]
What it prints goes to results/hf_equivalence.md (--results FILE elsewhere, --no-results not).
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from results_md import recorded

from runtime.model.arch import ModelArch
from runtime.model.hf_weights import hf_model, load_hf_weights
from runtime.model.transformer import StageModule, lm_loss
from tests.runtime.model.test_hf_equivalence import CONFIGS, hf_reference, route_recorder, tokens


def _runtime(path: str, arch: ModelArch | None) -> tuple[StageModule, list]:
    spec, family_arch = hf_model(path)
    module = StageModule(spec, range(spec.num_layers), True, True, arch=arch or family_arch)
    load_hf_weights(module, path, spec.family)
    chosen: list = []
    for moe in module.moe_layers().values():
        moe.router.register_forward_hook(lambda m, i, out: chosen.append(out[0]))
    return module, chosen


def compare(name: str, seed: int) -> str:
    """One table row for config `name`."""
    hf = hf_reference(name, seed)
    ids = tokens()
    with tempfile.TemporaryDirectory() as path:
        hf.save_pretrained(path)
        theirs_chosen = route_recorder(hf)
        with torch.no_grad():
            ref = hf(input_ids=ids, labels=ids)
            ours, ours_chosen = _runtime(path, None)
            logits = ours(ids)
            own_eps = hf_model(path)[1].norm_eps  # the runtime's numerics, the family's eps
            plain, _ = _runtime(path, ModelArch(norm_eps=own_eps))
            plain_logits = plain(ids)
    same = total = 0
    for mine, other in zip(ours_chosen, theirs_chosen, strict=True):
        equal = (mine.sort(dim=-1).values == other.sort(dim=-1).values).all(dim=-1)
        same, total = same + int(equal.sum()), total + equal.numel()
    loss = lm_loss(logits[:, :-1], ids[:, 1:]).item()
    off, plain_off = (logits - ref.logits).abs().max(), (plain_logits - ref.logits).abs().max()
    return (
        f"{name:27s} {ref.logits.abs().max().item():9.3f} {off.item():12.2e} "
        f"{abs(loss - ref.loss.item()):10.2e} {100.0 * same / max(total, 1):8.1f}% "
        f"{plain_off.item():14.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--results", default="results/hf_equivalence.md")
    parser.add_argument("--no-results", action="store_true")
    args = parser.parse_args()
    title = "The runtime's model vs transformers, per family (fp32, CPU)"
    with recorded(args.results, title, enabled=not args.no_results):
        import transformers

        print(
            f"transformers {transformers.__version__}, torch {torch.__version__}; tiny configs "
            f"of tests/runtime/model/test_hf_equivalence.py, seed {args.seed}; batch "
            f"{tuple(tokens().shape)}; the test demands logits to rtol = atol = 1e-5"
        )
        print(
            f"{'config':27s} {'max|logit|':>9s} {'max|dlogit|':>12s} {'|dloss|':>10s} "
            f"{'same set':>9s} {'own numerics':>14s}"
        )
        for name in CONFIGS:
            print(compare(name, args.seed))


if __name__ == "__main__":
    main()
