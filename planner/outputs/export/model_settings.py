"""The training settings of a model that its shapes leave out, for the exports to carry.

A plan made by `piper plan` embeds them (plan.json's `model.settings`, planner.plan.settings:
rotary base and scaling, norm epsilon, the router's score function, group-limited routing,
the routed scaling factor, the expert bias and the load-balancing loss, QK norm, NoPE layers,
chunked attention, the activation clamp), so an export reads plan.json alone: the same plan
exports the same bytes wherever its config file went.

A hand-written plan without `model.settings` takes them from the config it names: its
`source` (a preset or a config file), else a preset of its `name`. When its `source` cannot
be read (the file moved or was deleted) the export is refused in one line, since the family's
defaults would silently train another model; a plan that names no config gets the family's
defaults (`source` is then "", and the Megatron export says so in a note).

`model_settings(plan, model)` is the entry point.
"""

from __future__ import annotations

from planner.inputs.models import resolve_model
from planner.plan.check import one_line
from planner.plan.schema import Plan
from planner.plan.settings import ModelSettings, RopeScaling, settings_of_config
from planner.specs import ModelSpec, SpecError

__all__ = ["ModelSettings", "RopeScaling", "model_settings"]


def model_settings(plan: Plan, model: ModelSpec) -> ModelSettings:
    """The settings of `plan`'s model: plan.json's `model.settings`, else read from the
    config the plan names (see the module docstring).

    Raises:
        SpecError: one line naming the config and the fix when a plan without settings names
            a config that cannot be read, or one with a key of the wrong type.
    """
    if plan.model.settings is not None:
        return plan.model.settings
    source = plan.model.source
    if source:
        try:
            cfg, _, read = resolve_model(source.removeprefix("preset:"))
        except SpecError as exc:
            raise SpecError(one_line(
                f"plan.json has no model.settings (rotary, norm, router) and its model "
                f"'{source[:80]}' cannot be read ({str(exc)[:120]}); re-run 'piper plan' to "
                "embed them, or put the config back"
            )) from None  # fmt: skip
        return settings_of_config(cfg, model, read)
    try:
        cfg, _, read = resolve_model(plan.model.name) if plan.model.name else ({}, "", "")
    except SpecError:  # a name that is a label, not a preset
        cfg, read = {}, ""
    return settings_of_config(cfg, model, read)
