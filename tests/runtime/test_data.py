"""`piper run --data`: Megatron (.bin + .idx) and nanoGPT (.bin, optional .json) token files
the tests write, their one-line refusals (a .json or .idx that disagrees with its .bin too),
windows sharded by data-parallel rank as a function of the step, and a dp = ep = 2 run on
such a file equal to the single-device oracle."""

from __future__ import annotations

import json
import re
import struct
from dataclasses import replace

import numpy as np
import pytest
import torch

from planner.run.token_data import (
    MEGATRON_HEADER,
    check_windows,
    open_token_file,
    spec_for_data,
)
from planner.specs import SpecError
from runtime.data import TokenSampler, sample_windows
from runtime.launch import build_trainer  # imported here, not in each forked rank: fast
from runtime.train import train
from tests.runtime.tiny_plans import reference_losses, tiny_spec


def write_megatron(prefix, ids: np.ndarray, docs: int = 4) -> None:
    """PREFIX.bin + PREFIX.idx as Megatron-LM's _IndexWriter writes them (one sequence per
    document, equal lengths)."""
    ids.tofile(f"{prefix}.bin")
    code = {np.dtype(np.uint16): 8, np.dtype(np.int32): 4}[ids.dtype]
    lengths = np.full(docs, len(ids) // docs, dtype=np.int32)
    pointers = np.arange(docs, dtype=np.int64) * lengths[0] * ids.dtype.itemsize
    with open(f"{prefix}.idx", "wb") as f:
        f.write(MEGATRON_HEADER + struct.pack("<QBQQ", 1, code, docs, docs + 1))
        f.write(lengths.tobytes() + pointers.tobytes() + np.arange(docs + 1).tobytes())


def corpus_ids(n: int = 40_000) -> np.ndarray:
    """Text-like ids above the byte range: stdlib bytes, + 256 on every other word."""
    from runtime.data import load_corpus

    raw = load_corpus()[:n].numpy().astype(np.int64)
    word = np.cumsum(raw == ord(" ")) % 2
    return (raw + 256 * word).astype(np.uint16)


def test_both_layouts_are_read_with_their_dtype_and_vocabulary(tmp_path):
    ids = corpus_ids(4000)
    write_megatron(tmp_path / "mega", ids)
    mega = open_token_file(str(tmp_path / "mega"))
    assert (mega.dtype, mega.tokens, mega.vocab_size) == ("uint16", 4000, int(ids.max()) + 1)
    assert np.array_equal(mega.array(), ids)
    ids.astype(np.int32).tofile(tmp_path / "wide.bin")  # same ids, int32 per the index
    write_megatron(tmp_path / "wide", ids.astype(np.int32))
    assert np.array_equal(open_token_file(str(tmp_path / "wide.bin")).array(), ids)
    ids.tofile(tmp_path / "train.bin")  # nanoGPT: uint16, no index
    assert open_token_file(str(tmp_path / "train.bin")).dtype == "uint16"
    ids.astype(np.uint32).tofile(tmp_path / "big.bin")
    (tmp_path / "big.json").write_text(json.dumps({"dtype": "uint32", "vocab_size": 70_000}))
    big = open_token_file(str(tmp_path / "big.bin"))
    assert (big.dtype, big.tokens, big.vocab_size) == ("uint32", 4000, 70_000)


@pytest.mark.parametrize(
    "name, content, msg",
    [
        ("missing.bin", None, "not found; give a token .bin or a Megatron prefix"),
        ("odd.bin", b"\x01\x02\x03", "has 3 bytes, not a whole number of uint16"),
        ("badidx.bin", b"\x01\x00", "is not a Megatron index (no MMIDIDX header)"),
        ("over.bin", b"\x01\x00\xff\x00", "holds ids outside [0, 100); fix the file"),
        ("count.bin", b"\x01\x00\x02\x00", "counts 3 tokens, {bin} holds 2 uint16; the pair"),
        ("narrow.bin", b"\x01\x00", "says vocab_size 70000 in uint16, which holds ids below"),
        ("badjson.bin", b"\x01\x00", '"vocab_size": N}} (optional "tokens": N), N a positive'),
        ("shortidx.bin", b"\x01\x00" * 5, "counts 4 tokens, {bin} holds 5 uint16; the pair"),
    ],
)
def test_a_bad_token_file_is_one_line_naming_it(tmp_path, name, content, msg):
    path = tmp_path / name
    if content is not None:
        path.write_bytes(content)
    if name == "badidx.bin":
        path.with_suffix(".idx").write_bytes(b"NOTANINDEX" + bytes(30))
    side = {
        "over.bin": {"dtype": "uint16", "vocab_size": 100},
        "count.bin": {"dtype": "uint16", "vocab_size": 10, "tokens": 3},
        "narrow.bin": {"dtype": "uint16", "vocab_size": 70_000},
        "badjson.bin": {"dtype": "uint16", "vocab_size": "many"},
    }
    if name in side:
        path.with_suffix(".json").write_text(json.dumps(side[name]))
    if name == "shortidx.bin":  # a Megatron index of 2 x 2 tokens beside 5 tokens
        write_megatron(tmp_path / "other", np.arange(4, dtype=np.uint16), docs=2)
        (tmp_path / "other.idx").rename(path.with_suffix(".idx"))
    msg = msg.format(bin=path)
    with pytest.raises(SpecError, match=re.escape(msg)) as err:
        open_token_file(str(path))
    assert str(path.with_suffix("")) in str(err.value) and "\n" not in str(err.value)


def test_windows_are_the_dp_ranks_slice_and_a_function_of_the_step(tmp_path):
    positions = np.arange(10_000, dtype=np.uint32)  # each id is its own position
    positions.tofile(tmp_path / "pos.bin")
    (tmp_path / "pos.json").write_text('{"dtype": "uint32", "vocab_size": 10000}')
    tokens = open_token_file(str(tmp_path / "pos.bin")).array()
    for j in range(4):
        x, y = sample_windows(tokens, 7, j, 4, 8, 16, seed=3)
        assert x.dtype == torch.int64 and x.shape == (8, 16)
        assert ((x[:, 1:] - x[:, :-1]) == 1).all() and torch.equal(y, x + 1)  # contiguous
        assert (x >= j * 2500).all() and (y < (j + 1) * 2500).all()  # its own quarter
        again, _ = sample_windows(tokens, 7, j, 4, 8, 16, seed=3)
        assert torch.equal(x, again)  # the step decides: a resumed run draws the same
    assert not torch.equal(x, sample_windows(tokens, 8, 3, 4, 8, 16, seed=3)[0])
    with pytest.raises(SpecError, match="2500 per data-parallel rank, too few for sequences"):
        check_windows(open_token_file(str(tmp_path / "pos.bin")), 4, 4096)


def _body(rank, world, spec, path):
    trainer = build_trainer(spec, rank)
    trainer.sample = TokenSampler(open_token_file(path).array())
    files = train(trainer).files  # rank 0: metrics.jsonl, the loss averaged over dp
    return [json.loads(x)["loss"] for x in files.get("metrics.jsonl", "").splitlines()]


def test_a_run_on_a_token_file_equals_the_oracle_on_it(tmp_path, monkeypatch, run_distributed):
    """dp = ep = 2 on a Megatron file of ids up to 511: the scaled run takes the file's
    vocabulary, and every loss equals the single-device oracle's on the same windows."""
    write_megatron(tmp_path / "text", corpus_ids())
    data = open_token_file(str(tmp_path / "text"))
    base = tiny_spec(pp=1, dp=2, ep=2, ranks_per_node=2, steps=4, layers=2)
    spec = spec_for_data(base, data, scale=0.5)
    assert spec.model.vocab_size == data.vocab_size > 256
    with pytest.raises(SpecError, match="needs a vocabulary of .*, the model has 256"):
        spec_for_data(base, data, scale=1.0)
    losses = run_distributed(_body, 2, spec, str(tmp_path / "text"), timeout_s=120)[0]
    monkeypatch.setattr("runtime.data.sample_batch", TokenSampler(data.array()))
    want = reference_losses(replace(spec))
    assert losses == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert losses[0] == pytest.approx(np.log(data.vocab_size), rel=0.2)  # ids above 256 seen
