"""`piper plan` when nothing fits names only fixes that fit: issue 27's Mixtral-8x7B at
sequence 32,768 on 8 H100s was told --fsdp, which at dp = 1 shards nothing and fails."""

from __future__ import annotations

from tests.hardening_cli import run_piper


def test_mixtral_32k_on_8_h100s_is_told_the_gpus_that_fit_not_fsdp(tmp_path):
    out = tmp_path / "out"
    result = run_piper(["plan", "--model", "mixtral-8x7b", "--cluster", "h100", "--gpus", "8",
                        "--seq-len", "32768", "--out", str(out)])  # fmt: skip
    assert result.code == 2
    lines = result.stderr.splitlines()
    # refused from the memory floor before the search: 46.7B parameters x 18 B on 8 GPUs
    assert len(lines) == 1 and lines[0].startswith(
        "piper plan: error: plan: mixtral-8x7b cannot fit on 8 GPUs of h100: its weights, "
        "gradients and optimizer state (46.7B parameters x 18 B) need 97.9 GiB per GPU"
    )
    assert lines[0].endswith("; try more GPUs (--gpus 16)") and "--fsdp" not in lines[0]
    assert not out.exists()
