"""Which numerics a run of a plan computes with: the plan's, a checkpoint's, or the runtime's.

A plan made by `piper plan` carries the numerics keys of the model's config.json
(`model.numerics`: RoPE theta and scaling, norm epsilon, router options;
planner/inputs/numerics.py); `piper run --hf-weights DIR` brings DIR/config.json. `run_arch`
turns them into the one ModelArch the RunSpec carries to every rank, parsed by the one parser
(arch_from_hf_config), and says where it came from, for `piper run`'s first line and run.json.
"""

from __future__ import annotations

from pathlib import Path

from planner.inputs.models import read_config_file
from planner.inputs.numerics import ModelArch, arch_from_hf_config, first_difference
from planner.plan import Plan
from planner.specs import ModelSpec, SpecError

DEFAULT_ARCH = "the runtime's default ModelArch() (the plan has no model.numerics)"
PLAN_ARCH = "plan.json model.numerics"


def run_arch(plan: Plan, hf_weights: str | None = None) -> tuple[ModelArch, str]:
    """The run's ModelArch and where it comes from (RunSpec.arch, arch_source).

    The plan's `model.numerics` when it has them; the config.json of `hf_weights` (a
    save_pretrained directory) when given; both: they must agree; neither: ModelArch().
    Raises:
        SpecError: one line naming the key where the two disagree, or a key of the wrong type.
    """
    numerics = dict(plan.model.numerics)
    planned = arch_from_hf_config(numerics, "model.numerics") if numerics else None
    if hf_weights is None:
        return (planned, PLAN_ARCH) if planned is not None else (ModelArch(), DEFAULT_ARCH)
    config = Path(hf_weights) / "config.json"
    if not config.is_file():
        raise SpecError(f"--hf-weights {hf_weights}: no config.json; point it at a "
                        "save_pretrained directory")  # fmt: skip
    loaded = arch_from_hf_config(read_config_file(config), str(config))
    if planned is None:
        return loaded, f"--hf-weights {config}"
    differ = first_difference(loaded, planned)
    if differ is not None:
        key, theirs, ours = differ
        raise SpecError(
            f"--hf-weights {hf_weights}: {key} is {theirs!r} in its config.json but "
            f"{ours!r} in the plan's model.numerics; plan with --model {config}, or leave "
            "--hf-weights out"
        )
    return planned, f"{PLAN_ARCH} (= --hf-weights {config})"


def check_arch(arch: ModelArch, model: ModelSpec, source: str) -> None:
    """Refuse (one SpecError line naming the key) a group-limited router the model's MoE layers
    cannot split: n_group must divide the experts, topk_group <= n_group, and the kept groups
    must hold top-k experts (DeepSeek-V3's choice, runtime/model/moe.py)."""
    if arch.num_groups <= 1:
        return
    groups, keep = arch.num_groups, arch.topk_groups
    for i in model.moe_layers:
        moe = model.layers[i].moe
        assert moe is not None
        per_group = moe.num_experts // groups
        if moe.num_experts % groups or not 1 <= keep <= groups or keep * per_group < moe.top_k:
            raise SpecError(
                f"{source}: n_group={groups}, topk_group={keep} do not fit layer {i}'s "
                f"{moe.num_experts} experts, top-{moe.top_k} (n_group must divide them, "
                "topk_group <= n_group and the kept groups hold top-k experts); fix the keys"
            )
