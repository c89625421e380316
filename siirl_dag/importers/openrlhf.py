"""OpenRLHF: a run script calling `openrlhf.cli.train_ppo_ray` with `--flag value` arguments -> a pipeline.

Flags are read by `shell_flags`, in OpenRLHF's dotted names (`--actor.adam.lr`, 2026) or the flat
ones before them (`--actor_learning_rate`), both read alike. The actor trains on `--actor.num_nodes x
--actor.num_gpus_per_node` devices: DeepSpeed ZeRO becomes Megatron data parallel over them (its
tensor parallel and ring attention sizes as t and c). vLLM runs `--vllm.num_engines` engines of
`--vllm.tensor_parallel_size` devices, on the actor's with `--train.colocate_all`, else beside them.
`--rollout.batch_size` counts prompts, `--train.batch_size` samples per optimizer step (our
`mini_batch_size` counts prompts). KL goes into the reward (`--algo.kl.init_coef`, OpenRLHF's
default 0.01) or into the loss (`--algo.kl.use_loss`). `--algo.advantage.is_correction_*` is
NeMo-RL's `tis` / `icepop` / `seq-mask-tis` correction (`corrections.typed`).
"""

from __future__ import annotations

import re
from pathlib import Path

from siirl_dag.importers import corrections, layout
from siirl_dag.importers.draft import PARQUET_NOTE, Draft, all_parquet
from siirl_dag.importers.features import decay_steps, lora
from siirl_dag.importers.shell_flags import read_flags
from siirl_dag.importers.source import Source
from siirl_dag.placement.rules import parallel_sizes

ENTRY = re.compile(r"openrlhf[./]cli[./]train_ppo_ray\b")
NOT_RL = re.compile(r"openrlhf[./]cli[./](train_(?:sft|dpo|rm|kto|prm|kd)\w*)")
ESTIMATORS = {"gae": "gae", "reinforce": "reinforce_plus_plus", "rloo": "rloo",
              "reinforce_baseline": "reinforce_plus_plus_baseline", "group_norm": "grpo", "dr_grpo": "grpo"}
SCHEDULES = {"cosine_with_min_lr": "cosine", "cosine": "cosine", "linear": "linear", "constant": "constant",
             "constant_with_warmup": "constant"}
# the flat names OpenRLHF used before its dotted ones (April 2026)
FLAT = {"--actor.num_nodes": "--actor_num_nodes", "--actor.num_gpus_per_node": "--actor_num_gpus_per_node",
        "--vllm.num_engines": "--vllm_num_engines", "--vllm.tensor_parallel_size": "--vllm_tensor_parallel_size",
        "--vllm.gpu_memory_utilization": "--vllm_gpu_memory_utilization", "--vllm.enforce_eager": "--enforce_eager",
        "--vllm.enable_prefix_caching": "--enable_prefix_caching", "--train.colocate_all": "--colocate_all_models",
        "--actor.model_name_or_path": "--pretrain", "--critic.model_name_or_path": "--critic_pretrain",
        "--ckpt.path": "--ckpt_path", "--ckpt.save_steps": "--save_steps", "--ckpt.max_num": "--max_ckpt_num",
        "--ckpt.load_enable": "--load_checkpoint", "--eval.steps": "--eval_steps", "--eval.dataset": "--eval_dataset",
        "--eval.temperature": "--eval_temperature", "--train.batch_size": "--train_batch_size",
        "--train.micro_batch_size": "--micro_train_batch_size", "--rollout.batch_size": "--rollout_batch_size",
        "--rollout.micro_batch_size": "--micro_rollout_batch_size", "--rollout.n_samples_per_prompt": "--n_samples_per_prompt",
        "--rollout.max_new_tokens": "--max_new_tokens", "--data.max_len": "--max_len", "--rollout.temperature": "--temperature",
        "--rollout.top_p": "--top_p", "--train.max_epochs": "--max_epochs", "--train.num_episodes": "--num_episodes",
        "--train.seed": "--seed", "--actor.adam.lr": "--actor_learning_rate", "--critic.adam.lr": "--critic_learning_rate",
        "--actor.adam.betas": "--adam_betas", "--actor.adam.weight_decay": "--l2", "--actor.max_norm": "--max_norm",
        "--actor.lr_warmup_ratio": "--lr_warmup_ratio", "--actor.lr_scheduler": "--lr_scheduler",
        "--actor.eps_clip": "--eps_clip", "--actor.eps_clip_low_high": "--eps_clip_low_high", "--actor.dual_clip": "--dual_clip",
        "--critic.value_clip": "--value_clip", "--algo.kl.init_coef": "--init_kl_coef", "--algo.kl.use_loss": "--use_kl_loss",
        "--algo.kl.estimator": "--kl_estimator", "--algo.advantage.estimator": "--advantage_estimator",
        "--algo.advantage.gamma": "--gamma", "--algo.advantage.lambd": "--lambd",
        "--algo.advantage.no_std_norm": "--no_advantage_std_norm",
        "--algo.advantage.is_correction_enable": "--enable_vllm_is_correction",
        "--algo.advantage.is_correction_threshold": "--vllm_is_truncated_threshold",
        "--algo.advantage.is_correction_type": "--vllm_is_correction_type", "--actor.policy_loss_type": "--policy_loss_type",
        "--actor.entropy_coef": "--entropy_loss_coef", "--train.dynamic_batch_enable": "--use_dynamic_batch",
        "--train.max_tokens_per_gpu": "--train_max_tokens_per_gpu", "--rollout.max_tokens_per_gpu": "--rollout_max_tokens_per_gpu",
        "--ds.lora.rank": "--lora_rank", "--ds.lora.alpha": "--lora_alpha", "--ds.lora.target_modules": "--target_modules",
        "--ds.lora.dropout": "--lora_dropout", "--ds.param_dtype": "--param_dtype",
        "--actor.gradient_checkpointing_enable": "--gradient_checkpointing", "--data.prompt_dataset": "--prompt_data",
        "--data.input_key": "--input_key", "--data.apply_chat_template": "--apply_chat_template",
        "--logger.wandb.key": "--use_wandb", "--logger.wandb.project": "--wandb_project",
        "--logger.wandb.run_name": "--wandb_run_name", "--logger.tensorboard_dir": "--use_tensorboard",
        "--algo.dynamic_filtering_enable": "--dynamic_filtering", "--reward.overlong_buffer_len": "--overlong_buffer_len",
        "--reward.overlong_penalty_factor": "--overlong_penalty_factor", "--train.async_enable": "--async_train",
        "--train.async_queue_size": "--async_queue_size", "--train.partial_rollout_enable": "--partial_rollout",
        "--ds.tensor_parallel_size": "--ds_tensor_parallel_size", "--ds.ring_attn_size": "--ring_attn_size",
        "--ds.adam_offload": "--adam_offload", "--ds.zero_stage": "--zero_stage",
        "--algo.dynamic_filtering_range": "--dynamic_filtering_reward_range"}
NO_COUNTERPART = {
    "--vllm.sync_backend": "weights reach vLLM by the sync path chosen here", "--vllm.enable_sleep": "colocated "
    "meshes sleep between phases by the rollout's sleep_level", "--ds.enable_sleep": "colocated meshes sleep between "
    "phases by the rollout's sleep_level", "--ds.packing_samples": "sequences are always packed here",
    "--ckpt.save_hf": "set trainer.export_hf to write HF weights", "--ckpt.output_dir": "the final weights are the last "
    "checkpoint under trainer.default_local_dir", "--reward.normalize_enable": "rewards are the scorer's here, unnormalized",
    "--reward.model_name_or_path": "a reward model: the reward node scores with a function here (its scorer)",
    "--reward.remote_url": "a reward function of your own: give the reward node a scorer (module:function)",
    "--reward.num_nodes": "no reward model", "--reward.num_gpus_per_node": "no reward model",
    **{f"--{role}.{key}": "the reference and the critic are colocated with the actor here" for role in ("ref", "critic")
       for key in ("num_nodes", "num_gpus_per_node")},
}


def read(path: str | Path) -> Source:
    return read_flags(path, ENTRY, NOT_RL, "`python3 -m openrlhf.cli.train_ppo_ray` with --flag arguments")


def convert(src: Source) -> Draft:
    flag = _names(src)
    layout.hide(src, flag("--logger.wandb.key"))
    for key, why in NO_COUNTERPART.items():
        src.drop(flag(key), why)
    nodes, per_node = src.take(flag("--actor.num_nodes"), 1, kind=int), src.take(flag("--actor.num_gpus_per_node"), 8, kind=int)
    colocated = src.take(flag("--train.colocate_all"), False, kind=bool)
    engines, tp = src.take(flag("--vllm.num_engines"), kind=int), src.take(flag("--vllm.tensor_parallel_size"), 1, kind=int)
    if not engines:
        src.problem(flag("--vllm.num_engines"), "no vLLM engines; expected --vllm.num_engines N (rollouts run on vLLM)")
        engines = 1
    sizes = parallel_sizes("megatron", {"tensor_model_parallel_size": src.take(flag("--ds.tensor_parallel_size"), kind=int),
                                        "context_parallel_size": src.take(flag("--ds.ring_attn_size"), kind=int)})
    n = src.take(flag("--rollout.n_samples_per_prompt"), 1, kind=int)
    max_len, new_tokens = src.take(flag("--data.max_len"), kind=int), src.take(flag("--rollout.max_new_tokens"), kind=int)
    lr = src.take(flag("--actor.adam.lr"), 1e-6)
    draft = Draft(
        name=str(src.value(flag("--logger.wandb.run_name")) or Path(src.file).stem).replace("_", "-"),
        cluster=layout.cluster(nodes * per_node, per_node, engines * tp, colocated),
        policy={"path": src.take_path(flag("--actor.model_name_or_path")),
                "dtype": {"fp16": "float16"}.get(src.take(flag("--ds.param_dtype"), "bf16"), "bfloat16")},
        data={"train_files": src.take_path(flag("--data.prompt_dataset")), "val_files": src.take_path(flag("--eval.dataset")),
              "prompt_key": src.take(flag("--data.input_key"), kind=str),
              "train_batch_size": src.take(flag("--rollout.batch_size"), 1024, kind=int), "max_response_length": new_tokens,
              "max_prompt_length": max_len - new_tokens if max_len and new_tokens and max_len > new_tokens else None},
        meshes={"actor": layout.actor_mesh(src, flag("--ds.tensor_parallel_size"), nodes * per_node, sizes),
                "gen": layout.rollout_mesh(src, flag("--vllm.tensor_parallel_size"), engines * tp, tp,
                                           nodes * per_node if colocated else None)},
        rollout={"n": n, "temperature": src.take(flag("--rollout.temperature")), "top_p": src.take(flag("--rollout.top_p")),
                 "max_tokens": new_tokens, "max_model_len": max_len, "val_temperature": src.take(flag("--eval.temperature")),
                 "chat_template": src.take(flag("--data.apply_chat_template"), kind=bool),
                 "gpu_memory_utilization": src.take(flag("--vllm.gpu_memory_utilization")),
                 "enforce_eager": src.take(flag("--vllm.enforce_eager"), kind=bool),
                 "enable_prefix_caching": src.take(flag("--vllm.enable_prefix_caching"), kind=bool)},
        actor={"lr": lr, "betas": list(src.take(flag("--actor.adam.betas"), [0.9, 0.95])),
               "weight_decay": src.take(flag("--actor.adam.weight_decay")), "clip_grad": src.take(flag("--actor.max_norm")),
               "micro_batch_size": src.take(flag("--train.micro_batch_size"), kind=int),
               "optimizer_offload": src.take(flag("--ds.adam_offload"), kind=bool)},
        logprob={"micro_batch_size": src.take(flag("--rollout.micro_batch_size"), kind=int)},
        trainer={"total_epochs": src.take(flag("--train.num_episodes"), kind=int), "seed": src.take(flag("--train.seed"), kind=int),
                 "save_freq": _every(src.take(flag("--ckpt.save_steps"), kind=int)),
                 "test_freq": _every(src.take(flag("--eval.steps"), kind=int)),
                 "default_local_dir": src.take_path(flag("--ckpt.path")), "max_ckpt_to_keep": src.take(flag("--ckpt.max_num"), kind=int),
                 "resume_mode": "auto" if src.take(flag("--ckpt.load_enable"), False) else "disable",
                 "project_name": src.take(flag("--logger.wandb.project")), "experiment_name": src.take(flag("--logger.wandb.run_name")),
                 "tensorboard_dir": src.value("--logger.tensorboard_dir"),
                 "logger": layout.loggers(src, wandb=flag("--logger.wandb.key"), tensorboard=flag("--logger.tensorboard_dir"))},
    )
    if src.take(flag("--ds.zero_stage")) is not None:
        src.remark(flag("--ds.zero_stage"), "DeepSpeed ZeRO becomes Megatron data parallel over the same devices")
    if not all_parquet(draft.data["train_files"]):
        src.remark(flag("--data.prompt_dataset"), PARQUET_NOTE)
    _algorithm(src, draft, flag, n)
    _schedule(src, draft, flag, lr)
    _features(src, draft, flag)
    src.raise_problems()
    return draft


def _names(src: Source):
    """The key a flag is written under in this script: its dotted name, or the flat one it had before."""
    return lambda name: name if src.has(name) or not src.has(FLAT.get(name, "")) else FLAT[name]


def _every(steps: int | None) -> int | None:
    return None if steps is None or steps < 1 else steps  # -1: never


def _algorithm(src: Source, draft: Draft, flag, n: int) -> None:
    """The estimator, the clipped loss, KL (in the reward or the loss) and the IS correction."""
    name = src.take(flag("--algo.advantage.estimator"), "gae", kind=str)
    if name not in ESTIMATORS:
        src.problem(flag("--algo.advantage.estimator"), f"'{name}' has no counterpart; expected one of {', '.join(ESTIMATORS)}")
    no_std = src.take(flag("--algo.advantage.no_std_norm"), False) or name == "dr_grpo"
    draft.advantage = {"estimator": ESTIMATORS.get(name, "grpo"), "gamma": src.take(flag("--algo.advantage.gamma")),
                       "lam": src.take(flag("--algo.advantage.lambd")), "norm_by_std": False if no_std else None}
    if name in ("group_norm", "dr_grpo"):
        src.remark(flag("--algo.advantage.estimator"), f"{name} becomes grpo" + (" without the std (norm_by_std: false)"
                                                                                   if name == "dr_grpo" else ""))
    clip = src.take(flag("--actor.eps_clip"), 0.2)
    low, high = src.take(flag("--actor.eps_clip_low_high"), [clip, clip])
    draft.actor_params = {"mini_batch_size": layout.prompts_per_step(src, flag("--train.batch_size"),
                                                                     src.take(flag("--train.batch_size"), 128, kind=int), n),
                          "epochs": src.take(flag("--train.max_epochs"), kind=int), "clip_ratio_low": low,
                          "clip_ratio_high": high, "clip_ratio_c": src.take(flag("--actor.dual_clip")),
                          "entropy_coeff": src.take(flag("--actor.entropy_coef")),
                          "policy_loss": "gspo" if src.take(flag("--actor.policy_loss_type"), "ppo") == "gspo" else None}
    kl = src.take(flag("--algo.kl.init_coef"), 0.01)
    if not kl:
        for key in ("--algo.kl.use_loss", "--algo.kl.estimator"):
            src.drop(flag(key), "--algo.kl.init_coef is 0: no KL, and no reference log-probs")
    elif src.take(flag("--algo.kl.use_loss"), False, kind=bool):
        draft.actor_params |= {"use_kl_loss": True, "kl_loss_coef": kl, "kl_loss_type": src.take(flag("--algo.kl.estimator"), "k1")}
    else:
        draft.reward = {"kl_coef": kl, "kl_estimator": src.take(flag("--algo.kl.estimator"), "k1")}
    if kl:
        draft.meshes["ref"] = {"alloc": draft.meshes["actor"], "colocate_with": "actor"}
    if name == "gae":
        draft.meshes["critic"] = {"alloc": draft.meshes["actor"], "colocate_with": "actor"}
        draft.critic_model = {"path": src.take_path(flag("--critic.model_name_or_path"), draft.policy["path"]),
                              "dtype": draft.policy["dtype"]}
        draft.critic = {"lr": src.take(flag("--critic.adam.lr"), 9e-6)}
        draft.critic_params = {"mini_batch_size": draft.actor_params["mini_batch_size"],
                               "cliprange_value": src.take(flag("--critic.value_clip"), 0.5)}
    if src.take(flag("--algo.advantage.is_correction_enable"), False, kind=bool):
        key = flag("--algo.advantage.is_correction_enable")
        lower, upper = src.take(flag("--algo.advantage.is_correction_threshold"), [0.5, 5.0])
        kind = src.take(flag("--algo.advantage.is_correction_type"), "tis")
        if draft.actor_params["policy_loss"] == "gspo":
            src.taken.discard(key)
            src.drop(key, "OpenRLHF's GSPO then takes its ratio against the rollout's log-probs: no counterpart here")
        else:
            corrections.typed(src, draft, kind, lower, upper, key)


def _schedule(src: Source, draft: Draft, flag, lr: float) -> None:
    """OpenRLHF's scheduler by name, its warm-up and floor as ratios of the run (whose length it does not give)."""
    key = flag("--actor.lr_scheduler")
    name = src.take(key)
    if name is None:
        return
    draft.actor["lr_decay_style"] = SCHEDULES.get(name)
    if name not in SCHEDULES:
        src.remark(key, f"{name} has no counterpart: kept constant")
    if name == "cosine_with_min_lr":
        draft.actor["min_lr"] = lr * src.take(flag("--actor.min_lr_ratio"), 0.1)
    if src.take(flag("--actor.lr_warmup_ratio")):
        src.remark(flag("--actor.lr_warmup_ratio"), "no warm-up: the run's length in steps is not given (episodes only)")
    decay_steps(src, draft, key, None, 1)


def _features(src: Source, draft: Draft, flag) -> None:
    """LoRA, recomputation, dynamic batches, DAPO's parts, asynchrony."""
    lora(draft, src.take(flag("--ds.lora.rank"), 0, kind=int), src.take(flag("--ds.lora.alpha"), 16),
         src.take(flag("--ds.lora.target_modules")), src.take(flag("--ds.lora.dropout")))
    if src.take(flag("--actor.gradient_checkpointing_enable"), False, kind=bool):
        draft.actor |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if src.take(flag("--train.dynamic_batch_enable"), False, kind=bool):
        tokens = src.take(flag("--train.max_tokens_per_gpu"), 16192, kind=int)
        draft.actor["dynamic_micro_batch_tokens"] = tokens
        if src.take(flag("--rollout.max_tokens_per_gpu"), tokens, kind=int) != tokens:
            src.remark(flag("--rollout.max_tokens_per_gpu"), f"old log-probs run on the training engine, packed as it is "
                                                             f"({tokens} tokens)")
    if src.take(flag("--algo.dynamic_filtering_enable"), False, kind=bool):
        draft.filter_groups = {"metric": "token_level_scores"}
        src.take(flag("--algo.dynamic_filtering_range"))
        src.remark(flag("--algo.dynamic_filtering_enable"), "becomes a filter_groups node: groups whose scores all agree "
                   "are dropped (OpenRLHF keeps groups whose mean reward lies inside --algo.dynamic_filtering_range)")
    if src.value(flag("--reward.overlong_buffer_len")):
        draft.reward |= {"overlong_buffer_len": int(src.take(flag("--reward.overlong_buffer_len"))),
                         "overlong_penalty_factor": src.take(flag("--reward.overlong_penalty_factor"), 1.0)}
    if src.take(flag("--train.async_enable"), False, kind=bool):
        stale = src.take(flag("--train.async_queue_size"), 1, kind=int)
        partial = src.take(flag("--train.partial_rollout_enable"), False, kind=bool)
        draft.runtime = {"schedule": "async", "staleness": stale} | ({"partial_rollout": True} if partial else {})
        src.remark(flag("--train.async_enable"), f"becomes schedule async, staleness {stale} (the sampler's queue size)")
