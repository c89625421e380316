"""`import --from openrlhf`: OpenRLHF's own run scripts (`openrlhf.cli.train_ppo_ray --flag value`, dotted or flat
names) become pipelines that validate; its vLLM IS correction carries over to actor_update's rollout correction."""

from __future__ import annotations

import json

import pytest

from siirl_dag.main import main
from test_import import SHAPES, imported, node
from test_import_slime import line_of

PRORL = SHAPES / "openrlhf_train_prorlv2_math_hybrid_engine.sh"
PPO = SHAPES / "openrlhf_train_ppo_ray_hybrid_engine.sh"


def test_prorl_v2_icepop_kl_loss_and_dynamic_filtering(tmp_path, capsys):
    doc, report, plan = imported("openrlhf", PRORL, tmp_path, capsys)
    params = node(doc, "actor_update")["params"]
    assert params["rollout_is"] == "token" and params["rollout_is_threshold"] == "0.5_5"  # icepop on [0.5, 5.0]
    assert params["use_kl_loss"] is True and params["kl_loss_type"] == "k2" and params["kl_loss_coef"] == 1e-4
    assert params["mini_batch_size"] == 64 and params["clip_ratio_high"] == 0.27  # 1024 samples / 16 per prompt
    assert node(doc, "advantage")["params"]["estimator"] == "reinforce_plus_plus_baseline"
    assert node(doc, "filter")["kind"] == "filter_groups"
    assert doc["meshes"]["gen"] == {"alloc": "vllm:d8", "colocate_with": "actor"}  # colocate_all, 8 engines of 1
    assert doc["data"]["max_prompt_length"] == 1024 and doc["data"]["max_response_length"] == 8192  # 9216 - 8192
    assert doc["models"]["policy"]["path"] == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    left = {x["key"]: x for x in report["not_carried"]}
    assert "reward function of your own" in left["--reward.remote_url"]["why"]
    assert left["--reward.stop_properly_penalty_coef"]["line"] == line_of(PRORL, "--reward.stop_properly_penalty_coef")
    assert not [k for k in left if "is_correction" in k]


def test_ppo_with_a_critic_and_default_tis(tmp_path, capsys):
    doc, report, plan = imported("openrlhf", PPO, tmp_path, capsys)
    assert node(doc, "advantage")["params"]["estimator"] == "gae" and "critic" in doc["meshes"]
    assert node(doc, "reward")["params"] == {"kl_coef": 0.01, "kl_estimator": "k1"}  # KL in the reward
    params = node(doc, "actor_update")["params"]
    assert params["rollout_is_threshold"] == 5.0  # tis on the default band [0.5, 5.0]: truncated at 5
    assert "raised to it" in {x["key"]: x["why"] for x in report["differences"]}["--algo.advantage.is_correction_enable"]
    assert dict(doc["cluster"]) == {"nodes": 1, "devices_per_node": 8, "device": "cuda"}


def test_the_flat_flags_before_the_dotted_ones_and_seq_mask_tis(tmp_path, capsys):
    source = tmp_path / "run.sh"
    source.write_text("""#!/bin/bash
ray job submit --address="http://127.0.0.1:8265" -- python3 -m openrlhf.cli.train_ppo_ray \\
   --actor_num_nodes 2 --actor_num_gpus_per_node 8 --vllm_num_engines 4 --vllm_tensor_parallel_size 2 \\
   --pretrain Qwen/Qwen2.5-7B --prompt_data data/train.parquet --input_key question \\
   --advantage_estimator group_norm --n_samples_per_prompt 8 --rollout_batch_size 64 --train_batch_size 256 \\
   --actor_learning_rate 5e-7 --init_kl_coef 0 --use_kl_loss --kl_estimator k3 \\
   --enable_vllm_is_correction --vllm_is_truncated_threshold 0.8 1.25 --vllm_is_correction_type seq-mask-tis \\
   --use_wandb ${WANDB_TOKEN} --wandb_project demo
""")
    secret = tmp_path / "secret.sh"
    secret.write_text(source.read_text().replace("${WANDB_TOKEN}", "abc123secret"))
    _, secret_report, _ = imported("openrlhf", secret, tmp_path, capsys)  # a W&B key is not repeated anywhere
    assert "abc123secret" not in (tmp_path / "pipeline.yaml").read_text() + json.dumps(secret_report)
    doc, report, plan = imported("openrlhf", source, tmp_path, capsys)
    assert doc["meshes"] == {"actor": "megatron:d16", "gen": "vllm:d4t2"}  # not colocated: the rollout beside
    assert doc["cluster"]["nodes"] == 3 and not set(plan["meshes"]["gen"]["devices"]) & set(plan["meshes"]["actor"]["devices"])
    params = node(doc, "actor_update")["params"]
    assert params["rollout_rs"] == "seq_mean_k1" and params["rollout_rs_threshold"] == "0.8_1.25"  # 1/1.25 .. 1/0.8
    assert params["rollout_is"] == "token" and params["rollout_is_threshold"] == 1e9  # raw token weights
    assert params["mini_batch_size"] == 32 and "ref" not in doc["meshes"]  # kl 0: no reference
    assert node(doc, "actor_update")["options"]["lr"] == 5e-7 and doc["data"]["prompt_key"] == "question"
    assert doc["trainer"]["logger"] == ["console", "wandb"] and doc["trainer"]["project_name"] == "demo"


@pytest.mark.parametrize("old, new, expected", [
    ("--vllm.tensor_parallel_size 1", "--vllm.tensor_parallel_size 3", "the rollout's 8 engine(s) of 3 hold 24 devices"),
    ("--train.batch_size 1024", "--train.batch_size 1000", "an optimizer step of 1000 samples is not whole groups"),
    ("--rollout.batch_size 512", "--rollout.batch_size many", "'many' is not a int"),
])
def test_bad_values_exit_2_at_their_line(tmp_path, capsys, old, new, expected):
    source = tmp_path / "run.sh"
    source.write_text(PRORL.read_text().replace(old, new))
    assert main(["import", "--from", "openrlhf", str(source), "-o", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{source}:{line_of(source, new)}: {new.split()[0]}: {expected}" in err and "Traceback" not in err


def test_sft_and_dpo_are_refused(tmp_path, capsys):
    source = tmp_path / "sft.sh"
    source.write_text("deepspeed --module openrlhf.cli.train_sft --pretrain m --save_path out\n")
    assert main(["import", "--from", "openrlhf", str(source), "-o", str(tmp_path / "p.yaml")]) == 2
    assert "runs train_sft, which is not RL training" in capsys.readouterr().err
