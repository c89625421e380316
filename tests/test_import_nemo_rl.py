"""`import --from nemo-rl`: NeMo-RL's GRPO configs (and recipes inheriting them by `defaults:`) become pipelines
that validate; loss_fn's importance sampling correction carries over to actor_update's rollout correction."""

from __future__ import annotations

import pytest

from siirl_dag.main import main
from test_import import SHAPES, imported, node
from test_import_slime import line_of

NEMO = SHAPES / "nemo_rl"
BASE = NEMO / "grpo_math_1B.yaml"
RECIPE = NEMO / "recipes" / "llm" / "grpo-llama3.1-8b-instruct-1n8g-megatron-fp8-rollouts.v3.yaml"


def test_grpo_math_1b_on_dtensor(tmp_path, capsys):
    doc, report, plan = imported("nemo-rl", BASE, tmp_path, capsys)
    assert doc["meshes"] == {"actor": "megatron:d1", "gen": {"alloc": "vllm:d1", "colocate_with": "actor"},
                             "ref": {"alloc": "megatron:d1", "colocate_with": "actor"}}
    params = node(doc, "actor_update")["params"]
    assert params["mini_batch_size"] == 32 and params["kl_loss_coef"] == 0.01  # 512 samples / 16 per prompt
    assert "rollout_is" not in params  # use_importance_sampling_correction: false
    options = node(doc, "actor_update")["options"]
    assert options["dynamic_micro_batch_tokens"] == 2048  # sequence_packing: ${mul:512, 4}
    assert options["lr"] == 5e-6 and options["clip_grad"] == 1.0
    assert node(doc, "rollout")["options"]["val_temperature"] == 1.0  # ${.temperature}, relative
    differences = {x["key"]: x["why"] for x in report["differences"]}
    assert "DTensor (FSDP2) becomes Megatron" in differences["policy.dtensor_cfg.enabled"]
    assert "n / (n - 1)" in differences["grpo.use_leave_one_out_baseline"]
    left = {x["key"]: x for x in report["not_carried"]}
    assert left["grpo.max_val_samples"]["why"] == "" and left["grpo.max_val_samples"]["line"] == line_of(BASE, "max_val_samples:")


def test_a_recipe_inherits_its_defaults_and_keeps_its_own(tmp_path, capsys):
    doc, report, plan = imported("nemo-rl", RECIPE, tmp_path, capsys)
    params = node(doc, "actor_update")["params"]
    assert params["rollout_is"] == "token" and params["rollout_is_threshold"] == 1e9  # untruncated weights
    assert params["mini_batch_size"] == 16  # the base's 512 samples / the recipe's 32 per prompt
    options = node(doc, "actor_update")["options"]
    assert options["lr"] == 5e-7 and options["lr_warmup_steps"] == 2 and options["recompute_granularity"] == "full"
    assert options["dynamic_micro_batch_tokens"] == 4096  # ${mul:...} over the recipe's own lengths
    assert doc["meshes"]["actor"] == "megatron:d4p2" and doc["trainer"]["logger"] == ["console", "wandb", "tensorboard"]
    assert "read ../../grpo_math_1B.yaml" in {x["key"]: x["why"] for x in report["differences"]}["defaults"]
    assert "policy.optimizer.kwargs.lr" in {x["key"] for x in report["not_carried"]}  # Megatron's optimizer is used


@pytest.mark.parametrize("loss, expected", [
    ("{use_importance_sampling_correction: true, truncated_importance_sampling_type: tis, "
     "truncated_importance_sampling_ratio: 2.0}", {"rollout_is": "token", "rollout_is_threshold": 2.0}),
    ("{use_importance_sampling_correction: true, truncated_importance_sampling_type: icepop, "
     "truncated_importance_sampling_ratio: 5.0, truncated_importance_sampling_ratio_min: 0.5}",
     {"rollout_is": "token", "rollout_is_threshold": "0.5_5"}),
    ("{use_importance_sampling_correction: true, truncated_importance_sampling_type: seq-mask-tis, "
     "truncated_importance_sampling_ratio: 1.002, truncated_importance_sampling_ratio_min: 0.999}",
     {"rollout_is": "token", "rollout_rs": "seq_mean_k1", "rollout_rs_threshold": "0.998004_1.001"}),
    ("{use_importance_sampling_correction: true, sequence_level_importance_ratios: true, token_level_loss: false, "
     "truncated_importance_sampling_type: tis, truncated_importance_sampling_ratio: 2.0}",
     {"rollout_is": "sequence", "rollout_is_threshold": 2.0, "policy_loss": "gspo", "loss_agg_mode": "seq-mean-token-mean"}),
])
def test_importance_sampling_types(tmp_path, capsys, loss, expected):
    source = tmp_path / "recipe.yaml"
    source.write_text(f"defaults: {BASE}\nloss_fn: {loss}\n")
    doc, report, _ = imported("nemo-rl", source, tmp_path, capsys)
    params = node(doc, "actor_update")["params"]
    assert {k: params.get(k) for k in expected} == expected
    assert not [x for x in report["not_carried"] if "importance" in x["key"]]


@pytest.mark.parametrize("text, expected", [
    ("grpo: {num_prompts_per_step: many}\n", ":3: grpo.num_prompts_per_step: 'many' is not a int"),
    ("policy: {train_global_batch_size: 500}\n", ":3: policy.train_global_batch_size: an optimizer step of 500 samples"),
    ("cluster: {gpus_per_node: 8}\npolicy: {generation: {vllm_cfg: {tensor_parallel_size: 3}}}\n",
     ":4: policy.generation.vllm_cfg.tensor_parallel_size: 8 devices do not split into vLLM engines of 3"),
])
def test_bad_values_exit_2_at_their_line(tmp_path, capsys, text, expected):
    source = tmp_path / "recipe.yaml"
    source.write_text(f"# a recipe\ndefaults: {BASE}\n{text}")
    assert main(["import", "--from", "nemo-rl", str(source), "-o", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{source}{expected}" in err and "Traceback" not in err


def test_a_missing_parent_is_refused_at_its_line(tmp_path, capsys):
    source = tmp_path / "recipe.yaml"
    source.write_text("grpo: {max_num_steps: 10}\ndefaults: ../nowhere.yaml\n")
    assert main(["import", "--from", "nemo-rl", str(source), "-o", str(tmp_path / "p.yaml")]) == 2
    assert f"{source}:2: defaults: ../nowhere.yaml is not found" in capsys.readouterr().err


def test_a_config_without_grpo_is_refused(tmp_path, capsys):
    source = tmp_path / "sft.yaml"
    source.write_text("sft: {max_num_steps: 10}\npolicy: {model_name: m}\n")
    assert main(["import", "--from", "nemo-rl", str(source), "-o", str(tmp_path / "p.yaml")]) == 2
    assert f"{source}:1: <root>: no grpo section" in capsys.readouterr().err
