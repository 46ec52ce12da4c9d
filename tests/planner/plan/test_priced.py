"""A plan runs as priced or is refused: `piper run` (Piper's runtime) checks the plan against
its own row of planner/targets.py, as the exports check theirs."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.plan.priced import check_priced
from planner.run.spec import run_spec_from_plan
from planner.specs import SpecError, TrainingSpec
from tests.planner.outputs.export_plans import make_plan, priced_for


def test_piper_runs_its_own_plans_and_refuses_megatrons_at_full_size():
    plan = make_plan()
    assert check_priced(plan, "piper").name == "piper"
    run_spec_from_plan(plan, plan.model_spec())
    mega = priced_for(replace(make_plan(zero=True)), "megatron")
    with pytest.raises(SpecError, match="router weights.*re-plan with --target piper"):
        run_spec_from_plan(mega, mega.model_spec())
    run_spec_from_plan(mega, mega.model_spec(), scale=0.5)  # a rehearsal: not the priced run


def test_piper_runs_mtp_layers():  # runtime/model/mtp.py
    plan = make_plan()
    plan = replace(plan, training={**plan.training, "mtp_layers": 1})
    assert check_priced(plan, "piper").name == "piper"
    assert run_spec_from_plan(plan, plan.model_spec()).model.num_mtp_layers == 1


@pytest.mark.parametrize(
    ("training", "extra", "words"),
    [
        ({"zero": True}, {}, "priced with the distributed optimizer"),
        ({"a2a_overlap": True}, {}, "1F1B all-to-all overlap"),
        ({"cuda_graphs": "partial"}, {}, r"CUDA graphs \(partial\)"),
        ({}, {"dispatcher": "deepep"}, "deepep dispatcher"),
    ],
)
def test_piper_refuses_each_setting_its_runtime_does_not_run(training, extra, words):
    plan = make_plan()
    plan = replace(plan, training={**plan.training, **training}, extra={**plan.extra, **extra})
    with pytest.raises(SpecError, match=words) as err:
        check_priced(plan, "piper")
    assert "\n" not in str(err.value) and "re-plan with --target piper" in str(err.value)


def test_fsdp_reduce_dtype_must_be_the_engines():
    """FSDP2 (torchtitan, Piper's runtime) reduce-scatters fp32 gradients, Megatron-FSDP the
    model's bf16 ones: an FSDP plan priced with the other is refused in one line."""
    fsdp = replace(make_plan(), training={**make_plan().training, "fsdp": True})
    titan = priced_for(fsdp, "torchtitan")
    assert check_priced(titan, "torchtitan").name == "torchtitan"
    megatron_priced = priced_for(fsdp, "megatron")
    bf16 = replace(titan, training={**titan.training, "fsdp_reduce_dtype": None})
    with pytest.raises(SpecError, match="FSDP reduce-scattering gradients in the gradient dtype"):
        check_priced(bf16, "torchtitan")
    with pytest.raises(SpecError, match="reduce-scattering gradients in fp32.*--target megatron"):
        check_priced(replace(megatron_priced, training={**megatron_priced.training,
                                                        "fsdp_reduce_dtype": "fp32"}),
                     "megatron")  # fmt: skip
    with pytest.raises(SpecError, match="fsdp_reduce_dtype 'fp16' is unknown"):
        TrainingSpec(seq_len=128, global_batch=8, fsdp=True, fsdp_reduce_dtype="fp16")
