"""Files from others must not hang Piper or exhaust its memory (planner/HARDENING.md, "Hostile
files"): YAML alias bombs are refused before any value is built, values quoted in errors are
cut short, and a path is read only when it is a bounded regular file (no FIFO, device,
directory or kernel file)."""

from __future__ import annotations

import json
import os

import pytest

from planner.inputs.allocation import load_allocation
from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model, resolve_model
from planner.inputs.paths import CLUSTERS_DIR, MODELS_DIR, read_text_file
from planner.inputs.safe_read import MAX_TEXT_BYTES, read_input_bytes
from planner.inputs.slurm_topology import read_topology
from planner.specs import SpecError
from tests.hardening_cli import run_piper_process

MAX_LINE = 300  # characters of any error line


def _alias_bomb(levels: int = 7) -> list[str]:
    """YAML lines defining anchors x0..x{levels-1}: x{i} is nine aliases of x{i-1}, so the
    last stands for 9**levels strings (9**7 = 4.8 million) in a few hundred bytes."""
    lines = ["x0: &x0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    for i in range(1, levels):
        lines.append(f"x{i}: &x{i} [" + ", ".join([f"*x{i - 1}"] * 9) + "]")
    return lines


def _refused(fn, *needles: str) -> str:
    with pytest.raises(SpecError) as err:
        fn()
    text = str(err.value)
    assert "\n" not in text and len(text) <= MAX_LINE, (len(text), text[:400])
    for needle in needles:
        assert needle in text, (needle, text)
    return text


@pytest.mark.parametrize("levels", [7, 9])
def test_an_alias_bomb_in_a_cluster_file_is_refused(tmp_path, levels):
    """9 levels: 387 million strings from 1 KB (the reported 44-88 s, 2.3 GB bomb)."""
    f = tmp_path / "bomb.yaml"
    last = f"x{levels - 1}"
    f.write_text("\n".join(["name: bomb", *_alias_bomb(levels), f"device: *{last}"]) + "\n")
    assert f.stat().st_size < 2048
    _refused(lambda: load_cluster(str(f)), str(f), "aliases expand to more than 1,000,000")


def test_an_alias_bomb_in_a_model_file_is_refused(tmp_path):
    f = tmp_path / "bomb.yaml"
    f.write_text("\n".join(["model_type: mixtral", *_alias_bomb(), "num_hidden_layers: *x6"]))
    _refused(lambda: load_model(str(f)), str(f), "alias bomb")


def test_an_alias_bomb_in_a_topology_file_is_refused(tmp_path):
    f = tmp_path / "topology.yaml"
    f.write_text("\n".join([*_alias_bomb(), "topology: *x6"]) + "\n")
    _refused(lambda: read_topology(str(f)), str(f), "alias bomb")


def test_an_alias_bomb_in_an_allocation_is_refused(tmp_path):
    f = tmp_path / "alloc.yaml"
    f.write_text("\n".join([*_alias_bomb(), "nodes: *x6"]) + "\n")
    _refused(lambda: load_allocation(f), str(f), "alias bomb")


def test_aliases_within_the_bound_still_read(tmp_path):
    """Anchors are YAML users' way to share a block: a small expansion loads as written."""
    text = (CLUSTERS_DIR / "cpu-gloo.yaml").read_text()
    f = tmp_path / "shared.yaml"
    f.write_text(text + "calibration: &c {fitted_on: runs}\nextra_copy: *c\n")
    assert load_cluster(str(f)).levels == load_cluster("cpu-gloo").levels


@pytest.mark.parametrize(
    ("field", "value"),
    [("num_hidden_layers", [123456789] * 50_000), ("tie_word_embeddings", "y" * 1_000_000)],
    ids=["a list of 50,000 numbers", "a string of a million characters"],
)
def test_a_huge_value_in_a_model_config_is_cut_in_the_error(tmp_path, field, value):
    cfg = json.loads((MODELS_DIR / "mixtral-8x7b.json").read_text())
    f = tmp_path / "big.json"
    f.write_text(json.dumps({**cfg, field: value}))
    _refused(lambda: load_model(str(f)), field, "...")


def test_a_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    """Opening a FIFO for reading blocks until someone writes: the path is refused on stat."""
    fifo = tmp_path / "config.json"
    os.mkfifo(fifo)
    _refused(lambda: read_text_file(fifo, "model config"), "a FIFO", "file on disk")
    _refused(lambda: resolve_model(str(fifo)), str(fifo))


def test_piper_export_of_a_plan_that_is_a_fifo_ends_in_one_line(tmp_path):
    fifo = tmp_path / "plan.json"
    os.mkfifo(fifo)
    result = run_piper_process(["export", str(fifo), "--to", "megatron"], timeout_s=20)
    assert result.code == 2, result.stderr
    assert result.err_lines == [result.err_lines[0]] and "a FIFO" in result.err_lines[0]


@pytest.mark.parametrize("path", ["/dev/zero", "/dev/null", "/proc/self/status", "/proc/kmsg"])
def test_devices_and_kernel_files_are_refused(path):
    if not os.path.exists(path):
        pytest.skip(f"{path} does not exist here")
    _refused(lambda: read_input_bytes(path, "model config"), path)
    _refused(lambda: resolve_model(path), path)


def test_a_file_past_the_size_bound_is_refused_unread(tmp_path):
    big = tmp_path / "config.json"
    with big.open("wb") as fh:  # sparse: no disk used
        fh.truncate(MAX_TEXT_BYTES + 1)
    _refused(lambda: read_text_file(big, "model config"), "larger than 64 MiB")
    _refused(lambda: load_model(str(big)), str(big), "larger than 64 MiB")
