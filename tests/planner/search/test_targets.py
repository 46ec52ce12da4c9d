"""--target and --memory-margin: the search offers only what the engine runs, prices it with
the engine's conventions, and keeps the margin free on every stage."""

from __future__ import annotations

import pytest

from planner.cli import main
from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.ip.solvers import SolverOptions
from planner.search.make_plan import make_plan
from planner.search.target_space import target_choices
from planner.specs import SpecError, TrainingSpec
from planner.targets import TARGETS, memory_margin_gib

OPTS = SolverOptions("cpsat", 10.0, 1, 0)


def _plan(margin_gib: float, target: str = "megatron"):
    model, cluster = load_model("mixtral-8x7b"), load_cluster("h100")
    training = TrainingSpec(global_batch=256, memory_margin_gib=margin_gib)
    return make_plan(model, cluster, training, 16, None, OPTS, target=TARGETS[target]).plan


def test_the_margin_is_kept_free_on_every_stage():
    """Without a margin the plan fills memory to the last GiB; with 10 GiB every stage keeps
    10 GiB free, and plan.json records the margin and the target."""
    full, kept = _plan(0.0), _plan(10.0)
    assert max(full.predicted.memory_gib_per_stage) > 74.5 - 10.0
    assert max(kept.predicted.memory_gib_per_stage) <= 74.5 - 10.0
    assert kept.training["memory_margin_gib"] == 10.0 and kept.extra["target"] == "megatron"
    assert full.predicted.step_time_s < kept.predicted.step_time_s  # the margin costs speed


def test_megatron_plans_carry_its_conventions():
    plan = _plan(memory_margin_gib("4%", 74.5))
    tr = plan.training
    assert (tr["bytes_per_param"], tr["gate_in_activation"], tr["uniform_recompute"]) == (
        18, True, True,
    )  # fmt: skip
    if plan.parallel.recompute != "none":  # Megatron recomputes every layer of the policy
        assert all(s.recompute_layers == s.layers for s in plan.stages)
    assert plan.extra["dispatcher"] in TARGETS["megatron"].dispatchers


@pytest.mark.parametrize(
    ("target", "kwargs", "words"),
    [
        ("torchtitan", {"a2a_overlap": True}, "--a2a-overlap: torchtitan 0.3.0 does not"),
        ("megatron", {"dispatchers": ["halo"]}, "--dispatcher halo"),
        ("piper", {"fixed": {"cp": 2}}, "--cp 2: Piper's runtime"),
        ("piper", {"recompute_modules": ["moe"]}, "reruns only core_attn"),
        ("torchtitan", {"recompute_modules": ["core_attn"]}, "reruns only op"),
        ("megatron", {"recompute_modules": ["op"]}, "--recompute-modules op: 'op' is"),
    ],
)
def test_a_fixed_choice_the_target_cannot_run_is_one_line(target, kwargs, words):
    args = {"fixed": {}, "recompute": None, "recompute_modules": None,
            "sharding": ("zero", "fsdp"), "a2a_overlap": None, "dispatchers": ["flat"]}  # fmt: skip
    args.update(kwargs)
    user = "dispatchers" in kwargs
    with pytest.raises(SpecError, match=words) as err:
        target_choices(TARGETS[target], user_dispatchers=user, **args)
    assert "use --target" in str(err.value) or "choose another" in str(err.value)
    assert "\n" not in str(err.value)


def test_searched_choices_are_cut_to_the_target():
    args = {"fixed": {}, "recompute": None, "recompute_modules": None,
            "sharding": ("zero", "fsdp"), "a2a_overlap": None,
            "dispatchers": ["flat", "halo", "deepep"], "user_dispatchers": False}  # fmt: skip
    titan = target_choices(TARGETS["torchtitan"], **args)
    assert (titan.sharding, titan.a2a_overlap, titan.dispatchers) == (("fsdp",), False, ("flat",))
    assert titan.recompute == ("none", "full", "selective") and titan.module_set == ("op",)
    assert titan.etp_rule == "one_or_tp"
    piper = target_choices(TARGETS["piper"], **args)
    assert piper.sharding == ("none", "fsdp") and piper.dispatchers == ("flat", "halo")
    assert piper.module_set == ("core_attn",) and piper.fixed["cp"] == 1
    mega = target_choices(TARGETS["megatron"], **args)
    assert mega.sharding == ("zero", "fsdp") and mega.dispatchers == ("flat", "deepep")
    assert mega.a2a_overlap is None  # searched


@pytest.mark.parametrize(
    ("margin", "verdict"),
    [
        # 67 GiB fits 74.5 at the estimate, but the 80% interval's upper end (x1.34) does not
        (
            "0",
            "fits             at the estimate, with the 0.0 GiB memory margin kept free; "
            "the 80% interval's upper end 89.3 GiB on stage 0 exceeds 74.5 GiB: may not fit",
        ),
        ("12", "ONLY INSIDE THE MARGIN"),
        ("30%", "ONLY INSIDE"),
    ],
)
def test_estimate_says_plainly_whether_it_fits(margin, verdict, capsys):
    args = ["estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--dp", "16",
            "--ep", "16", "--global-batch", "1024", "--target", "megatron",
            "--memory-margin", margin]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out.replace("\n    ", " ")  # wrapped lines made whole
    assert verdict in out and "headroom         stage 0 7.8 GiB" in out


def test_estimate_does_not_fit_and_bad_margin(capsys):
    args = ["estimate", "--model", "qwen3-30b-a3b", "--cluster", "h100", "--dp", "16", "--ep",
            "16", "--global-batch", "1024", "--target", "piper"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "fits             NO: stage 0 needs 88.8 GiB > 74.5 GiB" in out
    assert main([*args, "--memory-margin", "lots"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--memory-margin lots: give GiB" in err


@pytest.mark.parametrize("command", ["plan", "estimate", "export"])
def test_help_of_every_command_with_target_flags_prints(command, capsys):
    """argparse formats help with %: a bare percent sign in a help text crashes --help."""
    with pytest.raises(SystemExit) as done:
        main([command, "--help"])
    assert done.value.code == 0
    assert "--target" in capsys.readouterr().out


def test_torchtitan_plans_only_the_models_it_builds(capsys):
    """torchtitan 0.3 builds its own models and, through the export's config module, GQA MoE
    models composed from its modules (Mixtral); another model (DBRX) is refused at plan and
    estimate time."""
    args = ["estimate", "--model", "dbrx", "--cluster", "h100", "--dp", "8", "--ep",
            "8", "--global-batch", "64", "--target", "torchtitan"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no model of its own for dbrx" in err
    assert "cannot compose it" in err
    assert main([*args[:2], "qwen3-30b-a3b", *args[3:]]) == 0
    assert main([*args[:2], "mixtral-8x7b", *args[3:]]) == 0


def test_torchtitan_expert_tp_follows_its_sharding_rule():
    """torchtitan 0.3 has no expert-TP degree: its experts are TP-sharded on the dense axis
    without expert parallelism (etp = tp) and sharded on the expert dimension with it
    (etp = 1); Megatron takes any etp."""
    from planner.search.enumerate import _expert_meshes
    from planner.search.space import SearchSpace
    from planner.targets import etp_allowed

    table = {(1, 2, 1): False, (2, 2, 1): True, (1, 2, 4): True, (2, 2, 4): False,
             (1, 1, 1): True, (1, 1, 8): True}  # (etp, tp, ep) -> runs  # fmt: skip
    for (etp, tp, ep), runs in table.items():
        assert etp_allowed("one_or_tp", etp, tp, ep) is runs, (etp, tp, ep)
        assert etp_allowed("any", etp, tp, ep)
    model = load_model("qwen3-30b-a3b")
    titan = _expert_meshes(model, 2, 1, 16, SearchSpace(gpus=32, etp_rule="one_or_tp"))
    assert titan and all(etp_allowed("one_or_tp", etp, 2, ep) for etp, ep in titan)
    assert (1, 1) not in titan and (2, 2) not in titan  # the two torchtitan does not run
    megatron = _expert_meshes(model, 2, 1, 16, SearchSpace(gpus=32))
    assert (1, 1) in megatron  # Megatron runs etp 1 without expert parallelism


def test_a_margin_that_leaves_nothing_after_the_overhead_is_refused(capsys, tmp_path):
    """h100: 74.5 GiB, 5.0 GiB framework overhead. A margin of 74 GiB would leave a negative
    usable memory: refused up front, one line naming the most it may be."""
    assert memory_margin_gib("69", 74.5, 5.0) == 69.0
    with pytest.raises(SpecError, match=r"--memory-margin 74: .* give less than 69\.5 GiB"):
        memory_margin_gib("74", 74.5, 5.0)
    with pytest.raises(SpecError, match="give less than 69.5 GiB"):
        memory_margin_gib("95%", 74.5, 5.0)
    out = tmp_path / "never"
    args = ["plan", "--model", "mixtral-8x7b", "--cluster", "h100", "--gpus", "32", "--out",
            str(out)]  # fmt: skip
    assert main([*args, "--memory-margin", "74"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "leave nothing" in err and not out.exists()
    # a margin that only crowds the layouts out is named among the fixes (checked by a search)
    assert main([*args, "--memory-margin", "60"]) == 2
    err = capsys.readouterr().err.strip()
    assert "try a smaller --memory-margin (now 60.0 GiB kept free)" in err and not out.exists()
