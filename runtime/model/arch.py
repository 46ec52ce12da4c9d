"""The model's numerics as the runtime's layers take them: RoPE, norm epsilon, router, activation.

`ModelArch`, `RopeSpec` and their one parser, `arch_from_hf_config`, live in the planner
(planner/inputs/numerics.py, with the transformers conventions they follow), because plan.json
carries the numerics keys of the model's config (`model.numerics`) and the planner, which
never imports the runtime, writes and checks them. The runtime's modules (attention, rope, moe,
transformer, hf_weights) import them from here. Which ModelArch a run builds (the plan's
numerics, `--hf-weights`' config.json, or `ModelArch()`) is decided with its RunSpec
(planner/run/spec.py, `run_arch`) and recorded as `RunSpec.arch` / `arch_source`.
"""

from planner.inputs.numerics import (
    ModelArch,
    RopeKind,
    RopeSpec,
    RouterKind,
    arch_from_hf_config,
    rope_from_hf_config,
    yarn_mscale,
)

__all__ = [
    "ModelArch",
    "RopeKind",
    "RopeSpec",
    "RouterKind",
    "arch_from_hf_config",
    "rope_from_hf_config",
    "yarn_mscale",
]
