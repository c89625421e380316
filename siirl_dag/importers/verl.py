"""verl and siiRL (which keeps verl's keys): Hydra overrides -> a pipeline.

verl runs actor, rollout and reference on the same devices (its hybrid engine): here they are
three colocated meshes over all `trainer.nnodes x trainer.n_gpus_per_node` devices, the actor's
and reference's Megatron sizes from `*.megatron.*`, the rollout's tensor parallel from
`rollout.tensor_model_parallel_size`, data parallel what is left. Batch sizes keep verl's
meaning: `ppo_mini_batch_size` counts prompts before `rollout.n` (as our `mini_batch_size`), the
`*_per_gpu` micro batches count samples per data-parallel rank (as our `micro_batch_size`); the
deprecated global micro batch sizes are divided by the data-parallel size, as verl does. A
multi-turn rollout with tools becomes the agent_rollout node (`verl_agentic`).
"""

from __future__ import annotations

from pathlib import Path

from siirl_dag.importers import corrections, verl_agentic
from siirl_dag.importers.draft import Draft, megatron_sizes
from siirl_dag.placement.allocation import spell as allocation
from siirl_dag.importers.shell_script import read_script
from siirl_dag.importers.source import Source
from siirl_dag.importers.features import lora
from siirl_dag.importers.verl_recipes import dapo, dynamic_batches, named_config, split_layout
from siirl_dag.trainer.trackers import TRACKERS

A = "actor_rollout_ref"
# source key (under a prefix) -> our option name, carried as written
ACTOR_OPTIONS = {"megatron.sequence_parallel": "sequence_parallel", "megatron.use_distributed_optimizer": "use_distributed_optimizer",
                 "megatron.param_offload": "param_offload", "megatron.grad_offload": "grad_offload",
                 "megatron.optimizer_offload": "optimizer_offload",
                 "megatron.virtual_pipeline_model_parallel_size": "virtual_pipeline_model_parallel_size",
                 "optim.lr": "lr", "optim.weight_decay": "weight_decay", "optim.lr_warmup_steps": "lr_warmup_steps",
                 "optim.min_lr": "min_lr", "optim.clip_grad": "clip_grad", "grad_clip": "clip_grad",
                 "ppo_micro_batch_size_per_gpu": "micro_batch_size"}
ACTOR_PARAMS = {"ppo_mini_batch_size": "mini_batch_size", "ppo_epochs": "epochs", "clip_ratio_low": "clip_ratio_low",
                "clip_ratio_high": "clip_ratio_high", "clip_ratio_c": "clip_ratio_c", "loss_agg_mode": "loss_agg_mode",
                "entropy_coeff": "entropy_coeff", "use_kl_loss": "use_kl_loss", "kl_loss_coef": "kl_loss_coef",
                "kl_loss_type": "kl_loss_type", "policy_loss.loss_mode": "policy_loss"}
ROLLOUT_OPTIONS = {"n": "n", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
                   "gpu_memory_utilization": "gpu_memory_utilization", "enforce_eager": "enforce_eager",
                   "max_num_seqs": "max_num_seqs", "max_model_len": "max_model_len",
                   "enable_prefix_caching": "enable_prefix_caching", "val_kwargs.temperature": "val_temperature"}
DATA = ("train_files", "val_files", "prompt_key", "train_batch_size", "val_batch_size", "max_prompt_length",
        "max_response_length", "filter_overlong_prompts", "shuffle", "seed")
TRAINER = {"total_epochs": "total_epochs", "total_training_steps": "total_steps", "test_freq": "test_freq",
           "save_freq": "save_freq", "val_before_train": "val_before_train", "resume_mode": "resume_mode",
           "resume_from_path": "resume_from_path", "default_local_dir": "default_local_dir",
           "project_name": "project_name", "experiment_name": "experiment_name",
           "max_actor_ckpt_to_keep": "max_ckpt_to_keep", "log_val_generations": "log_val_generations",
           "val_only": "val_only"}
PATHS = ("default_local_dir", "resume_from_path")
ESTIMATORS = {"grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "gae"}
NO_COUNTERPART = {  # keys whose effect this engine has built in, or does not need
    f"{A}.model.use_remove_padding": "sequences are always packed without padding here",
    f"{A}.rollout.free_cache_engine": "the rollout sleeps between steps by its sleep_level option",
    f"{A}.rollout.enable_chunked_prefill": "vLLM's own default is kept",
    f"{A}.rollout.load_format": "the rollout takes its weights from the trainer",
    f"{A}.hybrid_engine": "colocation is the meshes' colocate_with",
    "trainer.device": "cluster.device is cuda",
    "trainer.critic_warmup": "no counterpart: the critic and actor update every step",
}


def read(path: str | Path) -> Source:
    """A run script's command arguments, or a YAML of the same (nested) keys."""
    text_head = Path(path).read_bytes()[:4096]
    script = str(path).endswith(".sh") or text_head.startswith(b"#!")
    return read_script(path) if script else Source.from_yaml(path)


def convert(src: Source) -> Draft:
    named_config(src)
    nodes, per_node = src.take("trainer.nnodes", 1, kind=int), src.take("trainer.n_gpus_per_node", 8, kind=int)
    cluster = {"nodes": nodes, "devices_per_node": per_node, "device": "cuda"}
    gen_devices, devices, runtime = split_layout(src, cluster) or (nodes * per_node, nodes * per_node, {})
    for key, why in NO_COUNTERPART.items():
        src.drop(key, why)
    if src.take(f"{A}.rollout.name", "vllm") != "vllm":
        src.remark(f"{A}.rollout.name", "rollouts run on vLLM here")
    strategy = src.take(f"{A}.actor.strategy", "fsdp")  # verl's default
    if strategy != "megatron":  # the same devices, as data parallel on Megatron
        src.remark(f"{A}.actor.strategy", f"{strategy} becomes Megatron here, data parallel over the same devices")
        src.drop_under(f"{A}.actor.fsdp_config", f"the actor runs on Megatron here, not {strategy}")
    actor_sizes = _megatron_sizes(src, f"{A}.actor", devices)
    ref_sizes = _megatron_sizes(src, f"{A}.ref", devices, default=actor_sizes)
    rollout_tp = src.take(f"{A}.rollout.tensor_model_parallel_size", 2, kind=int)  # verl's default: 2
    if gen_devices % rollout_tp:
        src.problem(f"{A}.rollout.tensor_model_parallel_size", f"{gen_devices} devices do not split into vLLM engines of "
                    f"{rollout_tp}; expected a divisor of {gen_devices}")
    estimator = src.take("algorithm.adv_estimator", "gae", kind=str)
    if estimator not in ESTIMATORS:
        src.problem("algorithm.adv_estimator", f"'{estimator}' has no counterpart; expected one of {', '.join(sorted(ESTIMATORS))}")
    kl_in_reward = src.take("algorithm.use_kl_in_reward", False, kind=bool)
    use_kl_loss = src.take(f"{A}.actor.use_kl_loss", False, kind=bool)
    meshes = {"actor": allocation("megatron", **actor_sizes),
              "gen": {"alloc": allocation("vllm", max(gen_devices // rollout_tp, 1), tp=rollout_tp)}
              | ({} if runtime else {"colocate_with": "actor"})}
    if runtime:  # the rollout's devices first, as the recipe's resource pools are laid out
        meshes = {"gen": meshes["gen"]["alloc"], "actor": meshes["actor"]}
    if use_kl_loss or kl_in_reward:
        meshes["ref"] = {"alloc": allocation("megatron", **ref_sizes), "colocate_with": "actor"}
    actor_dp = actor_sizes["dp"]

    draft = Draft(
        name=str(src.take("trainer.experiment_name", Path(src.file).stem)).replace("_", "-"),
        cluster=cluster,
        runtime=runtime,
        policy={"path": src.take_path(f"{A}.model.path"),
                "dtype": src.take(f"{A}.actor.megatron.param_dtype", "bfloat16", kind=str),
                "trust_remote_code": src.take(f"{A}.model.trust_remote_code", kind=bool)},
        data={key: (src.take_path if key.endswith("_files") else src.take)(f"data.{key}") for key in DATA},
        meshes=meshes,
        rollout={ours: src.take(f"{A}.rollout.{key}") for key, ours in ROLLOUT_OPTIONS.items()},
        actor={ours: src.take(f"{A}.actor.{key}") for key, ours in ACTOR_OPTIONS.items()},
        actor_params={ours: src.take(f"{A}.actor.{key}") for key, ours in ACTOR_PARAMS.items()},
        advantage={"estimator": estimator, "norm_by_std": src.take("algorithm.norm_adv_by_std_in_grpo", kind=bool),
                   "gamma": src.take("algorithm.gamma"), "lam": src.take("algorithm.lam")},
        trainer={ours: (src.take_path if key in PATHS else src.take)(f"trainer.{key}") for key, ours in TRAINER.items()}
        | {"logger": _loggers(src)},
    )
    verl_agentic.convert(src, draft)
    draft.actor_params["use_kl_loss"] = use_kl_loss or None
    draft.actor_params["policy_loss"] = {"vanilla": None}.get(draft.actor_params["policy_loss"], draft.actor_params["policy_loss"])
    clip = src.take(f"{A}.actor.clip_ratio")
    for side in ("clip_ratio_low", "clip_ratio_high"):
        draft.actor_params[side] = draft.actor_params[side] if draft.actor_params[side] is not None else clip
    _lengths(src, draft)
    _micro_batches(src, draft, actor_dp, ref_sizes["dp"])
    if src.take(f"{A}.model.enable_gradient_checkpointing", False, kind=bool):
        draft.actor |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if kl_in_reward:
        draft.reward = {"kl_coef": src.take("algorithm.kl_ctrl.kl_coef", 0.001),
                        "kl_estimator": src.take("algorithm.kl_penalty", "kl", kind=str)}
        src.drop("algorithm.kl_ctrl.type", "the KL-in-reward coefficient is fixed here")
    dapo(src, draft)
    corrections.verl(src, draft)
    for key in ("param_offload", "grad_offload", "optimizer_offload"):  # FSDP's offloads mean the same
        if draft.actor.get(key) is None:
            draft.actor[key] = src.take(f"{A}.actor.fsdp_config.{key}", kind=bool)
    _ref_options(src, draft)
    dynamic_batches(src, draft)
    lora(draft, src.take(f"{A}.model.lora_rank", 0, kind=int), src.take(f"{A}.model.lora_alpha", 16),
         src.take(f"{A}.model.target_modules", "all-linear"))
    _resume_mode(src, draft)
    if estimator == "gae":
        _critic(src, draft, devices)
    if (dropped := draft.one_micro_batch()) is not None:
        src.remark(f"{A}.rollout.log_prob_micro_batch_size_per_gpu", f"old log-probs run on the training engine, with "
                   f"its micro batch ({draft.actor['micro_batch_size']}), not {dropped}")
    src.raise_problems()
    return draft


def _megatron_sizes(src: Source, role: str, devices: int, default: dict | None = None) -> dict[str, int]:
    sizes = megatron_sizes(src, f"{role}.megatron", default)
    replica = sizes["tp"] * sizes["pp"] * sizes["cp"]
    if devices % replica:
        src.problem(f"{role}.megatron.tensor_model_parallel_size", f"{devices} devices do not split into replicas of "
                    f"t{sizes['tp']} x p{sizes['pp']} x c{sizes['cp']} = {replica}; expected sizes whose product divides {devices}")
    return {"dp": max(devices // replica, 1)} | sizes


def _loggers(src: Source) -> list[str] | None:
    value = src.take("trainer.logger")
    if value is None:
        return None
    names = [value] if isinstance(value, str) else list(value)
    here = ("console", *TRACKERS)
    kept = [n for n in names if n in here]
    if kept != names:
        others = ", ".join(n for n in names if n not in kept)
        src.remark("trainer.logger", f"{others} left out: the loggers here are {', '.join(here)}")
    return kept


def _lengths(src: Source, draft: Draft) -> None:
    """The rollout's lengths are the data's here; a different one is named, not dropped."""
    draft.rollout["max_tokens"] = draft.data.get("max_response_length")
    for key, data_key in (("prompt_length", "max_prompt_length"), ("response_length", "max_response_length")):
        value = src.keys.get(f"{A}.rollout.{key}", (None, None))[0]
        if value is not None and value == draft.data.get(data_key):
            src.take(f"{A}.rollout.{key}")
        else:
            src.drop(f"{A}.rollout.{key}", f"the rollout's lengths are data.{data_key} here")


def _micro_batches(src: Source, draft: Draft, actor_dp: int, ref_dp: int) -> None:
    """verl's deprecated global micro batch sizes, divided among data-parallel ranks as verl does."""
    for key, target, dp in ((f"{A}.actor.ppo_micro_batch_size", draft.actor, actor_dp),
                            (f"{A}.rollout.log_prob_micro_batch_size", draft.logprob, actor_dp),
                            (f"{A}.ref.log_prob_micro_batch_size", draft.ref, ref_dp)):
        per_gpu = src.take(f"{key}_per_gpu", kind=int)
        total = src.take(key, kind=int)
        if per_gpu is None and total is not None:
            if total % dp:
                src.problem(key, f"{total} does not divide among {dp} data-parallel ranks; expected a multiple of {dp}")
            per_gpu = max(total // dp, 1)
        if per_gpu is not None:
            target["micro_batch_size"] = per_gpu


def _ref_options(src: Source, draft: Draft) -> None:
    if "ref" not in draft.meshes:
        src.drop_under(f"{A}.ref", "no reference log-probs are needed (no KL loss or KL in reward)")
        return
    offload = src.take(f"{A}.ref.megatron.param_offload", kind=bool)
    draft.ref |= {"param_offload": offload if offload is not None else src.take(f"{A}.ref.fsdp_config.param_offload", kind=bool),
                  "sequence_parallel": src.take(f"{A}.ref.megatron.sequence_parallel", kind=bool)}


def _resume_mode(src: Source, draft: Draft) -> None:
    """verl's resume modes; `off` (or YAML's false) is disable."""
    mode = src.value("trainer.resume_mode")
    if mode in (False, "off", "false", "disable", "disabled"):
        draft.trainer["resume_mode"] = "disable"
        if mode != "disable":
            src.remark("trainer.resume_mode", f"{mode!r} becomes disable (no resuming)")


def _critic(src: Source, draft: Draft, devices: int) -> None:
    sizes = _megatron_sizes(src, "critic", devices)
    draft.meshes["critic"] = {"alloc": allocation("megatron", **sizes), "colocate_with": "actor"}
    draft.critic_model = {"path": src.take_path("critic.model.path", draft.policy["path"]), "dtype": draft.policy["dtype"]}
    draft.critic = {"lr": src.take("critic.optim.lr"), "micro_batch_size": src.take("critic.ppo_micro_batch_size_per_gpu", kind=int)}
    draft.critic_params = {"mini_batch_size": src.take("critic.ppo_mini_batch_size", draft.actor_params.get("mini_batch_size"), kind=int),
                           "epochs": src.take("critic.ppo_epochs", kind=int), "cliprange_value": src.take("critic.cliprange_value")}
