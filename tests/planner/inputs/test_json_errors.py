"""Every JSON file the CLI reads reports a parse error the same way:
`FILE: invalid JSON at line L column C: <what> (fix: ...)`, exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from planner.calibrate.metrics import parse_metrics
from planner.cli import main
from planner.inputs.json_errors import json_error_line
from planner.specs import SpecError
from runtime.bench import predicted_vs_measured

ROOT = Path(__file__).resolve().parents[3]
UNTERMINATED = '{\n  "a": 1,\n  "b": "no closing quote'  # the string opens at line 3 column 8


def _decode_error(text: str) -> json.JSONDecodeError:
    with pytest.raises(json.JSONDecodeError) as err:
        json.loads(text)
    return err.value


def test_the_decoders_dangling_at_is_gone_and_the_position_given_once():
    text = "{\n" + '  "k": 1,\n' * 141 + '  "s": "open'  # the string opens on line 143
    line = json_error_line("plan.json", _decode_error(text), "regenerate it")
    assert line == (
        "plan.json: invalid JSON at line 143 column 8: unterminated string (fix: regenerate it)"
    )
    assert json_error_line("m.jsonl", _decode_error('{"a": }'), "one object per line", 7) == (
        "m.jsonl: invalid JSON at line 7 column 7: expecting value (fix: one object per line)"
    )


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_model_config(tmp_path, capsys):
    path = _write(tmp_path, "config.json", UNTERMINATED)
    assert main(["model-info", str(path)]) == 2
    assert capsys.readouterr().err == (
        f"piper model-info: error: {path}: invalid JSON at line 3 column 8: unterminated "
        "string (fix: repair it, or take the model's config.json again)\n"
    )


def test_plan_json(tmp_path, capsys):
    path = _write(tmp_path, "plan.json", '{"schema_version": 1,\n  "model": }')
    assert main(["export", str(path), "--to", "slurm"]) == 2
    assert capsys.readouterr().err == (
        f"piper export: error: {path}: invalid JSON at line 2 column 12: expecting value "
        "(fix: regenerate it with 'piper plan --out DIR')\n"
    )


def test_metrics_jsonl(tmp_path, capsys):
    path = _write(tmp_path, "metrics.jsonl", '{"step": 0, "loss": nan}\n')
    plan = ROOT / "results" / "example" / "plan.json"
    code = main(["calibrate", str(plan), str(path), "--out", str(tmp_path / "out")])
    assert code == 2
    assert capsys.readouterr().err == (
        f"piper calibrate: error: {path}: invalid JSON at line 1 column 21: expecting value "
        "(fix: metrics.jsonl has one JSON object per line, as 'piper run' writes it)\n"
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(SpecError) as err:  # the file's own line, not the decoder's line 1
        parse_metrics('\n\n{"step": 2,', "m.jsonl")
    assert str(err.value).startswith("m.jsonl: invalid JSON at line 3 column 12: expecting")


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ('{"machine": {"backend": "gloo"} "x": 1}', "invalid JSON at line 1 column 33: expecting "
         "',' delimiter (fix: pass the raw JSON that 'piper profile --keep-raw' wrote)"),
        (b"\xff\xfe{", "not UTF-8 text (byte 0xff at offset 0); a raw profile is a text file"),
        ("[1, 2]", "the raw measurements are not a JSON object; pass the raw JSON that 'piper "
         "profile --keep-raw' wrote"),
    ],
)  # fmt: skip
def test_profile_raw(tmp_path, capsys, text, error):
    path = tmp_path / "raw.json"
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["profile", "--raw", str(path), "--out", str(tmp_path / "p" / "x.yaml")]) == 2
    assert capsys.readouterr().err == f"piper profile: error: {path}: {error}\n"
    assert not (tmp_path / "p").exists()


def test_predicted_vs_measured_raw(tmp_path, capsys):
    path = _write(tmp_path, "raw.json", "[1, 2")
    assert predicted_vs_measured.main([str(path)]) == 2
    assert capsys.readouterr().err == (
        f"predicted_vs_measured: {path}: invalid JSON at line 1 column 6: expecting ',' "
        "delimiter (fix: pass the raw JSON of runtime/bench/profile.py)\n"
    )
