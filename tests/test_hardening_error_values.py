"""A value from a file is quoted in an error cut to about 80 characters (planner/HARDENING.md,
"Hostile files"): a plan.json, a model config, a cluster YAML or a RUNS.csv holding a
1,000,000-character value in a checked field (131,072 in a CSV field, the most Python's csv
module reads) is refused in one line of at most 300 characters that still names the field.
The files are read from the working directory, so the line's length is the message's own."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest
import yaml

from planner.calibrate.likelihood import prior_sds
from planner.calibrate.runs import EXAMPLE, load_runs
from planner.calibrate.uncertainty import error_model
from planner.inputs.clusters import load_cluster
from planner.inputs.models import load_model
from planner.plan import load_plan
from planner.plan.settings import settings_of_config
from planner.specs import SpecError
from tests.hardening_cli import REPO, base_cluster_dict, base_model_config, run_piper
from tests.planner.outputs.export_plans import make_plan

BIG = "x" * 1_000_000
CSV_BIG = "x" * 131_000  # csv.field_size_limit() is 131,072
MAX_LINE = 300


def _one_short_line(exc: pytest.ExceptionInfo[SpecError], field: str) -> str:
    line = str(exc.value)
    assert "\n" not in line
    assert len(line) <= MAX_LINE, line[:400]
    assert field in line, line
    return line


def _set(path: str, value):
    """A change to the plan dict: the item at dotted `path` (list indices as numbers) = value."""

    def change(d):
        *parents, last = path.split(".")
        for key in parents:
            d = d[int(key)] if isinstance(d, list) else d[key]
        d[int(last) if isinstance(d, list) else last] = value

    return change


# (id, change to plan.json, the field the error names)
PLAN_FIELDS = [
    ("schema_version", _set("schema_version", BIG), "schema_version"),
    ("recompute", _set("parallel.recompute", BIG), "parallel.recompute"),
    ("recompute_modules", _set("parallel.recompute_modules", [BIG]), "recompute_modules"),
    ("stage-layers", _set("stages.0.layers", [BIG]), "stages[0].layers"),
    ("rank-node", _set("ranks.0.node", BIG), "ranks[0].node"),
    ("training-dtype", _set("training.dtype", BIG), "training.dtype"),
    ("offload-modules", _set("training.activation_offload_modules", BIG), "offload_modules"),
    ("dispatcher", _set("extra.dispatcher", BIG), "extra.dispatcher"),
    ("settings-number", _set("model.settings.rope_theta", BIG), "rope_theta"),
    ("settings-literal", _set("model.settings.router_score", BIG), "router_score"),
    ("settings-key", _set(f"model.settings.{BIG}", 1), "model.settings"),
    ("comm-key", _set("predicted.comm_s", {BIG: -1.0}), "predicted.comm_s"),
    ("interval-key", _set("predicted.intervals", {BIG: -1.0}), "predicted.intervals"),
    ("env-name", _set("cluster.env", {"X" * 1_000_000: "1"}), "cluster.env"),
    ("env-bad-name", _set("cluster.env", {BIG + ";": "1"}), "cluster.env"),
]


@pytest.mark.parametrize(("change", "field"), [pytest.param(c, f, id=i) for i, c, f in PLAN_FIELDS])
def test_a_huge_value_in_a_plan_field_is_cut_in_the_error(tmp_path, monkeypatch, change, field):
    monkeypatch.chdir(tmp_path)
    d = json.loads(make_plan().to_json())
    change(d)
    Path("plan.json").write_text(json.dumps(d))
    with pytest.raises(SpecError) as exc:
        load_plan("plan.json")
    _one_short_line(exc, field)


@pytest.mark.parametrize(
    "key", ["rope_theta", "norm_topk_prob", "routed_scaling_factor", "scoring_func"]
)
def test_a_huge_value_in_a_model_config_setting_is_cut_in_the_error(key):
    cfg = {**base_model_config(), key: BIG}
    with pytest.raises(SpecError) as exc:
        settings_of_config(cfg, load_model("tiny-moe"), "config.json")
    _one_short_line(exc, key)


# (id, the cluster YAML's calibration mapping, the reader that refuses it, the field named)
CALIBRATION = [
    ("loo-rms", {"loo_rms_log": BIG, "runs": 3}, error_model, "calibration.loo_rms_log"),
    ("se", {"loo_rms_log": 0.1, "runs": 3, "se_gemm_efficiency": BIG}, error_model, "se_gemm"),
    ("prior-sd", {"prior_sd_gemm_efficiency": BIG}, prior_sds, "prior_sd_gemm_efficiency"),
    ("prior-sd-name", {"prior_sd_" + BIG: 0.1}, prior_sds, "calibration.prior_sd_"),
]


@pytest.mark.parametrize(
    ("calibration", "reader", "field"),
    [pytest.param(c, r, f, id=i) for i, c, r, f in CALIBRATION],
)
def test_a_huge_calibration_value_in_a_cluster_yaml_is_cut_in_the_error(
    tmp_path, monkeypatch, calibration, reader, field
):
    monkeypatch.chdir(tmp_path)
    Path("c.yaml").write_text(yaml.safe_dump({**base_cluster_dict(), "calibration": calibration}))
    cluster = load_cluster("c.yaml")
    with pytest.raises(SpecError) as exc:
        reader(cluster)
    _one_short_line(exc, field)


def _published_row() -> dict[str, str]:
    with open(REPO / EXAMPLE, newline="") as fh:
        return next(csv.DictReader(fh))


def _runs_file(folder: Path, row: dict[str, str]) -> Path:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(row))
    writer.writeheader()
    writer.writerow(row)
    path = folder / "RUNS.csv"
    path.write_text(out.getvalue())
    return path.relative_to(folder)


# (id, columns changed in the first published run, the column the error names)
RUNS_FIELDS = [
    ("gpus", {"gpus": CSV_BIG}, "'gpus'"),
    ("precision", {"precision": CSV_BIG}, "'precision'"),
    ("model", {"model": CSV_BIG}, "'model'"),
    ("recompute", {"recompute": CSV_BIG}, "'recompute'"),
    ("recompute-module", {"recompute": f"selective({CSV_BIG})"}, "'recompute'"),
    ("dispatcher", {"dispatcher": CSV_BIG}, "'dispatcher'"),
    ("flag", {"a2a_overlap": CSV_BIG}, "'a2a_overlap'"),
    ("measured", {"measured_tokens_per_s_per_gpu": CSV_BIG}, "measured_tokens_per_s_per_gpu"),
    ("control-character", {"hardware": "\x01" + CSV_BIG}, "'hardware'"),
    ("id-in-every-line", {"id": CSV_BIG, "gpus": "0"}, "'gpus'"),
    ("unknown-column", {CSV_BIG: "1"}, "unknown column"),
    ("past-the-csv-limit", {"note": BIG}, "not valid CSV"),
]


@pytest.mark.parametrize(
    ("changes", "field"), [pytest.param(c, f, id=i) for i, c, f in RUNS_FIELDS]
)
def test_a_huge_value_in_a_runs_csv_column_is_cut_in_the_error(
    tmp_path, monkeypatch, changes, field
):
    monkeypatch.chdir(tmp_path)
    path = _runs_file(tmp_path, {**_published_row(), **changes})
    with pytest.raises(SpecError) as exc:
        load_runs(path)
    _one_short_line(exc, field)


def test_a_model_name_too_long_for_a_file_is_one_short_line():
    result = run_piper(["model-info", "m" * 5000])
    assert result.code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert "File name too long" in result.stderr and len(result.stderr) < 300


def test_a_huge_fit_parameter_name_is_cut_in_the_error(tmp_path):
    runs = Path(__file__).resolve().parent.parent / "profiles" / "runs" / "published_runs.csv"
    result = run_piper(["calibrate", "--fit", str(runs), "--params", "p" * 1_000_000,
                        "--cluster", "h100", "--out", str(tmp_path / "f.yaml")])  # fmt: skip
    assert result.code == 2 and len(result.stderr) < 400  # the cut name, then the 9 constants
    assert "p..." in result.stderr and "is not a constant a fit may set" in result.stderr
