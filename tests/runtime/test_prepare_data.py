"""`piper prepare-data`: a corpus and a BPE tokenizer the tests write and train, the token
file equal to the tokenizer's own encoding of each document followed by EOS (the oracle),
read back in order and sharded by data-parallel rank as `--data` reads any token file, bad
inputs refused in one line with nothing written, and a dp = ep = 2 run on the prepared file
equal to the single-device oracle."""

from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from planner.cli import main
from planner.run.prepare_data import PrepareOptions, prepare_data
from planner.run.token_data import open_token_file, spec_for_data
from planner.specs import SpecError
from runtime.data import TokenSampler, sample_windows
from tests.runtime.test_data import _body
from tests.runtime.tiny_plans import reference_losses, tiny_spec

WORDS = "the a cat dog sat ran on under mat tree far near red blue big small and then".split()


def documents(n: int, seed: int = 0) -> list[str]:
    """n short documents of random words and punctuation, each different."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) + f". {i}!" for i in range(n)
    ]


def train_tokenizer(path: Path, docs: list[str], vocab_size: int = 120) -> Tokenizer:
    """A byte-pair tokenizer trained on docs, with [UNK] and the EOS </s>, saved to path."""
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["[UNK]", "</s>"])
    tok.train_from_iterator(docs, trainer)
    tok.save(str(path))
    return tok


def oracle(encode, docs: list[str], eos: int) -> np.ndarray:
    """Each document's ids as the tokenizer gives them, EOS after each."""
    return np.array([i for d in docs for i in [*encode(d), eos]], dtype=np.int64)


@pytest.fixture
def corpus(tmp_path):
    docs = documents(40)
    tok = train_tokenizer(tmp_path / "tokenizer.json", docs)
    return tmp_path, docs, tok


def test_every_input_layout_gives_the_tokenizers_ids_with_eos_after_each_document(corpus):
    tmp, docs, tok = corpus
    eos = tok.token_to_id("</s>")
    want = oracle(lambda d: tok.encode(d).ids, docs, eos)
    (tmp / "lines.txt").write_text("\n".join(docs[:20]) + "\n\n" + "\n".join(docs[20:]) + "\n")
    (tmp / "docs").mkdir()
    for i, d in enumerate(docs):  # one document per file; sorted names keep their order
        (tmp / "docs" / f"{i:03d}.txt").write_text(d)
    (tmp / "docs" / "blank.txt").write_text(" \n")  # no document, no EOS
    rows = [json.dumps({"id": i, "body": d}) for i, d in enumerate(docs)]
    (tmp / "rows.jsonl").write_text("\n".join(rows) + "\n")
    runs = {
        "lines": PrepareOptions(("lines.txt",), "tokenizer.json", "a", documents="line"),
        "files": PrepareOptions(("docs",), "tokenizer.json", "b.bin"),
        "jsonl": PrepareOptions(("rows.jsonl",), "tokenizer.json", "c", text_key="body"),
    }
    for name, opts in runs.items():
        opts = PrepareOptions(
            tuple(str(tmp / p) for p in opts.inputs),
            str(tmp / opts.tokenizer),
            str(tmp / opts.out),
            opts.text_key,
            opts.documents,
        )
        seen: list[tuple[int, int | None]] = []
        done = prepare_data(opts, lambda n, total=None, seen=seen: seen.append((n, total)))
        data = open_token_file(done.bin_path)
        assert np.array_equal(data.array(), want), name
        assert (data.dtype, data.vocab_size) == ("uint16", tok.get_vocab_size())
        meta = json.loads(Path(done.json_path).read_text())
        assert meta["tokens"] == len(want) and meta["documents"] == len(docs) == done.documents
        assert meta["eos_id"] == eos
        assert seen[-1][0] == seen[0][1]  # progress ends at the input's bytes
    assert not [p for p in tmp.rglob("*.tmp")]


def test_a_vocabulary_above_65536_is_written_as_uint32(tmp_path):
    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "wide.json"))
    docs = ["w1 w65535 w65536", "w69999 w0 nothing"]
    (tmp_path / "a.txt").write_text("\n".join(docs))
    opts = PrepareOptions(
        (str(tmp_path / "a.txt"),),
        str(tmp_path / "wide.json"),
        str(tmp_path / "w"),
        documents="line",
    )
    done = prepare_data(opts)
    data = open_token_file(done.bin_path)
    want = oracle(lambda d: tok.encode(d).ids, docs, 70_001)
    assert want.max() > 2**16 and (data.dtype, data.vocab_size) == ("uint32", 70_002)
    assert np.array_equal(data.array(), want)


def test_a_model_directory_tokenizes_as_its_autotokenizer(corpus):
    transformers = pytest.importorskip("transformers")
    tmp, docs, tok = corpus
    from tokenizers.processors import TemplateProcessing

    tok.add_special_tokens(["<s>"])
    bos = tok.token_to_id("<s>")
    tok.post_processor = TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="[UNK]"
    )
    fast.save_pretrained(tmp / "model")
    (tmp / "a.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    opts = PrepareOptions((str(tmp / "a.jsonl"),), str(tmp / "model"), str(tmp / "m"))
    data = open_token_file(prepare_data(opts).bin_path)
    auto = transformers.AutoTokenizer.from_pretrained(tmp / "model", local_files_only=True)
    want = oracle(lambda d: auto(d)["input_ids"], docs, auto.eos_token_id)
    assert want[0] == bos and np.array_equal(data.array(), want)  # its own BOS is kept


def test_hugging_face_datasets_give_the_same_ids_as_jsonl(corpus):
    datasets = pytest.importorskip("datasets")
    tmp, docs, tok = corpus
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"n": list(range(len(docs))), "text": docs})
    pq.write_table(table, tmp / "rows.parquet", row_group_size=7)  # read in several batches
    # a fixed fingerprint: datasets' own hashing of the table is not what is tested here
    ds = datasets.Dataset(datasets.table.InMemoryTable(table), fingerprint="tiny")
    ds.save_to_disk(str(tmp / "saved"))
    (arrow,) = (tmp / "saved").glob("*.arrow")
    want = oracle(lambda d: tok.encode(d).ids, docs, tok.token_to_id("</s>"))
    for name in ("saved", "rows.parquet", str(arrow.relative_to(tmp))):
        opts = PrepareOptions((str(tmp / name),), str(tmp / "tokenizer.json"), str(tmp / "x"))
        assert np.array_equal(open_token_file(prepare_data(opts).bin_path).array(), want), name
        with pytest.raises(SpecError, match="has no column 'body' \\(columns: n, text\\)"):
            prepare_data(replace(opts, text_key="body", out=str(tmp / "y")))
    datasets.DatasetDict({"train": ds}).save_to_disk(str(tmp / "splits"))
    with pytest.raises(SpecError, match="splits holds several splits; give one, e.g. .*train"):
        prepare_data(replace(opts, inputs=(str(tmp / "splits"),), out=str(tmp / "y")))
    assert not list(tmp.glob("y.*")) and not list(tmp.glob(".y*"))


def test_windows_of_a_prepared_file_come_from_each_dp_ranks_own_slice(corpus):
    tmp, docs, tok = corpus
    (tmp / "a.txt").write_text("\n".join(documents(400, seed=1)))
    opts = PrepareOptions((str(tmp / "a.txt"),), str(tmp / "tokenizer.json"), str(tmp / "s"))
    ids = open_token_file(prepare_data(opts).bin_path).array()
    dp, seq = 2, 16
    part = len(ids) // dp
    for j in range(dp):
        x, y = sample_windows(ids, 5, j, dp, 6, seq, seed=2)
        own = np.lib.stride_tricks.sliding_window_view(ids[j * part : (j + 1) * part], seq + 1)
        for row in torch.cat([x, y[:, -1:]], dim=1).numpy():
            assert (own == row).all(axis=1).any()  # a window of slice j, in the file's order


def run_cli(tmp: Path, capsys, *argv: str) -> tuple[int, str]:
    code = main(["prepare-data", *argv])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "case, msg",
    [
        ("missing", "input: {tmp}/nope.txt not found; check the path"),
        ("no key", "line 2 is not a JSON object with a string 'text'; fix the line or choose"),
        ("empty", "holds no text; give non-empty documents"),
        ("not a tokenizer", "is not a tokenizers JSON file"),
        ("no eos", "names no EOS token"),
        ("idx beside", "out.idx exists and --data would read it instead"),
        ("unknown eos", "--eos-token: '<end>' is not in {tmp}/tokenizer.json's vocabulary"),
        ("bad tokenizer_config", "{tmp}/tokenizer_config.json is not a JSON object"),
        ("deep jsonl", "line 1 is not a JSON object with a string 'text'"),
    ],
)
def test_bad_inputs_are_one_line_exit_2_and_write_nothing(corpus, capsys, case, msg):
    tmp, docs, _ = corpus
    (tmp / "ok.txt").write_text("\n".join(docs))
    tokenizer, inputs = str(tmp / "tokenizer.json"), [str(tmp / "ok.txt")]
    if case == "missing":
        inputs = [str(tmp / "ok.txt"), str(tmp / "nope.txt")]
    elif case == "no key":
        (tmp / "r.jsonl").write_text('{"text": "a cat"}\n{"body": "a dog"}\n')
        inputs = [str(tmp / "r.jsonl")]
    elif case == "empty":
        (tmp / "e.txt").write_text("\n\n")
        inputs = [str(tmp / "e.txt")]
    elif case == "not a tokenizer":
        tokenizer = str(tmp / "ok.txt")
    elif case == "no eos":
        train_tokenizer(tmp / "plain.json", docs[:5]).save(str(tmp / "plain.json"))
        plain = json.loads((tmp / "plain.json").read_text())
        plain["added_tokens"] = [t for t in plain["added_tokens"] if t["content"] != "</s>"]
        plain["model"]["vocab"].pop("</s>")
        (tmp / "plain.json").write_text(json.dumps(plain))
        tokenizer = str(tmp / "plain.json")
    elif case == "idx beside":
        (tmp / "out.idx").write_bytes(b"MMIDIDX")
    elif case == "bad tokenizer_config":
        (tmp / "tokenizer_config.json").write_text("[" * 100_000)
    elif case == "deep jsonl":
        (tmp / "d.jsonl").write_text("[" * 100_000 + "\n")
        inputs = [str(tmp / "d.jsonl")]
    more = ["--eos-token", "<end>"] if case == "unknown eos" else []
    before = sorted(p.name for p in tmp.iterdir())
    argv = [*inputs, "--tokenizer", tokenizer, "--out", str(tmp / "out"), *more]
    code, err = run_cli(tmp, capsys, *argv)
    assert code == 2 and err.count("\n") == 1 and msg.format(tmp=tmp) in err, err
    assert sorted(p.name for p in tmp.iterdir()) == before  # no output, no temporary


def test_a_run_on_a_prepared_corpus_equals_the_oracle_on_it(corpus, monkeypatch, run_distributed):
    """The CLI prepares the corpus; a dp = ep = 2 run on it takes its vocabulary (scaled) and
    every loss equals the single-device oracle's on the same windows."""
    tmp, _, tok = corpus
    (tmp / "a.txt").write_text("\n".join(documents(600, seed=3)))
    argv = [str(tmp / "a.txt"), "--tokenizer", str(tmp / "tokenizer.json"), "--out", str(tmp / "c")]
    assert main(["prepare-data", *argv, "--documents", "line"]) == 0
    data = open_token_file(str(tmp / "c.bin"))
    base = tiny_spec(pp=1, dp=2, ep=2, ranks_per_node=2, steps=3, layers=2)
    spec = spec_for_data(base, data, scale=0.5)
    assert spec.model.vocab_size == tok.get_vocab_size()
    losses = run_distributed(_body, 2, spec, data.bin_path, timeout_s=120)[0]
    monkeypatch.setattr("runtime.data.sample_batch", TokenSampler(data.array()))
    assert losses == pytest.approx(reference_losses(spec), rel=1e-5, abs=1e-5)
    assert losses[0] == pytest.approx(np.log(data.vocab_size), rel=0.2)
