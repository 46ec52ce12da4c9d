"""A tokenizer directory from others never runs its own code (planner/HARDENING.md, "Hostile
files"): `piper prepare-data --tokenizer DIR` loads with trust_remote_code=False, so a
tokenizer_config.json whose auto_map names a module in DIR is refused in one line, even when
stdin answers transformers' "run this code?" prompt with y."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.hardening_cli import REPO

pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


def _tokenizer_dir_with_code(folder, marker):
    """A model directory whose tokenizer_config.json maps AutoTokenizer to evil.EvilTokenizer;
    importing evil.py writes `marker`."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    folder.mkdir()
    vocab = {"[UNK]": 0, "</s>": 1, "hello": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "EvilTokenizer", "eos_token": "</s>", "unk_token": "[UNK]",
        "auto_map": {"AutoTokenizer": ["evil.EvilTokenizer", "evil.EvilTokenizer"]},
    }))  # fmt: skip
    (folder / "config.json").write_text(json.dumps({
        "model_type": "evil", "auto_map": {"AutoConfig": "evil.EvilConfig"},
    }))  # fmt: skip
    (folder / "evil.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import PreTrainedTokenizerFast, PretrainedConfig\n"
        "class EvilTokenizer(PreTrainedTokenizerFast):\n    pass\n"
        "class EvilConfig(PretrainedConfig):\n    model_type = 'evil'\n"
    )


def test_prepare_data_refuses_a_tokenizer_that_asks_to_run_its_code(tmp_path):
    marker = tmp_path / "marker"
    _tokenizer_dir_with_code(tmp_path / "tok", marker)
    (tmp_path / "a.txt").write_text("hello world\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1",
           "HF_MODULES_CACHE": str(tmp_path / "modules")}  # fmt: skip
    cmd = [sys.executable, "-c", "import sys; from planner.cli import main; sys.exit(main())",
           "prepare-data", "--tokenizer", str(tmp_path / "tok"), "--out", str(tmp_path / "out"),
           str(tmp_path / "a.txt")]  # fmt: skip
    proc = subprocess.run(cmd, input="y\ny\n", capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env)  # fmt: skip
    assert not marker.exists(), "the tokenizer directory's code ran"
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "asks to run its own tokenizer code" in lines[0] and "tokenizer.json" in lines[0]
    assert not (tmp_path / "out.bin").exists()
