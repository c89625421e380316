"""ROLL: one RLVR YAML -> a pipeline.

`actor_train`, `actor_infer` and `reference` become the meshes actor, gen and ref, each sized from
its `strategy_args.strategy_config` over its `device_mapping`; roles on the same device list are
colocated (a partial overlap cannot be, and is refused at its line). ROLL counts an optimizer step
as `per_device_train_batch_size x gradient_accumulation_steps x data parallel` samples; our
`mini_batch_size` counts prompts, so it is that divided by `num_return_sequences_in_group`.
"""

from __future__ import annotations

import math
from pathlib import Path

from siirl_dag.importers.draft import PARQUET_NOTE, Draft, all_parquet, megatron_sizes, strategy_options
from siirl_dag.importers.agentic import WRITE_ENV, refuse_agent
from siirl_dag.importers.features import lora
from siirl_dag.importers.roll_keys import parse_device_list, replicas
from siirl_dag.placement.allocation import spell as allocation
from siirl_dag.placement.rules import parallel_sizes
from siirl_dag.importers.source import Source
from siirl_dag.registry import STRATEGIES

ENVIRONMENTS = ("custom_envs", "custom_env", "train_env_manager", "val_env_manager", "env_manager")
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
ROLES = {"actor_train": "actor", "actor_infer": "gen", "reference": "ref"}
ESTIMATORS = {"grpo": "grpo", "gae": "gae", "reinforce": "reinforce_plus_plus"}
TOP = {"max_steps": ("trainer", "total_steps"), "save_steps": ("trainer", "save_freq"), "eval_steps": ("trainer", "test_freq"),
       "seed": ("trainer", "seed"), "output_dir": ("trainer", "default_local_dir"), "logging_dir": ("trainer", "log_dir"),
       "rollout_batch_size": ("data", "train_batch_size"), "val_batch_size": ("data", "val_batch_size"),
       "prompt_length": ("data", "max_prompt_length"), "response_length": ("data", "max_response_length"),
       "ppo_epochs": ("actor_params", "epochs"), "kl_loss_coef": ("actor_params", "kl_loss_coef"),
       "entropy_loss_coef": ("actor_params", "entropy_coeff"), "loss_agg_mode": ("actor_params", "loss_agg_mode")}
NO_COUNTERPART = {"hydra": "Hydra's own settings", "logging_steps": "metrics are logged every step",
                  "tracker_kwargs": "tensorboard writes under trainer.tensorboard_dir",
                  "whiten_advantages": "the estimator normalizes advantages (grpo: per group)",
                  "num_beams": "sampling only"}


def read(path: str | Path) -> Source:
    return Source.from_yaml(path)


def convert(src: Source) -> Draft:
    _refuse_environments(src)
    for key, why in NO_COUNTERPART.items():
        src.drop_under(key, why)
    per_node = src.take("num_gpus_per_node", 8, kind=int)
    n = src.take("num_return_sequences_in_group", 1, kind=int)
    devices, meshes, actor_dp = _meshes(src)
    experiment = src.take("exp_name")
    top = {"trainer": {}, "data": {}, "actor_params": {}}
    for key, (part, ours) in TOP.items():
        top[part][ours] = src.take(key)
    use_kl_loss = src.take("use_kl_loss", False, kind=bool)
    kl_coef = src.take("init_kl_coef", 0.0) if src.take("add_token_level_kl", False, kind=bool) else 0.0
    if not kl_coef:
        src.drop("init_kl_coef", "add_token_level_kl is off")
    if not (use_kl_loss or kl_coef):
        meshes.pop("ref", None)
        src.drop_under("reference", "no reference log-probs are needed (neither use_kl_loss nor add_token_level_kl)")
    resume = src.take("resume_from_checkpoint", False)
    draft = Draft(
        name=str(experiment or Path(src.file).stem).replace("_", "-"),
        cluster={"nodes": -(-max(devices + [0]) // per_node) if devices else 1, "devices_per_node": per_node, "device": "cuda"},
        policy={"path": src.take("pretrain", kind=str), "dtype": DTYPES.get(src.take("actor_train.model_args.dtype", "bf16"), "bfloat16")},
        data=top["data"] | {"train_files": src.take("actor_train.data_args.file_name"),
                            "val_files": src.take("validation.data_args.file_name")},
        meshes=meshes,
        trainer=top["trainer"] | {"experiment_name": experiment,
                                  "resume_mode": "disable" if resume is False else ("resume_path" if resume else None),
                                  "resume_from_path": resume if isinstance(resume, str) else None,
                                  "logger": ["console", "tensorboard"] if src.take("track_with") == "tensorboard" else None},
        actor_params=top["actor_params"] | {"use_kl_loss": use_kl_loss or None},
        reward={"kl_coef": kl_coef or None},
    )
    _advantage(src, draft)
    _actor(src, draft, actor_dp, n)
    _features(src, draft)
    _rollout(src, draft, n)
    if "ref" in draft.meshes:
        draft.ref = _megatron_options(src, "reference") | {"micro_batch_size": src.take("reference.infer_batch_size", kind=int)}
    _rewards(src)
    if (dropped := draft.one_micro_batch()) is not None:
        src.remark("actor_train.infer_batch_size", f"old log-probs run on the training engine, with its micro batch "
                                                   f"({draft.actor['micro_batch_size']}), not {dropped}")
    for key, files in (("actor_train.data_args.file_name", "train_files"), ("validation.data_args.file_name", "val_files")):
        if not all_parquet(draft.data.get(files)):
            src.remark(key, PARQUET_NOTE)
    src.raise_problems()
    return draft


def _refuse_environments(src: Source) -> None:
    """ROLL's agentic pipelines step its environments (Sokoban, FrozenLake, WebShop ...), ROLL's Python:
    refused, saying what an environment is here, with the turn and token limits the YAML gives."""
    found = [k for k in ENVIRONMENTS if src.under(k)]
    if not found:
        return
    sections = src.under("custom_envs") + src.under("custom_env")
    named = ", ".join(f"{key.split('.')[1]} (env_type {src.value(key)})" for key in sections if key.count(".") == 2
                      and key.endswith(".env_type"))
    steps = [src.value(k) for k in sections if k.endswith(".max_steps")] + [src.value("max_actions_per_traj")]
    refuse_agent(src, src.under(found[0])[0], f"an agentic pipeline ({', '.join(found)}"
                 + (f": ROLL's environments {named})" if named else ")"), WRITE_ENV,
                 {"max_turns": max((s for s in steps if isinstance(s, int)), default=None),
                  "max_tokens_per_turn": src.value("max_tokens_per_step")})


def _meshes(src: Source) -> tuple[list[int], dict, int]:
    """Each role's allocation over its device list (identical lists colocate with the first role), the
    devices used, and the actor's data-parallel size."""
    meshes, owners, used, actor_dp = {}, {}, [], 1
    for role, name in ROLES.items():
        if not src.has(f"{role}.device_mapping"):
            continue
        try:
            devices = parse_device_list(src.take(f"{role}.device_mapping"))
        except ValueError as exc:
            src.problem(f"{role}.device_mapping", str(exc))
            continue
        config = f"{role}.strategy_args.strategy_config"
        if role == "actor_infer":
            t = src.take(f"{role}.num_gpus_per_worker", src.take(f"{config}.tensor_parallel_size", 1), kind=int)
            sizes, backend = parallel_sizes("vllm", {"tensor_parallel_size": t}), "vllm"
        else:
            sizes, backend = megatron_sizes(src, config), "megatron"
        try:
            dp = replicas(sizes, len(devices))
        except ValueError as exc:
            src.problem(f"{role}.device_mapping", str(exc))
            continue
        alloc, replica = allocation(backend, dp, **sizes), len(devices) // dp
        if role == "actor_train":
            actor_dp = dp
        key = tuple(sorted(devices))
        wider = next((k for k in owners if set(devices) < set(k)), None)
        if key in owners:
            meshes[name] = {"alloc": alloc, "colocate_with": owners[key]}
        elif wider is not None:  # ROLL's usual layout: a role on part of the training devices
            meshes[name] = {"alloc": allocation(backend, len(wider) // replica, **sizes), "colocate_with": owners[wider]}
            src.remark(f"{role}.device_mapping", f"{_span(sorted(devices))} lie inside {owners[wider]}'s devices "
                       f"{_span(list(wider))}: colocated here, over all {len(wider)} of them (colocated meshes share "
                       f"every device), {len(wider) // replica} replicas instead of {len(devices) // replica}")
        else:
            clash = sorted(set(devices) & set(used))
            if clash:
                src.problem(f"{role}.device_mapping", f"shares devices {_span(clash)} with another role but not all of "
                            "them; expected the same device list (colocated) or none in common")
            owners[key] = name
            used += devices
            meshes[name] = {"alloc": alloc, "devices": _span(sorted(devices))}
    return used, meshes, actor_dp


def _features(src: Source, draft: Draft) -> None:
    """LoRA, GSPO, dynamic batching and asynchronous generation, in ROLL's keys."""
    args = "actor_train.model_args"
    lora(draft, src.take(f"{args}.lora_rank", src.take("lora_rank")), src.take(f"{args}.lora_alpha", src.take("lora_alpha")),
         src.take(f"{args}.lora_target", src.take("lora_target")))
    for role in ("actor_infer", "reference"):
        for key in ("lora_rank", "lora_alpha", "lora_target"):
            src.take(f"{role}.model_args.{key}")
    if src.take("importance_sampling", "token") in ("seq", "sequence"):
        draft.actor_params["policy_loss"] = "gspo"
        src.remark("importance_sampling", "becomes policy_loss: gspo (one clipped ratio per sequence)")
    if src.take("actor_train.use_dynamic_batching_in_train", False, kind=bool):
        draft.actor["dynamic_micro_batch_tokens"] = src.take("actor_train.max_tokens_per_microbatch_in_train", kind=int)
    for role in ("actor_train", "reference"):
        if src.take(f"{role}.use_dynamic_batching_in_infer", False, kind=bool):
            tokens = src.take(f"{role}.max_tokens_per_microbatch_in_infer", kind=int)
            target = draft.ref if role == "reference" else draft.logprob
            if role == "reference" or draft.actor.get("dynamic_micro_batch_tokens") in (None, tokens):
                target["dynamic_micro_batch_tokens"] = tokens
    src.take("actor_infer.use_dynamic_batching_in_infer")
    src.take("actor_infer.max_tokens_per_microbatch_in_infer")
    ratio = src.take("async_generation_ratio", 0)
    if ratio:
        draft.runtime = {"schedule": "async", "staleness": max(1, math.ceil(ratio))}
        src.remark("async_generation_ratio", f"becomes schedule async with staleness {draft.runtime['staleness']}: the "
                                             "rollout generates ahead of the training on devices of its own")


def _span(devices: list[int]) -> str | list[int]:
    """0..31 as '0-31'; a list otherwise."""
    contiguous = devices == list(range(devices[0], devices[-1] + 1))
    return f"{devices[0]}-{devices[-1]}" if contiguous and len(devices) > 1 else devices


def _megatron_options(src: Source, role: str) -> dict:
    """strategy_config keys that are Megatron options here (the sizes went to the mesh)."""
    src.take(f"{role}.strategy_args.strategy_name")
    config = f"{role}.strategy_args.strategy_config"
    if src.value(f"{config}.sequence_parallel") and src.value(f"{config}.tensor_model_parallel_size", 1) == 1:
        src.drop(f"{config}.sequence_parallel", "sequence parallel needs tensor parallel > 1; megatron ignores it at t1")
        src.taken.discard(f"{config}.sequence_parallel")
    sizes = tuple(STRATEGIES["megatron"].allocation_options())  # went to the mesh
    options = strategy_options(src, config, "megatron", sizes + ("sequence_parallel",) * (
        f"{config}.sequence_parallel" in src.notes))
    if src.take(f"{role}.model_args.disable_gradient_checkpointing", True, kind=bool) is False:
        options |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    src.take(f"{role}.model_args.dtype")
    src.take(f"{role}.model_args.model_type")
    return options


def _advantage(src: Source, draft: Draft) -> None:
    name = src.take("adv_estimator", "grpo", kind=str)
    if name not in ESTIMATORS:
        src.problem("adv_estimator", f"'{name}' has no counterpart; expected one of {', '.join(ESTIMATORS)}")
    elif ESTIMATORS[name] != name:
        src.remark("adv_estimator", f"becomes {ESTIMATORS[name]} (discounted returns, whitened per batch); check it is the "
                                    "estimator you want")
    draft.advantage = {"estimator": ESTIMATORS.get(name, "grpo")}
    if name == "gae":
        draft.critic_model = {"path": src.take("reward_pretrain", draft.policy["path"]), "dtype": draft.policy["dtype"]}
        draft.critic_params = {"mini_batch_size": None, "cliprange_value": src.take("value_clip")}
    else:
        src.drop("reward_pretrain", "no critic: the estimator needs no value model")
        src.drop("value_clip", "no critic: the estimator needs no value model")


def _actor(src: Source, draft: Draft, dp: int, n: int) -> None:
    args = "actor_train.training_args"
    per_device = src.take(f"{args}.per_device_train_batch_size", 1, kind=int)
    accumulate = src.take(f"{args}.gradient_accumulation_steps", 1, kind=int)
    samples = per_device * accumulate * dp
    if samples % n:
        src.problem(f"{args}.gradient_accumulation_steps", f"an optimizer step of {samples} samples is not whole groups "
                    f"of num_return_sequences_in_group {n}; expected a multiple of {n}")
    draft.actor_params["mini_batch_size"] = max(samples // n, 1)
    if draft.critic_model is not None:
        draft.critic_params["mini_batch_size"] = draft.actor_params["mini_batch_size"]
    draft.actor = _megatron_options(src, "actor_train") | {
        "lr": src.take(f"{args}.learning_rate"), "weight_decay": src.take(f"{args}.weight_decay"),
        "lr_warmup_steps": src.take(f"{args}.warmup_steps", kind=int), "clip_grad": src.take(f"{args}.max_grad_norm"),
        "micro_batch_size": per_device}
    src.drop(f"{args}.num_train_epochs", "training runs max_steps steps")
    draft.logprob = {"micro_batch_size": src.take("actor_train.infer_batch_size", kind=int)}
    clip = src.take("pg_clip")
    draft.actor_params |= {"clip_ratio_low": clip, "clip_ratio_high": clip}


def _rollout(src: Source, draft: Draft, n: int) -> None:
    gen = "actor_infer.generating_args"
    draft.rollout = {"n": n, "temperature": src.take(f"{gen}.temperature"), "top_p": src.take(f"{gen}.top_p"),
                     "top_k": src.take(f"{gen}.top_k", kind=int), "max_tokens": draft.data.get("max_response_length"),
                     "val_temperature": src.take("validation.generating_args.temperature")}
    for key, ours in ((f"{gen}.max_new_tokens", draft.data.get("max_response_length")), (f"{gen}.num_return_sequences", n)):
        if src.keys.get(key, (None,))[0] in (None, ours):
            src.take(key)
        else:
            src.drop(key, "rollouts generate response_length tokens, num_return_sequences_in_group per prompt here")
    config = "actor_infer.strategy_args.strategy_config"
    name = src.take("actor_infer.strategy_args.strategy_name", "vllm", kind=str)
    if name == "sglang":
        src.remark("actor_infer.strategy_args.strategy_name", "sglang rollouts run on vLLM here")
        draft.rollout["gpu_memory_utilization"] = src.take(f"{config}.mem_fraction_static")
        src.drop_under(config, "sglang's settings; rollouts run on vLLM here")
    draft.rollout |= strategy_options(src, config, "vllm")
    src.take("actor_infer.model_args.dtype")
    src.take("actor_infer.model_args.disable_gradient_checkpointing")
    src.drop("actor_infer.infer_batch_size", "vLLM batches requests itself")


def _rewards(src: Source) -> None:
    """Rule-based math rewards are the reward node's own scorer; other reward workers have no counterpart."""
    for key in [k for k in src.under("rewards") if k.endswith(".worker_cls")]:
        domain = key[: -len(".worker_cls")]
        if "math_rule" in str(src.keys[key][0]):
            src.take(key)
            src.drop_under(domain, "the reward node scores math answers itself (scorer: auto)")
        else:
            src.drop_under(domain, "reward workers other than rule-based math have no counterpart; "
                                   "give the reward node a scorer (module:function)")
