"""Exports parsed back (argparse, tomllib, bash) and compared value by value with the plan."""

from __future__ import annotations

import argparse
import os
import shlex
import stat
import subprocess
import tomllib
from dataclasses import replace

import pytest

from planner.cli import main
from planner.inputs.models import load_model, model_config
from planner.outputs.export import export_plan
from planner.outputs.export.megatron import pipeline_split_args
from planner.outputs.export.slurm import comm_env
from planner.plan import (
    ClusterEntry,
    ExpertPlacement,
    ModelEntry,
    ParallelPlan,
    Plan,
    Predicted,
    RankPlan,
    SolveReport,
    StagePlan,
    load_plan,
)
from planner.specs import SpecError

STAGES = ((0, 1, 2), (3, 4), (5, 6), (7,))  # first 3, middle 2 and 2, last 1
# node of each rank (2 ranks per node), deliberately not in rank order
NODE_OF_RANK = (2, 2, 0, 0, 3, 3, 1, 1)
LOCAL_OF_RANK = (1, 0, 0, 1, 0, 1, 1, 0)


def make_plan(stages=STAGES, recompute=(), zero=False, cluster="cpu-gloo", experts=None) -> Plan:
    """tiny-moe-deep on 8 ranks: pp 4, dp 2, tp 1, ep 2, by hand."""
    model = load_model("tiny-moe-deep")
    ranks = tuple(
        RankPlan(rank=r, node=NODE_OF_RANK[r], local_rank=LOCAL_OF_RANK[r], stage=r // 2,
                 dp=r % 2, tp=0, ep=r % 2)
        for r in range(8)
    )  # fmt: skip
    if experts is None:
        experts = tuple(ExpertPlacement(layer, (0, 0, 0, 0, 1, 1, 1, 1)) for layer in range(1, 8))
    rc = dict(recompute)
    return Plan(
        model=ModelEntry(model.name, model.source, model_config(model)),
        cluster=ClusterEntry(cluster, gpus_per_node=2, profile={"num_nodes": 4}),
        training={"seq_len": 128, "global_batch": 32, "dtype": "bf16", "zero": zero},
        parallel=ParallelPlan(
            pp=4, dp=2, tp=1, ep=2, edp=1, micro_batch=2, num_microbatches=8, recompute="none"
        ),  # fmt: skip
        stages=tuple(StagePlan(i, layers, rc.get(i, ())) for i, layers in enumerate(stages)),
        experts=experts,
        ranks=ranks,
        predicted=Predicted(1.0, 0.5, 100.0, 1e5, 0.1, (1.0, 1.0, 1.0, 1.0), 60.0),
        solver=SolveReport("cpsat", "OPTIMAL", 1.0, 1.0, 0.0),
        inputs_sha256="ab" * 32,
    )


def megatron_parser() -> argparse.ArgumentParser:
    """The subset of Megatron-LM's arguments the export may emit (names as Megatron spells them)."""
    p = argparse.ArgumentParser(allow_abbrev=False)
    for flag in (
        "tensor-model-parallel-size pipeline-model-parallel-size expert-model-parallel-size "
        "expert-tensor-parallel-size micro-batch-size global-batch-size num-layers hidden-size "
        "ffn-hidden-size seq-length max-position-embeddings num-attention-heads num-query-groups "
        "num-experts moe-router-topk moe-ffn-hidden-size moe-shared-expert-intermediate-size "
        "decoder-first-pipeline-num-layers decoder-last-pipeline-num-layers recompute-num-layers "
        "kv-channels mtp-num-layers q-lora-rank kv-lora-rank qk-head-dim qk-pos-emb-head-dim "
        "v-head-dim"
    ).split():
        p.add_argument(f"--{flag}", type=int)
    for flag in ("moe-layer-freq", "pipeline-model-parallel-layout", "recompute-granularity",
                 "recompute-method", "moe-token-dispatcher-type", "position-embedding-type",
                 "normalization"):  # fmt: skip
        p.add_argument(f"--{flag}")
    for flag in ("group-query-attention", "swiglu", "untie-embeddings-and-output-weights",
                 "disable-bias-linear", "bf16", "fp16", "use-distributed-optimizer",
                 "moe-grouped-gemm", "multi-latent-attention", "qk-layernorm", "add-qkv-bias",
                 "moe-router-enable-expert-bias", "sequence-parallel"):  # fmt: skip
        p.add_argument(f"--{flag}", action="store_true")
    return p


def bash_array(text: str, name: str) -> list[str]:
    out = subprocess.run(["bash", "-c", f'{text}\nprintf "%s\\n" "${{{name}[@]}}"'],
                         capture_output=True, text=True, check=True)  # fmt: skip
    return out.stdout.splitlines()


def test_megatron_flags_match_plan():
    plan = make_plan()
    result = export_plan(plan, "megatron")
    args = bash_array(result.text, "MEGATRON_ARGS")  # what bash really passes to Megatron
    ns, unknown = megatron_parser().parse_known_args(args)
    assert unknown == []
    p = plan.parallel
    assert (ns.tensor_model_parallel_size, ns.pipeline_model_parallel_size) == (p.tp, p.pp)
    assert (ns.expert_model_parallel_size, ns.expert_tensor_parallel_size) == (p.ep, 1)
    assert ns.micro_batch_size == p.micro_batch
    assert ns.global_batch_size == p.dp * p.micro_batch * p.num_microbatches == 32
    assert (ns.decoder_first_pipeline_num_layers, ns.decoder_last_pipeline_num_layers) == (3, 1)
    assert ns.pipeline_model_parallel_layout is None
    assert not ns.sequence_parallel  # tp = 1
    m = load_model("tiny-moe-deep")
    assert (ns.num_layers, ns.hidden_size, ns.seq_length) == (8, 64, 128)
    assert (ns.num_attention_heads, ns.num_query_groups, ns.group_query_attention) == (4, 2, True)
    assert ns.ffn_hidden_size == m.layers[0].dense_ffn == 128
    assert (ns.num_experts, ns.moe_router_topk, ns.moe_ffn_hidden_size) == (8, 2, 64)
    assert ns.moe_layer_freq == "[0,1,1,1,1,1,1,1]"
    assert ns.moe_shared_expert_intermediate_size == 64
    assert ns.swiglu and ns.untie_embeddings_and_output_weights and ns.bf16
    assert not ns.use_distributed_optimizer and ns.recompute_granularity is None
    # the contiguous placement and Megatron's rank order need no notes about them
    assert not any("placement" in n or "rank order" in n for n in result.notes)


def test_megatron_zero_recompute_and_placement_notes():
    experts = tuple(ExpertPlacement(layer, (1, 0, 0, 0, 1, 1, 1, 0)) for layer in range(1, 8))
    plan = make_plan(zero=True, recompute={0: (0, 1), 1: (3,)}, experts=experts)
    result = export_plan(plan, "megatron")
    ns, _ = megatron_parser().parse_known_args(bash_array(result.text, "MEGATRON_ARGS"))
    assert ns.use_distributed_optimizer
    assert (ns.recompute_granularity, ns.recompute_method, ns.recompute_num_layers) == (
        "full", "block", 2,
    )  # fmt: skip
    notes = " ".join(result.notes)
    assert "recomputes [2, 1, 0, 0]" in notes and "7 of 7 MoE layers" in notes
    assert all(f"# NOTE: {n}" in result.text for n in result.notes)
    titan = export_plan(plan, "torchtitan")
    assert any("7 MoE layers use a non-contiguous" in n for n in titan.notes)
    assert not any("non-contiguous" in n for n in export_plan(make_plan(), "torchtitan").notes)


def test_megatron_model_flags_for_mla_and_mtp():
    model = load_model("deepseek-v3")
    plan = make_plan()
    plan = replace(plan, model=ModelEntry("deepseek-v3", config=model_config(model)))
    text = export_plan(plan, "megatron").text
    ns, unknown = megatron_parser().parse_known_args(bash_array(text, "MEGATRON_ARGS"))
    assert unknown == []
    assert ns.multi_latent_attention and (ns.q_lora_rank, ns.kv_lora_rank) == (1536, 512)
    assert (ns.qk_head_dim, ns.qk_pos_emb_head_dim, ns.v_head_dim) == (128, 64, 128)
    assert ns.mtp_num_layers == 1 and ns.moe_router_enable_expert_bias
    assert ns.moe_layer_freq == "[" + ",".join(["0"] * 3 + ["1"] * 58) + "]"


@pytest.mark.parametrize(
    ("counts", "mtp", "expected"),
    [
        ([4, 4, 4], 0, []),
        ([5, 3], 0, ["--decoder-first-pipeline-num-layers", "5"]),
        ([3, 2, 2, 2], 0, ["--decoder-first-pipeline-num-layers", "3"]),
        ([2, 2, 2, 1], 0, ["--decoder-last-pipeline-num-layers", "1"]),
        ([2, 3, 1, 2], 1, ["--pipeline-model-parallel-layout", "Ett|ttt|t|ttmL"]),
    ],
)
def test_pipeline_split_cases(counts, mtp, expected):
    args, notes = pipeline_split_args(counts, mtp)
    assert args == expected
    assert bool(notes) == ("--pipeline-model-parallel-layout" in args)


def test_torchtitan_toml_matches_plan():
    plan = make_plan(zero=True)
    doc = tomllib.loads(export_plan(plan, "torchtitan").text)
    par, tr = doc["parallelism"], doc["training"]
    p = plan.parallel
    assert par["pipeline_parallel_degree"] == p.pp and par["expert_parallel_degree"] == p.ep
    assert par["tensor_parallel_degree"] == p.tp
    assert par["data_parallel_shard_degree"] * par["data_parallel_replicate_degree"] == p.dp
    assert par["data_parallel_shard_degree"] % p.ep == 0
    assert par["pipeline_parallel_microbatch_size"] == p.micro_batch
    assert par["pipeline_parallel_schedule"] == "1F1B"
    assert tr["local_batch_size"] == p.micro_batch * p.num_microbatches
    assert tr["global_batch_size"] == 32 and tr["seq_len"] == 128
    assert tr["mixed_precision_param"] == "bfloat16"
    assert doc["activation_checkpoint"]["mode"] == "none"
    parts = par["module_fqns_per_model_part"]
    assert [[int(f.split(".")[1]) for f in part if f.startswith("layers.")] for part in parts] == [
        list(s) for s in STAGES
    ]
    assert parts[0][0] == "tok_embeddings" and parts[-1][-2:] == ["norm", "output"]


def test_torchtitan_without_zero_uses_hsdp_inside_expert_groups():
    doc = tomllib.loads(export_plan(make_plan(zero=False), "torchtitan").text)
    par = doc["parallelism"]
    assert (par["data_parallel_shard_degree"], par["data_parallel_replicate_degree"]) == (2, 1)
    rc = tomllib.loads(export_plan(make_plan(recompute={2: (5,)}), "torchtitan").text)
    assert rc["activation_checkpoint"]["mode"] == "full"


def test_megatron_sequence_parallel_with_tensor_parallelism():
    plan = make_plan()
    par = replace(plan.parallel, dp=1, tp=2, edp=1)  # the planner's model splits tokens over tp
    args = bash_array(export_plan(replace(plan, parallel=par), "megatron").text, "MEGATRON_ARGS")
    ns, unknown = megatron_parser().parse_known_args(args)
    assert unknown == [] and ns.tensor_model_parallel_size == 2 and ns.sequence_parallel


@pytest.mark.parametrize(("dp", "tp", "ep", "shard"), [(4, 1, 2, 2), (1, 4, 4, 1), (2, 2, 2, 1)])
def test_torchtitan_shard_degree_lets_ep_fit(dp, tp, ep, shard):
    plan = make_plan()
    par = ParallelPlan(pp=4, dp=dp, tp=tp, ep=ep, edp=dp * tp // ep, micro_batch=2,
                       num_microbatches=8, recompute="none")  # fmt: skip
    doc = tomllib.loads(export_plan(replace(plan, parallel=par), "torchtitan").text)["parallelism"]
    assert doc["data_parallel_shard_degree"] == shard
    assert doc["data_parallel_shard_degree"] * doc["data_parallel_replicate_degree"] == dp
    assert (doc["data_parallel_shard_degree"] * tp) % ep == 0


def _fake_slurm_bin(tmp_path, hosts):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "scontrol": "#!/bin/bash\n" + "".join(f"echo {h}\n" for h in hosts),
        # run every task in turn with its SLURM_PROCID, after dropping srun's options
        "srun": "#!/bin/bash\nwhile [[ $1 == --* ]]; do shift; done\n"
        'for ((i = 0; i < WORLD_SIZE; i++)); do SLURM_PROCID=$i "$@"; done\n',
    }
    for name, text in scripts.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    return bin_dir


def test_slurm_script_hostfile_and_task_environment(tmp_path):
    plan = make_plan()
    cmd = "sh -c 'echo task $RANK $LOCAL_RANK $WORLD_SIZE $MASTER_ADDR'"
    text = export_plan(plan, "slurm", plan_path="run/plan.json", command=cmd).text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    sbatch = dict(line[len("#SBATCH --"):].split("=", 1) for line in text.splitlines()
                  if line.startswith("#SBATCH --") and "=" in line)  # fmt: skip
    assert (sbatch["nodes"], sbatch["ntasks"], sbatch["ntasks-per-node"]) == ("4", "8", "2")
    hosts = ["h-a", "h-b", "h-c", "h-d"]
    bin_dir = _fake_slurm_bin(tmp_path, hosts)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_JOB_NODELIST": "h-[a-d]",
        "PIPER_HOSTFILE": str(tmp_path / "hostfile"),
    }
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                         check=True)  # fmt: skip
    hostfile = (tmp_path / "hostfile").read_text().splitlines()
    assert hostfile == [hosts[r.node] for r in sorted(plan.ranks, key=lambda r: r.rank)]
    tasks = [line.split() for line in out.stdout.splitlines()]
    master = hosts[NODE_OF_RANK[0]]
    assert tasks == [["task", str(r), str(LOCAL_OF_RANK[r]), "8", master] for r in range(8)]


def test_slurm_dry_run_and_default_command(tmp_path):
    text = export_plan(make_plan(), "slurm", plan_path="my plan.json").text
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {**os.environ, "PATH": f"{_fake_slurm_bin(tmp_path, ['a', 'b', 'c', 'd'])}:"
           f"{os.environ['PATH']}", "PIPER_DRY_RUN": "1", "PIPER_HOSTFILE": str(tmp_path / "h"),
           "SLURM_JOB_NODELIST": "x"}  # fmt: skip
    out = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, check=True)
    words = shlex.split(out.stdout)
    assert "--distribution=arbitrary" in words
    assert words[-5:] == ["runtime.launch", "--plan", "my plan.json", "--out", "results/run"]


def test_comm_env_by_cluster():
    def env(section: dict) -> dict[str, str]:
        return comm_env(ClusterEntry.from_dict(section))

    assert env({"name": "frontier"})["NCCL_SOCKET_IFNAME"] == "hsn0"
    assert env({"name": "gb200-nvl72"})["NCCL_MNNVL_ENABLE"] == "1"
    assert env({"name": "h100"})["NCCL_IB_HCA"] == "mlx5"
    assert env({"name": "h100", "env": {"NCCL_IB_HCA": "mlx5_0"}})["NCCL_IB_HCA"] == "mlx5_0"


def test_slurm_rejects_incomplete_ranks_table():
    plan = make_plan()
    broken = replace(plan, ranks=plan.ranks[:-1])
    with pytest.raises(SpecError, match="ranks 0..7"):
        export_plan(broken, "slurm")


def test_cli_export_round_trip(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(make_plan().to_json())
    assert load_plan(path).parallel.pp == 4
    out = tmp_path / "tt.toml"
    assert main(["export", str(path), "--to", "torchtitan", "--out", str(out)]) == 0
    assert tomllib.loads(out.read_text())["parallelism"]["pipeline_parallel_degree"] == 4
    assert main(["export", str(path), "--to", "megatron"]) == 0
    assert "MEGATRON_ARGS=(" in capsys.readouterr().out
    assert main(["export", str(tmp_path / "missing.json"), "--to", "slurm"]) == 2


def test_end_to_end_piper_plan_then_every_export(tmp_path, capsys):
    out = tmp_path / "run"
    sizes = ["--pp", "2", "--dp", "4", "--tp", "1", "--ep", "2", "--micro-batch", "2"]
    argv = ["plan", "--model", "tiny-moe-deep", "--cluster", "cpu-gloo", "--gpus", "8",
            "--seq-len", "64", "--global-batch", "16", *sizes, "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    plan = load_plan(out / "plan.json")
    p = plan.parallel
    mega = export_plan(plan, "megatron")
    ns, unknown = megatron_parser().parse_known_args(bash_array(mega.text, "MEGATRON_ARGS"))
    assert unknown == []
    assert (ns.pipeline_model_parallel_size, ns.tensor_model_parallel_size) == (p.pp, p.tp)
    assert (ns.expert_model_parallel_size, ns.micro_batch_size) == (p.ep, p.micro_batch)
    assert ns.global_batch_size == p.dp * p.micro_batch * p.num_microbatches
    titan = tomllib.loads(export_plan(plan, "torchtitan").text)["parallelism"]
    assert titan["pipeline_parallel_degree"] == p.pp and titan["expert_parallel_degree"] == p.ep
    assert titan["tensor_parallel_degree"] == p.tp
    parts = titan.get("module_fqns_per_model_part", [])
    assert [len([f for f in part if f.startswith("layers.")]) for part in parts] == [
        len(s.layers) for s in plan.stages
    ]
    script = tmp_path / "job.sbatch"
    script.write_text(export_plan(plan, "slurm", plan_path=str(out / "plan.json")).text)
    subprocess.run(["bash", "-n", str(script)], check=True)
    nodes = {r.node for r in plan.ranks}
    assert f"#SBATCH --nodes={len(nodes)}" in script.read_text()
