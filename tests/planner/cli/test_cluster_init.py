"""`piper cluster init`: a cluster YAML from a few answers that loads, plans, marks every
guessed constant, and refuses a bad or missing answer in one line with nothing written."""

from __future__ import annotations

import builtins
import subprocess
import sys

import pytest
import yaml

from planner.inputs.cluster_init import Answers, describe_cluster, find_gpu, known_gpus
from planner.inputs.clusters import list_cluster_presets, load_cluster
from planner.specs import EFFICIENCIES, TOPOLOGY_EFFICIENCIES, SpecError
from tests.hardening_cli import REPO, run_piper

H100_2N = ["--gpu", "H100", "--nodes", "2", "--name", "lab"]


def _init(tmp_path, *argv: str):
    out = tmp_path / "lab.yaml"
    return run_piper(["cluster", "init", *argv, "--out", str(out)]), out


def test_flags_write_a_yaml_that_loads_with_the_answers(tmp_path):
    res, out = _init(tmp_path, *H100_2N, "--nic-gbps", "200", "--nics-per-node", "4")
    assert res.code == 0, res.stderr
    c, h100 = load_cluster(str(out)), load_cluster("h100")
    assert (c.name, c.num_nodes, c.gpus_per_node, c.total_gpus) == ("lab", 2, 8, 16)
    assert c.device == h100.device  # the preset's data-sheet device block
    assert c.nic_gbps == 25.0  # 200 Gb/s = 25 GB/s per direction
    assert [(lv.devices, lv.bw_gbps, lv.kind) for lv in c.levels] == [
        (8, 450.0, "nvlink"),  # the H100 preset's NVLink, not given: its default
        (16, 12.5, "nic"),  # 4 NICs x 25 GB/s over 8 GPUs
    ]
    assert c.gemm_efficiency == h100.gemm_efficiency
    assert f"wrote {out}: 2 nodes x 8 H100-SXM5-80GB (16 GPUs)" in res.stdout
    assert "piper profile --nproc 8 --base" in res.stdout


def test_the_written_cluster_plans_a_model_on_all_its_gpus(tmp_path):
    """Without --gpus, `piper plan --cluster FILE` plans the file's 16 GPUs (not 64)."""
    _, cluster = _init(tmp_path, *H100_2N)
    out = tmp_path / "plan"
    argv = ["plan", "--model", "tiny-moe", "--cluster", str(cluster), "--seq-len", "128",
            "--global-batch", "64", "--no-plots", "--out", str(out)]  # fmt: skip
    res = run_piper(argv)
    assert res.code == 0, res.stderr
    assert "tiny-moe on 16 GPUs of lab" in res.stdout
    assert (out / "plan.json").exists()


def test_a_model_too_big_for_the_cluster_says_why_and_the_size_that_holds_it(tmp_path):
    _, cluster = _init(tmp_path, *H100_2N)
    res = run_piper(["plan", "--model", "deepseek-v3", "--cluster", str(cluster), "--out",
                     str(tmp_path / "plan")])  # fmt: skip
    assert res.code == 2 and len(res.err_lines) == 1
    assert "deepseek-v3 cannot fit on 16 GPUs of lab" in res.stderr  # the cluster's size
    assert "at least 162 GPUs hold them" in res.stderr  # 671B x 18 B over 69.5 GiB usable
    assert not (tmp_path / "plan").exists()


def test_every_guessed_constant_is_marked(tmp_path):
    shape = ["--gpus-per-node", "8", "--scale-up-gbps", "450", "--scale-up-domain", "8",
             "--nics-per-node", "8", "--nic-gbps", "400"]  # fmt: skip
    res, out = _init(tmp_path, *H100_2N, *shape)
    assert res.code == 0, res.stderr
    lines = out.read_text().splitlines()

    def line(key: str, start: int = 0) -> str:
        return next(x for x in lines[start:] if x.strip().startswith(f"{key}:"))

    named = [e.name for e in (*EFFICIENCIES, *TOPOLOGY_EFFICIENCIES)]
    for key in (*named, "framework_overhead_gib", "msg_overhead_us"):
        assert "# GUESS: h100's" in line(key), key
    levels = lines.index("levels:")
    latencies = [x for x in lines[levels:] if "latency_us:" in x]
    assert len(latencies) == 2 and all("# GUESS" in x for x in latencies)
    assert "# GUESS" in line("taper", lines.index("  - name: network"))
    for key in ("memory_gib", "hbm_gbps", "gpus_per_node", "num_nodes", "nic_gbps", "bw_gbps"):
        assert "GUESS" not in line(key), key  # data sheet or answers
    device = lines[lines.index("name: lab") : lines.index("gpus_per_node: 8")]
    assert "GUESS" not in "".join(device)


def test_answers_not_given_take_the_presets_and_are_marked(tmp_path):
    res, out = _init(tmp_path, *H100_2N)
    assert res.code == 0, res.stderr
    text = out.read_text()
    for key in ("gpus_per_node: 8", "nics_per_node: 8", "nic_gbps: 50", "bw_gbps: 450"):
        assert f"{key}  # GUESS: not given; h100's" in text


def test_figures_instead_of_a_known_gpu(tmp_path):
    argv = ["--memory-gib", "179", "--bf16-tflops", "2250", "--fp8-tflops", "4500",
            "--hbm-gbps", "8000", "--gpus-per-node", "8", "--scale-up-gbps", "900",
            "--scale-up-domain", "8", "--nics-per-node", "8", "--nic-gbps", "400",
            "--nodes", "4", "--name", "lab"]  # fmt: skip
    res, out = _init(tmp_path, *argv)
    assert res.code == 0, res.stderr
    c = load_cluster(str(out))
    assert c.device.name == "lab-gpu" and c.device.peak_tflops == (("bf16", 2250), ("fp8", 4500))
    assert c.gemm_efficiency == load_cluster("b200").gemm_efficiency  # closest: b200
    assert "from the b200 preset" in res.stdout
    pairs = zip(argv[::2], argv[1::2], strict=True)
    answers = Answers(**{k.lstrip("-").replace("-", "_"): v for k, v in pairs})
    assert "levels[0].kind" in describe_cluster(answers, "x.yaml").guesses


def test_an_nvl72_domain_spans_trays(tmp_path):
    res, out = _init(tmp_path, "--gpu", "GB200", "--nodes", "36", "--name", "lab")
    assert res.code == 0, res.stderr
    c = load_cluster(str(out))
    assert [(lv.name, lv.devices, lv.kind) for lv in c.levels] == [
        ("scale-up", 72, "nvlink"),
        ("network", 144, "nic"),
    ]
    assert c.level_efficiency(c.levels[0]) == c.scale_up_efficiency


def test_gpu_models_are_found_in_the_presets_at_run_time():
    assert find_gpu("h100") == "h100" and find_gpu("B200") == "b200"
    assert find_gpu("GB200") == "gb200-nvl72" and find_gpu("MI250X") == "frontier"
    models = known_gpus()
    assert {"H100", "B200", "GB200", "MI250X"} <= set(models)
    assert all(find_gpu(m) in list_cluster_presets() for m in models)


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--gpu", "X100", "--nodes", "2", "--name", "lab"], "--gpu"),
        (["--gpu", "H100", "--nodes", "-3", "--name", "lab"], "--nodes"),
        (["--gpu", "H100", "--nodes", "2.5", "--name", "lab"], "--nodes"),
        (["--gpu", "H100", "--nodes", "2", "--nic-gbps", "fast", "--name", "lab"], "--nic-gbps"),
        (["--gpu", "H100", "--nodes", "2", "--nic-gbps", "0", "--name", "lab"], "--nic-gbps"),
        (
            ["--gpu", "H100", "--nodes", "2", "--scale-up-gbps", "nan", "--name", "lab"],
            "--scale-up-gbps",
        ),  # fmt: skip
        (
            ["--gpu", "H100", "--nodes", "2", "--scale-up-domain", "12", "--name", "lab"],
            "--scale-up-domain",
        ),  # fmt: skip
        (["--memory-gib", "-80", "--nodes", "2", "--name", "lab"], "--memory-gib"),
        (["--memory-gib", "80", "--nodes", "2", "--name", "lab"], "--bf16-tflops"),
        (["--gpu", "H100", "--nodes", "2", "--name", "a b"], "--name"),
        (["--gpu", "H100", "--name", "lab"], "--nodes"),
    ],
)
def test_a_bad_answer_is_one_line_naming_the_flag_and_nothing_is_written(tmp_path, argv, flag):
    res, out = _init(tmp_path, *argv)
    assert res.code == 2
    assert len(res.err_lines) == 1 and flag in res.err_lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert list(tmp_path.iterdir()) == []


def test_an_existing_file_is_kept_without_force(tmp_path):
    out = tmp_path / "lab.yaml"
    out.write_text("mine\n")
    res = run_piper(["cluster", "init", *H100_2N, "--out", str(out)])
    assert res.code == 2 and "--force" in res.stderr and out.read_text() == "mine\n"
    assert run_piper(["cluster", "init", *H100_2N, "--out", str(out), "--force"]).code == 0
    assert load_cluster(str(out)).total_gpus == 16


def test_no_prompt_when_stdin_is_not_a_terminal(tmp_path):
    """Answers on a pipe are not read: the missing --nodes is one line naming it."""
    out = tmp_path / "lab.yaml"
    argv = ["cluster", "init", "--gpu", "H100", "--name", "lab", "--out", str(out)]
    code = "import sys; from planner.cli import main; sys.exit(main())"
    proc = subprocess.run([sys.executable, "-c", code, *argv], input="2\n", capture_output=True,
                          text=True, cwd=REPO, timeout=60)  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "piper cluster: error: --nodes is missing (nodes in the cluster); pass --nodes VALUE"
    ]
    assert not out.exists()


def test_a_terminal_is_asked_for_the_answers_not_given(tmp_path, monkeypatch):
    asked = []
    replies = iter(["", "180", "2500", "", "8000", "4", "72", "400", "18", "lab"])

    def reply(prompt: str) -> str:
        asked.append(prompt)
        return next(replies)

    monkeypatch.setattr("planner.cli.cluster._terminal", lambda: True)
    monkeypatch.setattr(builtins, "input", reply)
    out = tmp_path / "lab.yaml"
    res = run_piper(["cluster", "init", "--scale-up-gbps", "900", "--nics-per-node", "4",
                     "--out", str(out)])  # fmt: skip
    assert res.code == 0, res.stderr
    assert len(asked) == 10 and asked[0].startswith("GPU model")  # 2 answered by flags
    c = load_cluster(str(out))
    assert (c.total_gpus, c.levels[0].devices, c.device.memory_gib) == (72, 72, 180)
    assert yaml.safe_load(out.read_text())["device"]["peak_tflops"] == {"bf16": 2500}


def test_the_loader_validates_the_text_before_it_is_returned():
    with pytest.raises(SpecError, match="--nodes"):
        describe_cluster(Answers(gpu="H100", nodes="0", name="lab"), "x.yaml")


def test_presets_are_scanned_when_the_command_runs(tmp_path, monkeypatch):
    """A preset added to the folder is a known GPU at once; one that does not load is skipped."""
    new = tmp_path / "x900.yaml"
    text = (REPO / "profiles/clusters/h100.yaml").read_text()
    new.write_text(text.replace("name: H100-SXM5-80GB", "name: X900-SXM"))
    presets = [str(tmp_path / "broken.yaml"), "h100", str(new)]
    (tmp_path / "broken.yaml").write_text("name: [\n")
    monkeypatch.setattr("planner.inputs.cluster_init.list_cluster_presets", lambda: presets)
    assert find_gpu("X900") == str(new) and find_gpu("h100") == "h100"
    assert known_gpus() == ["H100", "X900"]
