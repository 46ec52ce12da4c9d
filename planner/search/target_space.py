"""The search space a target engine executes: the user's choices cut to the target's table.

`target_choices` takes what the user fixed or left to the search (planner.cli.plan's flags)
and returns what the search may try for one target (planner.targets.Target): a choice the
user fixed that the engine cannot run is one SpecError line naming the flag and the fix; a
searched choice keeps only the engine's values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from planner.parallel import BUDGET_MODULES, ParallelConfig
from planner.resources.op_sac import OP
from planner.search.space import RECOMPUTE_CHOICES
from planner.specs import SpecError, TrainingSpec
from planner.targets import Target, check_training, etp_allowed, refuse

# the memory budgets the search tries beside the target's selective set
SEARCHED_BUDGETS = ("budget:0.1", "budget:0.25", "budget:0.5")


@dataclass(frozen=True)
class TargetChoices:
    """What the search may vary for one target (None = searched, as in make_space)."""

    fixed: dict[str, int | None]
    recompute: tuple[str, ...] | None
    recompute_modules: tuple[str, ...] | None  # the user's modules (None = searched)
    module_set: tuple[str, ...] | None  # the only selective set the target reruns (None = any)
    sharding: tuple[str, ...]
    a2a_overlap: bool | None
    dispatchers: tuple[str, ...]
    etp_rule: str
    budget_sets: tuple[tuple[str, ...], ...] = ()  # memory budgets searched beside module_set


def target_choices(
    target: Target,
    fixed: Mapping[str, int | None],
    recompute: Sequence[str] | None,
    recompute_modules: Sequence[str] | None,
    sharding: Sequence[str],
    a2a_overlap: bool | None,
    dispatchers: Sequence[str],
    user_dispatchers: bool,
) -> TargetChoices:
    """Cut the search's choices to what `target` executes.

    Args:
        fixed: sizes the user fixed (pp, dp, tp, ep, micro_batch, vp, cp, etp; None =
            searched).
        recompute, recompute_modules: the user's policies and modules (None = searched).
        sharding: the sharding choices left by --zero/--fsdp (planner.search.space).
        a2a_overlap: the user's overlap (None = searched).
        dispatchers: the dispatchers to try; user_dispatchers: the user named them.
    """
    out = dict(fixed)
    for name, able in (("vp", target.vp), ("cp", target.cp)):
        value = out.get(name)
        if not able and value not in (None, 1):
            raise SpecError(
                f"--{name} {value}: {target.engine} {target.version} does not run {name} > 1; "
                f"drop --{name} or use --target megatron"
            )
        if not able:
            out[name] = 1
    for policy in recompute or ():
        refuse(target, "--recompute", policy, "recompute")
    searched = tuple(p for p in RECOMPUTE_CHOICES if p in target.recompute)
    policies = tuple(recompute) if recompute else searched
    modules = _modules(target, recompute_modules)
    # the distributed optimizer's place is taken by plain data parallelism where the
    # engine has none (its optimizer state is then replicated)
    wanted = [("none" if s == "zero" and "zero" not in target.sharding else s) for s in sharding]
    kept = tuple(dict.fromkeys(s for s in wanted if s in target.sharding))
    if not kept:
        refuse(target, "--zero/--fsdp", sharding[0], "sharding")
    if a2a_overlap and not target.a2a_overlap:
        raise SpecError(
            f"--a2a-overlap: {target.engine} {target.version} does not overlap the MoE "
            "all-to-all; drop --a2a-overlap or use --target megatron"
        )
    overlap = a2a_overlap if target.a2a_overlap else False
    if user_dispatchers:
        for d in dispatchers:
            refuse(target, "--dispatcher", d, "dispatchers")
    tried = tuple(d for d in dispatchers if d in target.dispatchers) or ("flat",)
    searched_set = target.recompute_modules[:1] if target.recompute_modules else None
    # the memory budgets are searched beside the target's set unless the user fixed modules
    runs = target.recompute_modules or ()
    budgets = tuple((m,) for m in SEARCHED_BUDGETS if m in runs) if modules is None else ()
    return TargetChoices(out, policies, modules, searched_set, kept, overlap, tried,
                         target.etp_rule, budgets)  # fmt: skip


def _modules(target: Target, given: Sequence[str] | None) -> tuple[str, ...] | None:
    """The user's selective modules, each one the target reruns (None = searched); "op"
    (torchtitan's per-op SAC) and a memory budget only for a target that runs them, alone."""
    runs = target.recompute_modules or ()
    budgets = [m for m in given or () if m in BUDGET_MODULES]
    if budgets and budgets[0] not in runs:
        raise SpecError(
            f"--memory-budget {budgets[0].split(':')[1]}: torchtitan's memory-budget AC; "
            f"{target.engine} {target.version} does not run it; drop it or use --target "
            "torchtitan"
        )
    if given is not None and OP in given:
        if OP not in runs:
            raise SpecError(
                f"--recompute-modules {','.join(given)}: 'op' is torchtitan's per-op selective "
                f"AC; {target.engine} {target.version} does not run it; drop it or use "
                "--target torchtitan"
            )
        if len(given) > 1:
            raise SpecError(
                f"--recompute-modules {','.join(given)}: 'op' covers the whole layer; give "
                "--recompute-modules op alone"
            )
    if target.recompute_modules is None or given is None:
        return tuple(given) if given is not None else None
    extra = [m for m in given if m not in target.recompute_modules]
    if extra:
        raise SpecError(
            f"--recompute-modules {','.join(extra)}: {target.engine} reruns only "
            f"{_named(target)} under selective recompute; drop them or use --target megatron"
        )
    return tuple(given)


def check_layout_for(
    target: Target, training: TrainingSpec, par: ParallelConfig, dispatcher: str
) -> None:
    """Refuse one fixed layout (`piper estimate`) that `target` cannot run, in one line."""
    check_training(training, target)
    sharding = "fsdp" if training.fsdp else "zero" if training.zero else "none"
    fixed = {"vp": par.vp, "cp": par.cp}
    modules = par.selective_modules if par.recompute == "selective" else None
    recompute = None if par.recompute == "none" else [par.recompute]
    target_choices(
        target, fixed, recompute, modules, [sharding], training.a2a_overlap or None,
        [dispatcher], True,
    )  # fmt: skip
    if sharding not in target.sharding:
        refuse(target, "--zero/--fsdp", sharding, "sharding")
    if not etp_allowed(target.etp_rule, par.etp, par.tp, par.ep):
        raise SpecError(
            f"--etp {par.etp}: {target.engine} {target.version} runs expert TP equal to the "
            f"attention TP ({par.tp}) without expert parallelism and 1 with it (ep={par.ep}); "
            f"change --etp or use --target megatron"
        )
    if target.recompute_modules is not None and par.recompute == "selective" and not modules:
        raise SpecError(
            f"--recompute selective: give --recompute-modules {_named(target)} for {target.engine}"
        )


def _named(target: Target) -> str:
    """The target's selective modules as a user names them (a budget as --memory-budget)."""
    mods = [m for m in target.recompute_modules or () if m not in BUDGET_MODULES]
    budget = len(mods) < len(target.recompute_modules or ())
    return ",".join(mods) + (" (or --memory-budget B)" if budget else "")


def with_target_modules(target: Target, par: ParallelConfig) -> ParallelConfig:
    """`par` with the target's one selective module set when the user recomputes selectively
    without naming modules (torchtitan: "op", its per-op SAC; Piper: core attention)."""
    if par.recompute != "selective" or par.recompute_modules or not target.recompute_modules:
        return par
    return replace(par, recompute_modules=target.recompute_modules[:1])  # type: ignore[arg-type]
