"""A safetensors index from others cannot make Piper open files outside the checkpoint folder
(planner/HARDENING.md, "Hostile files"): `piper run --hf-weights DIR` and the runtime's loader
refuse a shard named by an absolute path, through '..', or by a symlink that leaves the
folder, in one line; the Hugging Face cache's snapshot links into its blobs still load."""

from __future__ import annotations

import json
import os

import pytest

from planner.inputs.models import load_model
from planner.run.hf_checkpoint import INDEX, check_hf_checkpoint, weight_files
from planner.specs import SpecError


def _checkpoint(folder, shards: dict[str, str]):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "mixtral"}))
    (folder / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": shards}))
    return folder


def _one_line(fn, *needles):
    with pytest.raises(SpecError) as err:
        fn()
    text = str(err.value)
    assert "\n" not in text and len(text) < 400, text
    for needle in needles:
        assert needle in text, (needle, text)


@pytest.mark.parametrize(
    "shard", ["../../etc/passwd", "/etc/passwd", "sub/../../outside.safetensors"]
)
def test_a_shard_outside_the_folder_is_refused(tmp_path, shard):
    (tmp_path / "outside.safetensors").write_bytes(b"x")
    folder = _checkpoint(tmp_path / "ckpt", {"model.embed_tokens.weight": shard})
    tiny = load_model("tiny-moe")
    _one_line(lambda: check_hf_checkpoint(str(folder), tiny, 1.0),
              f"--hf-weights {folder}", "outside the checkpoint folder")  # fmt: skip
    _one_line(lambda: weight_files(folder, str(folder)), "outside the checkpoint folder")


def test_a_symlinked_shard_that_leaves_the_folder_is_refused(tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("not weights")
    folder = _checkpoint(tmp_path / "ckpt", {"a": "model-00001.safetensors"})
    os.symlink(secret, folder / "model-00001.safetensors")
    _one_line(lambda: weight_files(folder, "--hf-weights ckpt"), "links to", str(secret))


def test_the_runtime_loader_refuses_it_too(tmp_path):
    pytest.importorskip("safetensors")
    from runtime.model.hf_weights import _Tensors

    folder = _checkpoint(tmp_path / "ckpt", {"a": "../../../../../../etc/passwd"})
    _one_line(lambda: _Tensors(folder), "outside the checkpoint folder")


def test_shards_inside_and_hugging_face_cache_links_are_read(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt", {"a": "m-2.safetensors", "b": "m-1.safetensors",
                                             "c": "m-2.safetensors"})  # fmt: skip
    for name in ("m-1.safetensors", "m-2.safetensors"):
        (folder / name).write_bytes(b"x")
    assert weight_files(folder, "w") == ("m-1.safetensors", "m-2.safetensors")
    repo = tmp_path / "hub" / "models--org--name"
    snap = _checkpoint(repo / "snapshots" / "abc123", {"a": "model-00001-of-00001.safetensors"})
    (repo / "blobs").mkdir()
    (repo / "blobs" / "deadbeef").write_bytes(b"x")
    os.symlink("../../blobs/deadbeef", snap / "model-00001-of-00001.safetensors")
    assert weight_files(snap, "w") == ("model-00001-of-00001.safetensors",)


def test_a_shard_that_is_a_fifo_or_missing_is_refused(tmp_path):
    folder = _checkpoint(tmp_path / "ckpt", {"a": "fifo.safetensors", "b": "none.safetensors"})
    os.mkfifo(folder / "fifo.safetensors")
    _one_line(lambda: weight_files(folder, "w"), "a FIFO")
    os.unlink(folder / "fifo.safetensors")
    (folder / "fifo.safetensors").write_bytes(b"x")
    _one_line(lambda: weight_files(folder, "w"), "none.safetensors")
