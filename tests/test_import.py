"""`import --from siirl|verl|roll|areal`: the seeds' own configurations become pipelines that
validate and that `plan` lays out as the source did; what is not carried over is named (on the
console and at the end of the file); shell scripts are read, never run; bad input exits 2 at its line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from siirl_dag.config import load_pipeline
from siirl_dag.config.yaml_loader import load_yaml
from siirl_dag.importers.shell_script import read_script
from siirl_dag.importers.shell_words import Unresolved, expand_one as expand
from siirl_dag.main import main

PEERS = Path(__file__).parent / "fixtures" / "peers"
SIIRL_SCRIPT = PEERS / "siirl_run_qwen3-8b-megatron.sh"
ROLL = PEERS / "roll_qwen3-30BA3B-rlvr_megatron.yaml"
AREAL = PEERS / "areal_per_engine_backends.yaml"
AREAL_MOE = PEERS / "areal_moe_allocation_mode.yaml"


def imported(peer: str, source: Path, tmp_path: Path, capsys) -> tuple[dict, dict, dict]:
    """Import, then plan the output: (the pipeline document, import's JSON, plan's JSON)."""
    out = tmp_path / "pipeline.yaml"
    assert main(["import", "--from", peer, str(source), "-o", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["valid"] and not report["errors"]
    assert main(["plan", str(out), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    plan["meshes"] = {m["name"]: m for m in plan["meshes"]}
    return load_yaml(out)[0], report, plan


def node(doc: dict, node_id: str) -> dict:
    return next(n for n in doc["nodes"] if n["id"] == node_id)


def dims(plan: dict, mesh: str) -> dict:
    return {k: plan["meshes"][mesh]["sizes"][k] for k in ("dp", "tp", "pp", "cp", "ep", "etp")}


def test_the_siirl_run_script_carries_its_layout_and_batch_sizes(tmp_path, capsys):
    doc, report, plan = imported("siirl", SIIRL_SCRIPT, tmp_path, capsys)
    assert doc["cluster"] == {"nodes": 1, "devices_per_node": 8, "device": "cuda"}
    assert dims(plan, "actor") == {"dp": 1, "tp": 2, "pp": 4, "cp": 1, "ep": 1, "etp": 2}  # ACTOR_REF_TP=2, PP=4
    assert dims(plan, "gen") | {"etp": 0} == {"dp": 4, "tp": 2, "pp": 1, "cp": 1, "ep": 1, "etp": 0}
    assert plan["meshes"]["gen"]["devices"] == plan["meshes"]["actor"]["devices"]  # verl colocates
    assert doc["models"]["policy"] == {"path": "/root/data/models/Qwen3-8B", "dtype": "bfloat16"}  # ${HOME:-"/root"}
    assert doc["data"]["train_batch_size"] == 128  # $(($TRAIN_BATCH_SIZE_PER_NODE * $NNODES)), NNODES=${PET_NNODES:-1}
    actor = node(doc, "actor_update")
    assert actor["params"] == {"mini_batch_size": 16}  # prompts, as verl's ppo_mini_batch_size
    assert actor["options"]["micro_batch_size"] == 8 and actor["options"]["lr"] == 1e-6
    assert actor["options"]["sequence_parallel"] is True and actor["options"]["recompute_granularity"] == "full"
    assert node(doc, "rollout")["options"] == {"n": 8, "gpu_memory_utilization": 0.45, "max_tokens": 2048}
    assert node(doc, "advantage")["params"] == {"estimator": "grpo"}
    assert doc["trainer"]["total_epochs"] == 30 and doc["trainer"]["max_ckpt_to_keep"] == 5
    assert report["not_carried"] == [] and report["differences"] == []


def test_a_verl_yaml_of_the_same_keys_and_deprecated_global_micro_batches(tmp_path, capsys):
    source = tmp_path / "verl.yaml"
    source.write_text("""
trainer: {n_gpus_per_node: 8, nnodes: 2, logger: [console, wandb, swanlab], total_epochs: 3, log_val_generations: 4,
          val_only: true}
algorithm: {adv_estimator: grpo}
data: {train_files: d/train.parquet, val_files: d/test.parquet, train_batch_size: 64, max_prompt_length: 256, max_response_length: 512}
actor_rollout_ref:
  model: {path: m/Qwen2.5-7B, use_remove_padding: true}
  actor:
    strategy: fsdp
    ppo_mini_batch_size: 16
    ppo_micro_batch_size: 64        # global: 64 / 16 data-parallel ranks = 4 per GPU
    use_kl_loss: true
    fsdp_config: {param_offload: true, wrap_policy: {min_num_params: 0}}
  rollout: {name: vllm, tensor_model_parallel_size: 4, n: 4}
  ref: {log_prob_micro_batch_size: 32}
""")
    doc, report, plan = imported("verl", source, tmp_path, capsys)
    assert dims(plan, "actor")["dp"] == 16 and dims(plan, "gen")["dp"] == 4 and dims(plan, "gen")["tp"] == 4
    assert node(doc, "actor_update")["options"] == {"param_offload": True, "micro_batch_size": 4}
    assert node(doc, "ref_logprob")["options"] == {"micro_batch_size": 2}
    not_carried = {x["key"]: x for x in report["not_carried"]}
    assert set(not_carried) == {"actor_rollout_ref.model.use_remove_padding",
                                "actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params"}
    assert not_carried["actor_rollout_ref.actor.fsdp_config.wrap_policy.min_num_params"]["line"] == 13
    # fsdp -> Megatron and swanlab left out, each said so; wandb and verl's sample table carried
    assert [x["key"] for x in report["differences"]] == ["actor_rollout_ref.actor.strategy", "trainer.logger"]
    assert doc["trainer"]["logger"] == ["console", "wandb"] and doc["trainer"]["log_val_generations"] == 4
    assert doc["trainer"]["val_only"] is True
    text = (tmp_path / "pipeline.yaml").read_text()
    assert "# Not carried over from verl.yaml (2):" in text and "#   line 13: actor_rollout_ref.actor.fsdp_config" in text


def test_batch_sizes_that_do_not_divide_are_refused_at_their_line(tmp_path, capsys):
    source = tmp_path / "verl.yaml"
    source.write_text("trainer: {n_gpus_per_node: 8}\nactor_rollout_ref:\n  model: {path: m}\n"
                      "  actor: {ppo_micro_batch_size: 12}\n  rollout: {tensor_model_parallel_size: 3}\n")
    assert main(["import", "--from", "verl", str(source), "-o", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{source}:4:" in err and "12 does not divide among 8 data-parallel ranks" in err
    assert f"{source}:5:" in err and "8 devices do not split into vLLM engines of 3" in err
    assert not (tmp_path / "p.yaml").exists()


def test_shell_expansion_is_parsed_never_run(tmp_path):
    env = {"A": "4", "B": "8", "P": "/data"}
    assert expand("$((A * B / 2))", env) == "16" and expand("${A}x$B", env) == "4x8"
    assert expand("${NOT_SET:-\"/root\"}/x", env) == "/root/x" and expand("$P/m", env) == "/data/m"
    for text in ("$(rm -rf /tmp/x)", "$((A ** B))", "$NOT_SET", "$((A / 0))"):
        with pytest.raises(Unresolved):
            expand(text, env)
    marker = tmp_path / "ran"
    script = tmp_path / "run.sh"
    script.write_text(f"""#!/bin/bash
set -x
export NNODES=${{NNODES:-2}}
STAMP=$(touch {marker})
LR='1e-6'  # single quotes: literal
python3 -m verl.trainer.main_ppo \\
    trainer.nnodes=$NNODES \\
    trainer.n_gpus_per_node=$((NNODES * 4)) \\
    actor_rollout_ref.actor.optim.lr=$LR \\
    trainer.default_local_dir=/ckpt/$STAMP \\
    +actor_rollout_ref.model.path=m "$@"
echo done
""")
    src = read_script(script)
    assert not marker.exists()  # the command substitution was not run
    assert {k: v[0] for k, v in src.keys.items() if k.startswith(("trainer.n", "actor"))} == {
        "trainer.nnodes": 2, "trainer.n_gpus_per_node": 8, "actor_rollout_ref.actor.optim.lr": 1e-6,
        "actor_rollout_ref.model.path": "m"}
    assert src.line("trainer.n_gpus_per_node") == 8
    left = {x.key: x.why for x in src.not_carried()}
    assert "command substitution" in left["trainer.default_local_dir"] and "$@" in left


def test_the_roll_yaml_maps_roles_to_colocated_meshes(tmp_path, capsys):
    doc, report, plan = imported("roll", ROLL, tmp_path, capsys)
    assert doc["cluster"] == {"nodes": 4, "devices_per_node": 8, "device": "cuda"}  # list(range(0,32)), 8 per node
    # megatron-core's default expert tensor parallel is t: folded, so the plan keeps etp 2
    assert dims(plan, "actor") == {"dp": 8, "tp": 2, "pp": 2, "cp": 1, "ep": 4, "etp": 2}
    assert dims(plan, "gen")["tp"] == 2 and dims(plan, "gen")["dp"] == 16  # num_gpus_per_worker: 2
    assert dims(plan, "ref") == {"dp": 32, "tp": 1, "pp": 1, "cp": 1, "ep": 4, "etp": 1}
    meshes = plan["meshes"]
    assert meshes["gen"]["devices"] == meshes["ref"]["devices"] == meshes["actor"]["devices"] == list(range(32))
    actor = node(doc, "actor_update")
    # 1 per device x 32 accumulation x 8 data-parallel = 256 samples = 32 prompts of 8
    assert actor["params"]["mini_batch_size"] == 32 and actor["options"]["micro_batch_size"] == 1
    assert actor["options"]["virtual_pipeline_model_parallel_size"] == 8 and actor["options"]["moe_grouped_gemm"] is True
    assert node(doc, "rollout")["options"]["max_tokens"] == 4096  # ${response_length}
    assert {x["key"] for x in report["differences"]} >= {"actor_train.data_args.file_name"}  # jsonl is not parquet
    reasons = {x["key"]: x["why"] for x in report["not_carried"]}
    assert "math" in reasons["rewards.math_rule.world_size"] and reasons["reward_clip"] == ""


def test_roll_device_lists_that_overlap_in_part_are_refused(tmp_path, capsys):
    text = ROLL.read_text().replace("  device_mapping: list(range(0,32))\n  infer_batch_size: 1",
                                    "  device_mapping: list(range(16,48))\n  infer_batch_size: 1")
    source = tmp_path / "roll.yaml"
    source.write_text(text)
    assert main(["import", "--from", "roll", str(source), "-o", str(tmp_path / "p.yaml")]) == 2
    line = text.splitlines().index("  device_mapping: list(range(16,48))") + 1
    assert f"{source}:{line}: actor_infer.device_mapping: shares devices 16-31 with another role" in capsys.readouterr().err


def test_roll_roles_on_their_own_devices_stay_apart(tmp_path, capsys):
    source = tmp_path / "roll.yaml"
    source.write_text(ROLL.read_text().replace("  device_mapping: list(range(0,32))\n  infer_batch_size: 1",
                                               "  device_mapping: list(range(32,64))\n  infer_batch_size: 1"))
    doc, _, plan = imported("roll", source, tmp_path, capsys)
    assert doc["cluster"]["nodes"] == 8 and doc["meshes"]["gen"] == {"alloc": "vllm:d16t2", "devices": "32-63"}
    assert plan["meshes"]["gen"]["devices"] == list(range(32, 64))


def test_areal_per_engine_backends_and_inheritance(tmp_path, capsys):
    doc, report, plan = imported("areal", AREAL, tmp_path, capsys)
    meshes = plan["meshes"]
    assert meshes["gen"]["devices"] == list(range(8)) and meshes["actor"]["devices"] == list(range(8, 16))
    assert meshes["critic"]["devices"] == meshes["actor"]["devices"]  # critic.backend "" inherits the actor's
    assert doc["meshes"]["gen"] == "vllm:d4t2" and doc["meshes"]["actor"] == "megatron:d8"
    assert "ref" not in doc["meshes"]  # kl_ctl 0: no reference needed, and said so
    assert node(doc, "advantage")["params"] == {"estimator": "gae", "gamma": 1.0, "lam": 0.95}
    assert doc["runtime"] == {"schedule": "async", "staleness": 2}  # max_head_offpolicyness
    assert node(doc, "actor_update")["params"]["rollout_is"] == "token"  # decoupled loss
    differences = {x["key"] for x in report["differences"]}
    assert {"rollout.backend", "actor.backend", "rollout.max_head_offpolicyness"} <= differences
    assert "reward_scaling" in " ".join(x["key"] for x in report["not_carried"])


def test_areal_legacy_allocation_mode_with_moe_folding(tmp_path, capsys):
    doc, report, plan = imported("areal", AREAL_MOE, tmp_path, capsys)
    assert doc["meshes"]["actor"] == "megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)"
    assert dims(plan, "actor") == {"dp": 1, "tp": 2, "pp": 4, "cp": 2, "ep": 4, "etp": 1}
    assert dims(plan, "gen")["tp"] == 4 and plan["devices_used"] == 32
    options = node(doc, "actor_update")["options"]
    assert options["sequence_parallel"] is True and options["deterministic"] is True
    assert node(doc, "actor_update")["params"]["mini_batch_size"] == 64  # 256 prompts / ppo_n_minibatches 4


@pytest.mark.parametrize("peer, text, expected", [
    ("areal", "allocation_mode: sglang:d4+megatron:d4x\n", ":1: allocation_mode:"),
    ("roll", "actor_train: {device_mapping: 'list(range(0,'}\n", ":1: actor_train.device_mapping: cannot read device list"),
    ("verl", "trainer: {nnodes: two}\n", ":1: trainer.nnodes: 'two' is not a int"),
    ("verl", "trainer: [1\n", ":2:1: <root>: YAML syntax error"),
])
def test_bad_sources_exit_2_naming_the_line(tmp_path, capsys, peer, text, expected):
    source = tmp_path / "source.yaml"
    source.write_text(text)
    assert main(["import", "--from", peer, str(source), "-o", str(tmp_path / "p.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"{source}{expected}" in err and "Traceback" not in err


def test_a_default_given_elsewhere_and_a_here_string(tmp_path):
    """`$N` unassigned but given a default in another line takes it (and says so); `<<<` is a here-string,
    not a here-document swallowing the rest of the script (verl's sapo example was refused for it)."""
    script = tmp_path / "run.sh"
    script.write_text("""#!/bin/bash
echo "nodes: ${NNODES:-2}"
IFS=' ' read -ra ADDR <<<"$head_node_ip"
python3 -m verl.trainer.main_ppo trainer.nnodes=$NNODES trainer.n_gpus_per_node=$GPUS data.train_batch_size=$BS
BS=${BS:-64}
""")
    src = read_script(script)
    assert src.keys["trainer.nnodes"] == (2, 4) and src.keys["data.train_batch_size"] == (64, 4)
    assert "$NNODES is not assigned in the script; the default it gives elsewhere is used (NNODES=2)" in \
        {x.key: x.why for x in src.remarks}["trainer.nnodes"]
    assert "$GPUS is not assigned" in src.unresolved["trainer.n_gpus_per_node"]  # no default anywhere: not guessed


def test_missing_sources_scripts_without_a_command_and_overwriting_the_source(tmp_path, capsys):
    assert main(["import", "--from", "roll", str(tmp_path / "nope.yaml"), "-o", str(tmp_path / "p.yaml")]) == 2
    assert "nope.yaml: <root>: no such file" in capsys.readouterr().err
    script = tmp_path / "run.sh"
    script.write_text("#!/bin/bash\necho hello\n")
    assert main(["import", "--from", "siirl", str(script), "-o", str(tmp_path / "p.yaml")]) == 2
    assert f"{script}:1: <root>: no training command found" in capsys.readouterr().err
    assert main(["import", "--from", "siirl", str(SIIRL_SCRIPT), "-o", str(SIIRL_SCRIPT)]) == 2
    assert "is the source itself" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        main(["import", "--from", "nemo", str(SIIRL_SCRIPT), "-o", str(tmp_path / "p.yaml")])
    assert exc.value.code == 2


SHELL_PIECES = ["$", "{", "}", "(", ")", "((", "))", "'", '"', "`", "\\", "\n", " ", "=", ":-", ":+", "-", "[@]", "#",
                ";", "&&", "|", ">", "<<", "EOF", "X", "Y", "1", "0", "*", "/", "%", "+", ",,", "export ", "python3 -m ",
                "verl.trainer.main_ppo ", "a.b=", "${X:-\"${HOME}/v\"}", "$(((1+2)))", "D=(a b)", '"${D[@]}"', "$((X/0))"]


def test_no_text_makes_the_shell_reader_raise(tmp_path):
    """Property: any text (seeded random runs of shell fragments) reads as a Source or a ConfigError."""
    from siirl_dag.errors import ConfigError
    import random
    rng = random.Random(47)
    script = tmp_path / "run.sh"
    for _ in range(1500):
        pieces = rng.choices(SHELL_PIECES, k=rng.randint(0, 40))
        text = "".join(pieces) if rng.random() < 0.7 else "".join(chr(rng.randint(1, 0x24F)) for _ in range(60))
        script.write_text("X=3\n" + text + ("\npython3 -m verl.trainer.main_ppo " + text if rng.random() < 0.5 else ""))
        try:
            read_script(script)
        except ConfigError:
            pass


SHAPES = Path(__file__).parent / "fixtures" / "import"  # written for these tests, in the peers' shapes


def test_verl_one_step_off_script_keeps_its_split_schedule_and_says_what_it_left(tmp_path, capsys):
    doc, report, plan = imported("verl", SHAPES / "verl_one_step_off_megatron.sh", tmp_path, capsys)
    assert doc["runtime"] == {"schedule": "one_step_off"}
    assert load_pipeline(tmp_path / "pipeline.yaml").runtime.staleness == 1  # one_step_off's default
    assert doc["cluster"] == {"nodes": 2, "devices_per_node": 8, "device": "cuda"}  # 2 x (2 rollout + 6 training)
    gen, actor = plan["meshes"]["gen"], plan["meshes"]["actor"]
    assert len(gen["devices"]) == 4 and len(actor["devices"]) == 12 and not set(gen["devices"]) & set(actor["devices"])
    assert dims(plan, "actor") | {"etp": 0} == {"dp": 3, "tp": 2, "pp": 2, "cp": 1, "ep": 1, "etp": 0}
    options = node(doc, "actor_update")["options"]
    assert options["sequence_parallel"] is True and options["use_distributed_optimizer"] is True  # the named config's
    assert node(doc, "actor_update")["params"]["policy_loss"] == "gspo"
    assert node(doc, "reward")["params"] == {"overlong_buffer_len": 128, "overlong_penalty_factor": 1.0}
    assert doc["models"]["policy"]["path"] == "/root/models/Qwen2.5-7B"  # ${X:-"${HOME:-/root}/..."}
    assert doc["data"]["train_files"] == "/data/dapo/train.parquet" and doc["trainer"]["resume_mode"] == "disable"
    differences = {x["key"]: x["why"] for x in report["differences"]}
    assert "$HOME is not assigned" in differences["trainer.default_local_dir"]  # written as is, and said so
    assert "one step off" in differences["rollout.n_gpus_per_node"]
    not_carried = {x["key"]: x["why"] for x in report["not_carried"]}
    assert "command substitution" in not_carried["trainer.experiment_name"]
    assert "$UNSET_PROJECT is not assigned" in not_carried["trainer.project_name"] and "$@" in not_carried
    assert "trainer.nnodes" in {x["key"] for x in report["carried_over"]}
    head = (tmp_path / "pipeline.yaml").read_text().split("name:")[0]
    assert "# Carried over as written:" in head and "trainer.project_name" in head


def test_verl_named_megatron_config_with_dapo_and_lora(tmp_path, capsys):
    doc, report, plan = imported("verl", SHAPES / "verl_megatron_dapo_lora.sh", tmp_path, capsys)
    assert node(doc, "filter")["params"] == {"metric": "token_level_scores", "max_gen_batches": 5}
    assert node(doc, "advantage")["deps"] == ["filter"] and node(doc, "old_logprob")["deps"] == ["filter"]
    assert doc["models"]["policy"]["lora"] == {"rank": 32, "alpha": 16, "target_modules": ["all-linear"]}
    options = node(doc, "actor_update")["options"]
    assert options["dynamic_micro_batch_tokens"] == 8192 and options["sequence_parallel"] is True
    assert doc["meshes"]["gen"]["colocate_with"] == "actor" and "runtime" not in doc


def test_areal_fsdp_layouts_cosine_lora_and_spellings(tmp_path, capsys):
    doc, report, plan = imported("areal", SHAPES / "areal_fsdp_cosine_lora.yaml", tmp_path, capsys)
    assert doc["meshes"]["actor"] == "megatron:d2p1t2" and dims(plan, "actor")["tp"] == 2  # fsdp:d2p1t2, same layout
    options = node(doc, "actor_update")["options"]
    assert options["lr_decay_style"] == "cosine" and options["lr_decay_steps"] == 400  # 200 steps x 2 mini batches
    assert options["min_lr"] == pytest.approx(2e-6) and options["lr_warmup_steps"] == 20
    params = node(doc, "actor_update")["params"]
    assert params["policy_loss"] == "gspo" and params["rollout_is_threshold"] == 5.0  # behave_ spelling
    assert node(doc, "critic_update")["params"]["cliprange_value"] == 0.5  # critic.eps_clip
    assert doc["models"]["policy"]["lora"]["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert doc["trainer"]["total_steps"] == 200
    assert "fsdp becomes megatron" in {x["key"]: x["why"] for x in report["differences"]}["actor.backend"]


def test_areal_cosine_without_a_length_is_kept_constant_and_said(tmp_path, capsys):
    source = tmp_path / "areal.yaml"
    source.write_text((SHAPES / "areal_fsdp_cosine_lora.yaml").read_text().replace("total_train_steps: 200\n", ""))
    doc, report, _ = imported("areal", source, tmp_path, capsys)
    assert node(doc, "actor_update")["options"].get("lr_decay_style", "constant") == "constant"
    assert "set the actor's lr_decay_style" in {x["key"]: x["why"] for x in report["differences"]}[
        "actor.optimizer.lr_scheduler_type"]


def test_roll_rollout_on_part_of_the_training_devices_is_colocated(tmp_path, capsys):
    doc, report, plan = imported("roll", SHAPES / "roll_subset_lora.yaml", tmp_path, capsys)
    assert plan["meshes"]["gen"]["devices"] == plan["meshes"]["actor"]["devices"] == list(range(16))
    assert "0-11 lie inside actor's devices 0-15" in {x["key"]: x["why"] for x in report["differences"]}[
        "actor_infer.device_mapping"]
    assert doc["models"]["policy"]["lora"]["rank"] == 32 and node(doc, "actor_update")["params"]["policy_loss"] == "gspo"
    assert "sequence parallel needs tensor parallel > 1" in {x["key"]: x["why"] for x in report["not_carried"]}[
        "actor_train.strategy_args.strategy_config.sequence_parallel"]


def test_roll_async_generation_on_devices_of_its_own(tmp_path, capsys):
    source = tmp_path / "roll.yaml"
    source.write_text((SHAPES / "roll_subset_lora.yaml").read_text().replace("list(range(0,12))", "list(range(16,24))")
                      + "async_generation_ratio: 1\n")
    doc, _, plan = imported("roll", source, tmp_path, capsys)
    assert doc["runtime"] == {"schedule": "async", "staleness": 1} and plan["meshes"]["gen"]["devices"] == list(range(16, 24))


def test_a_quote_in_a_comment_inside_an_array_is_text():
    """slime's run-glm5.2 script: `# the model's own ...` inside ARGS=(...) once swallowed the rest of the script."""
    from siirl_dag.importers.shell_words import commands
    words = [[w.raw for w in c] for c in commands("ARGS=(\n  --a 1\n  # the model's own layer\n  --b 2\n)\necho done\n")]
    assert words == [["ARGS=(\n  --a 1\n  # the model's own layer\n  --b 2\n)"], ["echo", "done"]]


def test_defaults_given_elsewhere_expand_with_what_the_script_assigns(tmp_path):
    """`: ${LR:=..}` and `echo ${N:=..}` assign; `${G:-$BASE}` after the command is the default of `$G`."""
    script = tmp_path / "run.sh"
    script.write_text("""#!/bin/bash
: ${LR:=1e-6}
echo "${N:=4}"
BASE=3
python3 -m verl.trainer.main_ppo actor_rollout_ref.actor.optim.lr=$LR trainer.nnodes=$N \\
    trainer.n_gpus_per_node=$G data.train_batch_size=$BS data.max_prompt_length=$P
echo ${G:-$BASE} ${BS:-"$((BASE * 2))"} ${P:-$UNSET}
""")
    src = read_script(script)
    assert {k: v for k, (v, _) in src.keys.items()} == {
        "actor_rollout_ref.actor.optim.lr": 1e-6, "trainer.nnodes": 4, "trainer.n_gpus_per_node": 3,
        "data.train_batch_size": 6, "data.max_prompt_length": "$P"}
    remarks = {x.key: x.why for x in src.remarks}
    assert set(remarks) == {"trainer.n_gpus_per_node", "data.train_batch_size"}  # := assigned: nothing to say
    assert "(G=$BASE)" in remarks["trainer.n_gpus_per_node"]
    assert "$UNSET is not assigned" in src.unresolved["data.max_prompt_length"]  # its default is not known either


def test_the_cli_offers_every_importer():
    """main.py names the peers without importing the importers (slow); the two lists stay one."""
    from siirl_dag import main as cli
    from siirl_dag.importers import PEERS
    assert set(cli.PEERS) == set(PEERS)
