"""The published measurements of exactly a plan's setting: model, hardware family, GPU count,
precision, sequence length and global batch must all match, from both runs files."""

from __future__ import annotations

from planner.search.recipes import published_for


def ids(*setting) -> list[str]:
    return [p.recipe.row_id for p in published_for(*setting)]


def test_every_field_of_the_setting_must_match():
    h100 = ("H100 SXM5 80GB", "h100")
    assert ids("qwen3-30b-a3b", h100, 16, "fp8", 4096, 1024) == ["103", "35", "102", "101", "104"]
    assert ids("qwen3-30b-a3b", h100, 16, "fp8", 4096, 512) == ["105"]  # the 25.11 table's batch
    assert ids("qwen3-30b-a3b", h100, 16, "bf16", 4096, 1024) == []
    assert ids("qwen3-30b-a3b", h100, 32, "fp8", 4096, 1024) == []
    assert ids("qwen3-30b-a3b", h100, 16, "fp8", 8192, 1024) == []
    assert ids("qwen3-30b-a3b", ("B200", "b200"), 16, "fp8", 4096, 1024) == []
    assert ids("qwen3-30b-a3b", ("GB200", "gb200-nvl72"), 8, "mxfp8", 4096, 512)[:2] == [
        "131", "135"]  # fmt: skip


def test_measurements_are_as_published_with_their_release():
    [first, *_] = published_for("qwen3-30b-a3b", ("H100",), 16, "fp8", 4096, 1024)
    assert (first.recipe.tokens_per_s_per_gpu, first.release, first.file) == (
        9058.0, "26.02.01", "holdout_runs.csv")  # fmt: skip
    assert (first.recipe.pp, first.recipe.vp, first.recipe.ep) == (2, 12, 8)
