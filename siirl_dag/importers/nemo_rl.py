"""NeMo-RL: a GRPO YAML (`examples/configs/grpo_*.yaml`, a recipe inheriting one by `defaults:`) -> a pipeline.

The files a config names in `defaults` are read first (relative to it, recursively), its own keys over
theirs as NeMo-RL merges them; OmegaConf references, relative ones too, are resolved after, and its
`${mul:a, b}` where it sizes packed micro batches. The trainer is Megatron (`policy.megatron_cfg`) or
DTensor (`policy.dtensor_cfg`, which becomes Megatron on the same devices) over `cluster.num_nodes x
cluster.gpus_per_node`; vLLM shares them (`generation.colocated.enabled`) or takes the GPUs or nodes
the config gives it. `grpo.num_prompts_per_step` counts prompts, `policy.train_global_batch_size`
samples per optimizer step. `loss_fn`'s importance sampling correction (`tis`, `icepop`,
`seq-mask-tis` on [truncated_importance_sampling_ratio_min, _ratio]) maps as OpenRLHF's does
(`corrections.typed`); KL goes into the loss (`reference_policy_kl_penalty`) or the reward.
"""

from __future__ import annotations

import re
from pathlib import Path

from siirl_dag.errors import ConfigError, Problem
from siirl_dag.importers import corrections, layout
from siirl_dag.importers.draft import PARQUET_NOTE, Draft, all_parquet
from siirl_dag.importers.features import lora, refuse
from siirl_dag.importers.source import Source
from siirl_dag.placement.rules import option_sizes, parallel_sizes

MAX_DEPTH = 8  # defaults chains: deeper is a cycle
DTYPES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}
ESTIMATORS = {"grpo": "grpo", "reinforce_plus_plus": "reinforce_plus_plus"}
MEG, DT, GEN, LOSS = "policy.megatron_cfg", "policy.dtensor_cfg", "policy.generation", "loss_fn"
_MUL = re.compile(r"\$\{mul:\s*(\d+)\s*,\s*(\d+)\s*\}")
UNUSED = {"data_plane": "NeMo-RL's TransferQueue data plane", "reward_penalties": "NeMo-Gym's reward penalties",
          "on_policy_distillation": "no teacher here (docs/COMPOSE.md adds one)", "env": "NeMo-RL's environments: "
          "the reward node scores with its scorer here", f"{GEN}.refit_cfg": "weights reach vLLM by the sync path chosen here",
          f"{GEN}.mcore_generation_config": "Megatron's own generation; rollouts run on vLLM here",
          f"{MEG}.fp8_cfg": "FP8 training is not read here", "policy.draft": "no draft model here",
          f"{GEN}.port_range_low": "Ray finds the ports", f"{GEN}.port_range_high": "Ray finds the ports",
          "cluster.master_port_range_low": "Ray finds the ports", "cluster.master_port_range_high": "Ray finds the ports",
          f"{LOSS}.kl_input_clamp_value": "log ratios are clamped as verl does here",
          f"{LOSS}.kl_output_clamp_value": "log ratios are clamped as verl does here",
          "checkpointing.metric_name": "checkpoints are kept by age here", "checkpointing.higher_is_better": "checkpoints "
          "are kept by age here", "policy.tokenizer": "the model's own tokenizer is used",
          "policy.make_sequence_length_divisible_by": "sequences are padded as Megatron needs here"}


def read(path: str | Path) -> Source:
    """The YAML with the files its `defaults` name, references resolved after they are merged."""
    src = Source.from_yaml(path, resolve=False)
    _inherit(src, Path(path), src, 0)
    src.resolve()
    for key, (value, line) in list(src.keys.items()):
        if isinstance(value, str) and (m := _MUL.fullmatch(value)):
            src.keys[key] = (int(m.group(1)) * int(m.group(2)), line)
            src.unresolved.pop(key, None)
    return src


def _inherit(src: Source, path: Path, into: Source, depth: int) -> None:
    """`defaults: parent.yaml` (or a list, later ones over earlier): their keys where `into` has none."""
    names = src.value("defaults")
    names = [names] if isinstance(names, str) else names if isinstance(names, list) else []
    if depth > MAX_DEPTH:
        raise ConfigError(Problem(("defaults",), "defaults nest deeper than a chain of configs (a cycle?)", file=str(path)))
    for name in reversed(names):
        parent = (path.parent / str(name)).resolve()
        if not parent.is_file():
            file, line = src.where("defaults") if src is into else (str(path), src.line("defaults"))
            raise ConfigError(Problem(("defaults",), f"{name} is not found beside {path.name}; expected the config it "
                                                     "inherits, as NeMo-RL reads it", file=file, line=line))
        base = Source.from_yaml(parent, resolve=False)
        _inherit(base, parent, base, depth + 1)
        into.include(base)
    if src is into and names:
        into.taken.add("defaults")
        into.remark("defaults", f"read {', '.join(map(str, names))}: its keys where this file does not set them")


def convert(src: Source) -> Draft:
    if not src.under("grpo"):  # sft, dpo, rm, distillation configs
        refuse(src, "", "no grpo section: not a GRPO configuration (SFT, DPO, reward model or distillation), which is "
                        "not RL training here; expected NeMo-RL's examples/configs/grpo_*.yaml or a recipe inheriting one")
    for key, why in UNUSED.items():
        src.drop_under(key, why)
    per_node, nodes = src.take("cluster.gpus_per_node", 8, kind=int), src.take("cluster.num_nodes", 1, kind=int)
    train, gen, colocated = _devices(src, nodes, per_node)
    megatron = src.take(f"{MEG}.enabled", False, kind=bool)
    sizes = _sizes(src, megatron)
    n = src.take("grpo.num_generations_per_prompt", 1, kind=int)
    new_tokens = src.take(f"{GEN}.max_new_tokens", kind=int)
    if src.take(f"{GEN}.backend", "vllm") != "vllm":
        src.remark(f"{GEN}.backend", "rollouts run on vLLM here")
    tp = src.take(f"{GEN}.vllm_cfg.tensor_parallel_size", 1, kind=int)
    draft = Draft(
        name=str(src.value("logger.wandb.name") or Path(src.file).stem).replace("_", "-").replace(".", "-"),
        cluster=layout.cluster(train, per_node, gen, colocated),
        policy={"path": src.take_path("policy.model_name"), "dtype": DTYPES.get(src.take("policy.precision", "bfloat16"))},
        data={"train_batch_size": src.take("grpo.num_prompts_per_step", kind=int), "max_response_length": new_tokens,
              "max_prompt_length": src.take("data.max_input_seq_length", kind=int), "shuffle": src.take("data.shuffle"),
              "val_batch_size": src.take("grpo.val_batch_size", kind=int),
              "train_files": src.take_path("data.train.data_path", src.value("data.train.dataset_name"))},
        meshes={"actor": layout.actor_mesh(src, f"{MEG}.tensor_model_parallel_size" if megatron else
                                           f"{DT}.tensor_parallel_size", train, sizes),
                "gen": layout.rollout_mesh(src, f"{GEN}.vllm_cfg.tensor_parallel_size", gen, tp, train if colocated else None)},
        rollout={"n": n, "temperature": src.take(f"{GEN}.temperature"), "top_p": src.take(f"{GEN}.top_p"),
                 "top_k": src.take(f"{GEN}.top_k", kind=int), "max_tokens": new_tokens,
                 "val_temperature": src.take(f"{GEN}.val_temperature"),
                 "gpu_memory_utilization": src.take(f"{GEN}.vllm_cfg.gpu_memory_utilization"),
                 "max_model_len": src.take(f"{GEN}.vllm_cfg.max_model_len", kind=int),
                 "enforce_eager": src.take(f"{GEN}.vllm_cfg.enforce_eager", kind=bool)},
        actor={"micro_batch_size": src.take("policy.train_micro_batch_size", kind=int)} | _optimizer(src, megatron),
        logprob={"micro_batch_size": src.take("policy.logprob_batch_size", kind=int)},
        trainer={"total_steps": src.take("grpo.max_num_steps", kind=int), "total_epochs": src.take("grpo.max_num_epochs", kind=int),
                 "seed": src.take("grpo.seed", kind=int), "test_freq": src.take("grpo.val_period", kind=int) or None,
                 "val_before_train": src.take("grpo.val_at_start", kind=bool), "log_dir": src.take_path("logger.log_dir"),
                 "project_name": src.take("logger.wandb.project"), "experiment_name": src.take("logger.wandb.name"),
                 "logger": layout.loggers(src, wandb="logger.wandb_enabled", tensorboard="logger.tensorboard_enabled",
                                          mlflow="logger.mlflow_enabled")},
    )
    if src.has("data.train.dataset_name") and not all_parquet(draft.data["train_files"]):
        src.take("data.train.dataset_name")
        src.remark("data.train.dataset_name", PARQUET_NOTE)
    _lengths(src, draft)
    _checkpoints(src, draft)
    _advantage(src, draft)
    _loss(src, draft, n)
    _features(src, draft, megatron)
    src.raise_problems()
    return draft


def _devices(src: Source, nodes: int, per_node: int) -> tuple[int, int, bool]:
    """The trainer's and the rollout's devices: the same, or the GPUs (one node) or nodes NeMo-RL gives vLLM."""
    if src.take(f"{GEN}.colocated.enabled", True, kind=bool):
        src.drop_under(f"{GEN}.colocated.resources", "the rollout shares the trainer's devices")
        return nodes * per_node, nodes * per_node, True
    key = f"{GEN}.colocated.resources"
    gpus, gen_nodes = src.take(f"{key}.gpus_per_node", kind=int), src.take(f"{key}.num_nodes", kind=int)
    gen = gpus if nodes == 1 else (gen_nodes or 0) * per_node
    if not gen or gen >= nodes * per_node:
        src.problem(f"{key}.gpus_per_node" if nodes == 1 else f"{key}.num_nodes", f"the rollout's devices ({gen}) leave "
                    f"none of the cluster's {nodes * per_node} to train on; expected fewer, and at least one")
        gen = 1
    return nodes * per_node - gen, gen, False


def _sizes(src: Source, megatron: bool) -> dict[str, int]:
    if megatron:
        src.drop_under(DT, "policy.megatron_cfg is enabled")
        for key in ("policy.optimizer", "policy.scheduler", "policy.max_grad_norm"):
            src.drop_under(key, "policy.megatron_cfg's optimizer and scheduler are used")
        return parallel_sizes("megatron", {k: src.take(f"{MEG}.{k}", kind=int) for k in option_sizes("megatron")})
    src.drop_under(MEG, "policy.megatron_cfg is off: the DTensor settings are used")
    src.remark(f"{DT}.enabled", "DTensor (FSDP2) becomes Megatron here, data parallel over the same devices")
    src.drop("policy.scheduler", "torch's schedulers are not read: set the actor's lr_warmup_steps and lr_decay_style")
    return parallel_sizes("megatron", {"tensor_model_parallel_size": src.take(f"{DT}.tensor_parallel_size", kind=int),
                                       "context_parallel_size": src.take(f"{DT}.context_parallel_size", kind=int)})


def _optimizer(src: Source, megatron: bool) -> dict:
    """Megatron's optimizer and scheduler keys, or the torch optimizer's kwargs (DTensor)."""
    if megatron:
        o, sched = f"{MEG}.optimizer", f"{MEG}.scheduler"
        betas = [src.take(f"{o}.adam_beta1", 0.9), src.take(f"{o}.adam_beta2", 0.999)]
        return {"lr": src.take(f"{o}.lr"), "min_lr": src.take(f"{o}.min_lr"), "weight_decay": src.take(f"{o}.weight_decay"),
                "betas": betas, "eps": src.take(f"{o}.adam_eps"), "clip_grad": src.take(f"{o}.clip_grad"),
                "use_distributed_optimizer": src.take(f"{o}.use_distributed_optimizer", kind=bool),
                "lr_decay_style": src.take(f"{sched}.lr_decay_style"), "lr_decay_steps": src.take(f"{sched}.lr_decay_iters", kind=int),
                "lr_warmup_steps": src.take(f"{sched}.lr_warmup_iters", kind=int),
                "sequence_parallel": src.take(f"{MEG}.sequence_parallel", kind=bool),
                "moe_token_dispatcher_type": src.take(f"{MEG}.moe_token_dispatcher_type")
                if src.value(f"{MEG}.moe_token_dispatcher_type") in ("allgather", "alltoall") else None}
    kwargs = "policy.optimizer.kwargs"
    return {"lr": src.take(f"{kwargs}.lr"), "weight_decay": src.take(f"{kwargs}.weight_decay"),
            "betas": src.take(f"{kwargs}.betas"), "eps": src.take(f"{kwargs}.eps"), "clip_grad": src.take("policy.max_grad_norm"),
            "param_offload": src.take(f"{DT}.cpu_offload", kind=bool), "sequence_parallel": src.take(f"{DT}.sequence_parallel", kind=bool)}


def _advantage(src: Source, draft: Draft) -> None:
    """GRPO's group baseline (leave-one-out or not) and its std normalization, or REINFORCE++."""
    name = src.take("grpo.adv_estimator.name", "grpo", kind=str)
    if name not in ESTIMATORS:
        src.problem("grpo.adv_estimator.name", f"'{name}' has no counterpart; expected one of {', '.join(ESTIMATORS)}")
    normalize = src.take("grpo.normalize_rewards", True, kind=bool)
    loo = src.take("grpo.use_leave_one_out_baseline", False, kind=bool)
    baseline = src.take("grpo.adv_estimator.minus_baseline", True, kind=bool)
    for key in ("grpo.adv_estimator.normalize_rewards", "grpo.adv_estimator.use_leave_one_out_baseline"):
        src.take(key)  # ${grpo.*}: the same values
    estimator = ESTIMATORS.get(name, "grpo")
    if estimator == "grpo" and loo and not normalize:
        estimator = "rloo"
    elif estimator == "grpo" and loo:
        src.remark("grpo.use_leave_one_out_baseline", "the group mean is the baseline here (GRPO); NeMo-RL's leaves each "
                                                      "sample out of it, which scales the advantages by about n / (n - 1)")
    elif estimator == "reinforce_plus_plus" and baseline:
        estimator = "reinforce_plus_plus_baseline"
    draft.advantage = {"estimator": estimator, "norm_by_std": False if estimator == "grpo" and not normalize else None}


def _loss(src: Source, draft: Draft, n: int) -> None:
    """The clipped loss, its aggregation, KL and the importance sampling correction."""
    token_level = src.take(f"{LOSS}.token_level_loss", True, kind=bool)
    sequence = src.take(f"{LOSS}.sequence_level_importance_ratios", False, kind=bool)
    draft.actor_params = {
        "mini_batch_size": layout.prompts_per_step(src, "policy.train_global_batch_size",
                                                   src.take("policy.train_global_batch_size", kind=int), n),
        "clip_ratio_low": src.take(f"{LOSS}.ratio_clip_min"), "clip_ratio_high": src.take(f"{LOSS}.ratio_clip_max"),
        "clip_ratio_c": src.take(f"{LOSS}.ratio_clip_c"), "loss_agg_mode": None if token_level else "seq-mean-token-mean",
        "policy_loss": "gspo" if sequence and not token_level else None}
    kl, kind = src.take(f"{LOSS}.reference_policy_kl_penalty", 0.01), src.take(f"{LOSS}.reference_policy_kl_type", "k3")
    if kl and src.take(f"{LOSS}.use_kl_in_reward", False, kind=bool):
        draft.reward = {"kl_coef": kl, "kl_estimator": kind}
    elif kl:
        draft.actor_params |= {"use_kl_loss": True, "kl_loss_coef": kl, "kl_loss_type": kind}
    if kl:
        draft.meshes["ref"] = {"alloc": draft.meshes["actor"], "colocate_with": "actor"}
    for key in ("disable_ppo_ratio", "force_on_policy_ratio", "use_cispo", "use_on_policy_kl_approximation"):
        if src.value(f"{LOSS}.{key}") is False:
            src.take(f"{LOSS}.{key}")
    if src.take(f"{LOSS}.positive_example_nll_weight", 0.0) != 0:
        src.taken.discard(f"{LOSS}.positive_example_nll_weight")
    key = f"{LOSS}.use_importance_sampling_correction"
    correction = [f"{LOSS}.truncated_importance_sampling_{k}" for k in ("type", "ratio", "ratio_min")]
    if src.take(key, False, kind=bool):
        kind, upper, lower = (src.take(k) for k in correction)
        corrections.typed(src, draft, kind, lower, upper, key, "sequence" if sequence else "token")
    else:
        for k in correction:
            if src.value(k) is None:
                src.take(k)
            else:
                src.drop(k, "use_importance_sampling_correction is off")


def _lengths(src: Source, draft: Draft) -> None:
    """NeMo-RL caps prompt + response at max_total_sequence_length; here each has its own budget, and the
    engine's context holds both."""
    total = src.take("policy.max_total_sequence_length", kind=int)
    prompt, response = draft.data["max_prompt_length"], draft.data["max_response_length"]
    context = draft.rollout["max_model_len"] or total
    if prompt and response and context and prompt + response > context:
        draft.rollout["max_model_len"] = prompt + response
        src.remark("policy.max_total_sequence_length", f"prompts of up to {prompt} and responses of up to {response} "
                   f"tokens share {context} there; each keeps its budget here, in a context of {prompt + response}")
    if (dropped := draft.one_micro_batch()) is not None:
        src.remark("policy.logprob_batch_size", f"old log-probs run on the training engine, with its micro batch "
                                                f"({draft.actor['micro_batch_size']}), not {dropped}")


def _checkpoints(src: Source, draft: Draft) -> None:
    if src.take("checkpointing.enabled", True, kind=bool):
        draft.trainer |= {"default_local_dir": src.take_path("checkpointing.checkpoint_dir"),
                          "save_freq": src.take("checkpointing.save_period", kind=int),
                          "max_ckpt_to_keep": src.take("checkpointing.keep_top_k", kind=int)}
        if draft.trainer["max_ckpt_to_keep"]:
            src.remark("checkpointing.keep_top_k", "the newest are kept here, not the best by checkpointing.metric_name")
    else:
        draft.trainer["save_freq"] = None
        src.drop_under("checkpointing", "checkpointing is off")


def _features(src: Source, draft: Draft, megatron: bool) -> None:
    """Packed micro batches, recomputation, LoRA, DAPO's parts, asynchrony."""
    for part in ("dynamic_batching", "sequence_packing"):
        if src.take(f"policy.{part}.enabled", False, kind=bool):
            draft.actor["dynamic_micro_batch_tokens"] = src.take(f"policy.{part}.train_mb_tokens", kind=int)
            src.drop(f"policy.{part}.logprob_mb_tokens", "old log-probs run on the training engine, packed as it is")
        else:
            src.drop_under(f"policy.{part}", f"{part} is off")
    if src.take(f"{MEG if megatron else DT}.activation_checkpointing", False, kind=bool):
        draft.actor |= {"recompute_granularity": src.take(f"{MEG}.recompute_granularity", "full") if megatron else "full",
                        "recompute_method": "uniform", "recompute_num_layers": 1}
    peft = f"{MEG}.peft" if megatron else f"{DT}.lora_cfg"
    if src.take(f"{peft}.enabled", False, kind=bool):
        targets = src.take(f"{peft}.target_modules") or []
        every = src.take(f"{peft}.match_all_linear", not targets)
        lora(draft, src.take(f"{peft}.dim"), src.take(f"{peft}.alpha"), "all-linear" if every else targets,
             src.take(f"{peft}.dropout"))
    if src.take("grpo.use_dynamic_sampling", False, kind=bool):
        draft.filter_groups = {"metric": "token_level_scores",
                               "max_gen_batches": src.take("grpo.dynamic_sampling_max_gen_batches", kind=int)}
    shaping = "grpo.reward_shaping"
    if src.take(f"{shaping}.enabled", False, kind=bool):
        draft.reward |= {"overlong_buffer_len": src.take(f"{shaping}.overlong_buffer_length", kind=int),
                         "overlong_penalty_factor": src.take(f"{shaping}.overlong_buffer_penalty")}
    else:
        src.drop_under(shaping, "reward shaping is off")
    if src.take("grpo.async_grpo.enabled", False, kind=bool):
        stale = src.take("grpo.async_grpo.max_trajectory_age_steps", 1, kind=int)
        draft.runtime = {"schedule": "async", "staleness": stale}
        src.remark("grpo.async_grpo.enabled", f"becomes schedule async with staleness {stale}")
    else:
        src.drop_under("grpo.async_grpo", "asynchronous GRPO is off")
    if src.value("grpo.max_rollout_turns") == 1:
        src.take("grpo.max_rollout_turns")
