"""AReaL: an experiment YAML -> a pipeline.

The devices come from the per-engine `backend` strings (`rollout.backend: sglang:d4t2`,
`actor.backend: fsdp:d8`; an empty `critic.backend` / `ref.backend` inherits the actor's and shares
its devices) or the legacy `allocation_mode` (`sglang:d4+megatron:d4`). The strings are AReaL's
allocation syntax, which ours extends, so they carry over as written; SGLang becomes vLLM and FSDP or
Archon becomes Megatron on the same devices. AReaL is asynchronous: `max_head_offpolicyness: N`
becomes `runtime.schedule: async` with `staleness: N`. An agent workflow becomes the agent_rollout
node where a built-in matches it (`areal_agentic`).
"""

from __future__ import annotations

from pathlib import Path

from siirl_dag.errors import ConfigError
from siirl_dag.importers import areal_agentic, corrections
from siirl_dag.importers.draft import PARQUET_NOTE, Draft, all_parquet, strategy_options
from siirl_dag.importers.features import decay_steps, lora, refuse
from siirl_dag.importers.source import Source
from siirl_dag.placement.allocation import parse_allocation

OURS = {"sglang": "vllm", "vllm": "vllm", "fsdp": "megatron", "megatron": "megatron", "archon": "megatron"}
INFERENCE = ("sglang", "vllm")
DECAY = {"constant": "constant", "linear": "linear", "cosine": "cosine"}
NO_COUNTERPART = {"trial_name": "a run is named by trainer.experiment_name", "scheduler": "Ray places the meshes",
                  "cluster.fileroot": "runs write under trainer.default_local_dir", "cluster.name_resolve": "Ray finds the workers",
                  "perf_tracer": "trace a run with --trace", "stats_logger.wandb": "W&B is trainer.logger: [wandb] here, set by its environment (WANDB_MODE, WANDB_API_KEY)",
                  "launcher": "Ray starts the workers", "tokenizer_path": "the tokenizer is the model's",
                  "enable_offload": "offload is per engine (param_offload, sleep_level)"}
BOOKKEEPING = ("saver", "recover", "evaluator", "stats_logger", "train_dataset", "valid_dataset")
PER_ENGINE_NOISE = ("experiment_name", "trial_name", "scheduling_spec", "init_from_scratch", "disable_dropout", "fileroot",
                    "tokenizer_path", "scheduling_strategy", "path", "dtype", "optimizer", "mb_spec")


def read(path: str | Path) -> Source:
    return Source.from_yaml(path)


def convert(src: Source) -> Draft:
    _refuse_what_is_not_rl(src)
    for key, why in NO_COUNTERPART.items():
        src.drop_under(key, why)
    meshes, world, server = _meshes(src)
    experiment = src.take("experiment_name")
    per_node, device = src.take("cluster.n_gpus_per_node", 8, kind=int), "cuda"
    if per_node < 1:  # AReaL's CPU template
        per_node, device = max(world, 1), "cpu"
        src.remark("cluster.n_gpus_per_node", f"no GPUs: a CPU run here, {per_node} CPU devices")
    nodes = src.take("cluster.n_nodes", -(-world // per_node), kind=int)
    batch = src.take("train_dataset.batch_size", kind=int)
    n = src.take("gconfig.n_samples", 1, kind=int)
    kl = src.take("actor.kl_ctl", 0.0)
    if not kl:
        meshes.pop("ref", None)
        src.drop_under("ref", "no reference log-probs are needed (actor.kl_ctl is 0)")
    optim = "actor.optimizer"
    betas = [src.take(f"{optim}.beta1", 0.9), src.take(f"{optim}.beta2", 0.999)]
    draft = Draft(
        name=str(experiment or Path(src.file).stem).replace("_", "-"),
        cluster={"nodes": nodes, "devices_per_node": per_node, "device": device},
        policy={"path": src.take("actor.path", kind=str), "dtype": src.take("actor.dtype", kind=str)},
        data={"train_files": src.take("train_dataset.path"), "val_files": src.take("valid_dataset.path"),
              "train_batch_size": batch, "val_batch_size": src.take("valid_dataset.batch_size", kind=int),
              "max_prompt_length": src.take("train_dataset.max_length", kind=int),
              "max_response_length": src.take("gconfig.max_new_tokens", kind=int), "shuffle": src.take("train_dataset.shuffle")},
        meshes=meshes,
        rollout={"n": n, "temperature": src.take("gconfig.temperature"), "top_p": src.take("gconfig.top_p"),
                 "top_k": src.take("gconfig.top_k", kind=int), "max_tokens": src.keys.get("gconfig.max_new_tokens", (None,))[0]},
        reward={"kl_coef": kl or None},
        actor={"lr": src.take(f"{optim}.lr"), "weight_decay": src.take(f"{optim}.weight_decay"),
               "betas": betas if betas != [0.9, 0.999] else None, "eps": src.take(f"{optim}.eps"),
               "clip_grad": src.take(f"{optim}.gradient_clipping"),
               "lr_decay_style": DECAY.get(src.take(f"{optim}.lr_scheduler_type")),
               "dynamic_micro_batch_tokens": src.take("actor.mb_spec.max_tokens_per_mb", kind=int)},
        trainer={"total_epochs": src.take("total_train_epochs", kind=int), "seed": src.take("seed", kind=int),
                 "total_steps": src.take("total_train_steps", kind=int),
                 "experiment_name": experiment,
                 "save_freq": src.take("saver.freq_steps", kind=int), "test_freq": src.take("evaluator.freq_steps", kind=int),
                 "resume_mode": {"disabled": "disable"}.get(src.take("recover.mode"), "auto")},
    )
    src.take(f"{optim}.type")
    draft.logprob = {"dynamic_micro_batch_tokens": draft.actor["dynamic_micro_batch_tokens"]}
    if "ref" in meshes:
        draft.ref = {"dynamic_micro_batch_tokens": src.take("ref.mb_spec.max_tokens_per_mb", kind=int)}
    draft.actor |= _megatron_options(src, meshes)
    if src.take("actor.gradient_checkpointing", False, kind=bool):
        draft.actor |= {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    _loss(src, draft, batch, n)
    _dapo(src, draft)
    _lr(src, draft)
    lora(draft, src.take("actor.lora_rank") if src.take("actor.use_lora", False) else None,
         src.take("actor.lora_alpha"), src.take("actor.target_modules"))
    for key in ("actor.peft_type", "rollout.use_lora", "rollout.lora_name", "sglang.enable_lora", "vllm.enable_lora",
                "sglang.max_lora_rank", "vllm.max_lora_rank"):
        src.take(key)
    _advantage(src, draft, n)
    _rollout_engine(src, draft, server)
    _asynchrony(src, draft)
    areal_agentic.convert(src, draft)  # after the rollout section's catch-all, so its agent keys say their own why
    for key, part in (("train_dataset.path", "train_files"), ("valid_dataset.path", "val_files")):
        if not all_parquet(draft.data.get(part)):
            src.remark(key, PARQUET_NOTE)
    for role in ("actor", "ref", "critic"):
        for key in PER_ENGINE_NOISE:
            src.drop_under(f"{role}.{key}", "AReaL's per-engine bookkeeping")
    for key in BOOKKEEPING:
        src.drop_under(key, "AReaL's saving, recovery, evaluation and loading settings; see trainer.save_freq / test_freq")
    if src.take("gconfig.min_new_tokens", 0) != 0 or src.take("gconfig.greedy", False) is not False:
        src.problem("gconfig.greedy", "greedy or a minimum length has no counterpart; expected greedy: false and "
                                      "min_new_tokens: 0 (sampling)")
    src.raise_problems()
    return draft


def _meshes(src: Source) -> tuple[dict, int, str]:
    """gen, actor and (colocated with the actor) ref / critic from the backend strings; their devices
    and the source's inference backend."""
    strings = {role: src.take(f"{role}.backend", "", kind=str) for role in ("rollout", "actor", "ref", "critic")}
    legacy = src.take("allocation_mode", "", kind=str)
    if legacy and not strings["actor"]:
        components = _parse(src, "allocation_mode", _legacy(src, legacy))
        strings["rollout"] = next((c for c in components if c.split(":")[0] in INFERENCE), "")
        strings["actor"] = next((c for c in components if c.split(":")[0] not in INFERENCE), "")
    elif legacy:
        src.drop("allocation_mode", "the per-engine backend strings are used (the legacy field is ignored, as in AReaL)")
    meshes, world = {}, 0
    for role, name in (("rollout", "gen"), ("actor", "actor")):
        if not strings[role]:
            src.problem(f"{role}.backend", f"no {role} backend; expected e.g. {'sglang:d4t2' if role == 'rollout' else 'fsdp:d8'}")
            continue
        meshes[name], size = _ours(src, f"{role}.backend" if src.has(f"{role}.backend") else "allocation_mode", strings[role])
        world += size
    for role in ("ref", "critic"):
        if src.under(role) and "actor" in meshes:
            own = strings[role] and _ours(src, f"{role}.backend", strings[role])[0]
            meshes[role] = {"alloc": own or meshes["actor"], "colocate_with": "actor"}
    return meshes, world, strings["rollout"].split(":")[0]


def _parse(src: Source, key: str, text: str) -> list[str]:
    """Components of an allocation string as written, or a problem at the key."""
    try:
        components = parse_allocation(text)
    except ConfigError as exc:
        src.problem(key, "; ".join(p.message for p in exc.problems))
        return []
    return [c.text for c in components]


def _ours(src: Source, key: str, text: str) -> tuple[str, int]:
    """An AReaL component in our spelling (backend renamed, dims as written), and its device count."""
    backend, _, body = text.strip().partition(":")
    ours = f"{OURS.get(backend, backend)}:{body}"  # fsdp:d4p1t1 is Megatron's d4 p1 t1 here (fsdp takes no p)
    parsed = parse_allocation(ours) if _parse(src, key, ours) else []
    if len(parsed) != 1:
        if parsed:
            src.problem(key, f"'{text}' has {len(parsed)} components; expected one engine's backend string")
        return text, 0
    if OURS.get(backend) != backend:
        src.remark(key, f"{backend} becomes {OURS.get(backend, backend)} here, on the same devices with the same layout "
                        f"({body}: data, tensor, pipeline, context parallel as written)")
    return ours, parsed[0].dims.world_size


def _legacy(src: Source, text: str) -> str:
    """Older allocation_mode spellings: `sglang.d4p1t1+d4p1t1` (a dot; a training part without backend, fsdp)."""
    parts = [p.strip() for p in text.split("+")]
    fixed = [p.replace(".", ":", 1) if p.split(".")[0] in INFERENCE else p for p in parts]
    fixed = [p if ":" in p or "(" in p else f"fsdp:{p}" for p in fixed]
    if fixed != parts:
        src.remark("allocation_mode", f"read as {'+'.join(fixed)} (AReaL's older spelling: a training part without a "
                                      "backend is fsdp)")
    return "+".join(fixed)


def _refuse_what_is_not_rl(src: Source) -> None:
    """Runs without a rollout (SFT, DPO, reward models) are refused before anything is converted."""
    if not (src.value("rollout.backend") or src.value("allocation_mode") or src.under("gconfig")):
        refuse(src, "", "no rollout (rollout.backend, allocation_mode, gconfig): an SFT, DPO or reward-model "
                        "experiment, which is not RL training; expected an RL experiment")


def _lr(src: Source, draft: Draft) -> None:
    """AReaL's schedule: min_lr_ratio and warmup_steps_proportion of the run's optimizer steps."""
    optim, steps = "actor.optimizer", draft.trainer.get("total_steps")
    per_step = src.value("actor.ppo_n_minibatches", 1)
    ratio, warmup = src.take(f"{optim}.min_lr_ratio", 0.0), src.take(f"{optim}.warmup_steps_proportion", 0.0)
    if ratio and draft.actor.get("lr"):
        draft.actor["min_lr"] = draft.actor["lr"] * ratio
    if warmup and steps:
        draft.actor["lr_warmup_steps"] = int(warmup * steps * per_step)
    elif warmup:
        src.remark(f"{optim}.warmup_steps_proportion", "no warm-up: the run's length in steps is not given (only epochs)")
    decay_steps(src, draft, f"{optim}.lr_scheduler_type", steps, per_step)


def _megatron_options(src: Source, meshes: dict) -> dict:
    """actor.megatron.* that are options here; sequence parallel on with tensor parallel, as AReaL does."""
    options = {"deterministic": src.take("actor.megatron.use_deterministic_algorithms", kind=bool)}
    options |= strategy_options(src, "actor.megatron", "megatron")
    try:
        tp = parse_allocation(meshes["actor"])[0].dims.tp if "actor" in meshes else 1
    except ConfigError:  # already reported at the source's backend string
        tp = 1
    if tp > 1:
        options.setdefault("sequence_parallel", True)
    return options


def _loss(src: Source, draft: Draft, batch: int | None, n: int) -> None:
    minibatches = src.take("actor.ppo_n_minibatches", 1, kind=int)
    if batch and batch % minibatches:
        src.problem("actor.ppo_n_minibatches", f"{batch} prompts do not split into {minibatches} mini batches; "
                    f"expected a divisor of train_dataset.batch_size")
    clip = src.take("actor.eps_clip")
    draft.actor_params = {"mini_batch_size": max((batch or minibatches) // minibatches, 1), "clip_ratio_low": clip,
                          "clip_ratio_high": src.take("actor.eps_clip_higher", clip),
                          "temperature": src.take("actor.temperature")}
    if src.take("actor.importance_sampling_level", "token") in ("sequence", "seq"):
        draft.actor_params["policy_loss"] = "gspo"
        src.remark("actor.importance_sampling_level", "becomes policy_loss: gspo (one clipped ratio per sequence)")
    corrections.areal(src, draft)
    src.take("actor.recompute_logprob")  # old log-probs are always recomputed by the trainer here
    for key in ("actor.group_size", "actor.max_new_tokens"):
        src.take(key)
    for key in ("actor.reward_scaling", "actor.reward_bias"):
        src.drop(key, "rewards are the scorer's here, unscaled")


def _dapo(src: Source, draft: Draft) -> None:
    """DAPO's parts in AReaL's keys: the overlong penalty (verl's, on the rewards) and dynamic batches."""
    if src.take("actor.overlong_reward_penalty", False, kind=bool):
        draft.reward |= {"overlong_buffer_len": src.take("actor.overlong_tokens", kind=int),
                         "overlong_penalty_factor": src.take("actor.overlong_penalty_factor")}
    else:
        for key in ("actor.overlong_tokens", "actor.overlong_penalty_factor"):
            src.drop(key, "the overlong penalty is off (actor.overlong_reward_penalty)")
    if src.take("dynamic_bs", False, kind=bool):
        draft.filter_groups = {"metric": "token_level_scores"}
        src.remark("dynamic_bs", "becomes a filter_groups node (DAPO's dynamic sampling): groups whose scores all agree "
                                 "are dropped, as the acceptance test of AReaL's DAPO example does, and more prompts "
                                 "are generated until the batch is full, where AReaL trains on the accepted part")


def _advantage(src: Source, draft: Draft, n: int) -> None:
    """Group reward normalization is GRPO; with a critic, GAE."""
    mean, std = src.take("actor.reward_norm.mean_level"), src.take("actor.reward_norm.std_level")
    src.take("actor.reward_norm.group_size")
    src.drop_under("actor.adv_norm", "advantages are normalized by the estimator (grpo: per group; gae: per batch)")
    if "critic" in draft.meshes:
        draft.advantage = {"estimator": "gae", "gamma": src.take("actor.discount"), "lam": src.take("actor.gae_lambda")}
        draft.critic_model = {"path": src.take("critic.path", draft.policy["path"]), "dtype": draft.policy["dtype"]}
        draft.critic = {"lr": src.take("critic.optimizer.lr")}
        draft.critic_params = {"mini_batch_size": draft.actor_params["mini_batch_size"],
                               "cliprange_value": src.take("critic.value_eps_clip", src.take("critic.eps_clip"))}
        return
    draft.advantage = {"estimator": "grpo", "norm_by_std": None if std == "group" else False}
    if mean != "group":
        src.remark("actor.reward_norm.mean_level", f"{mean} becomes GRPO's per-group baseline")


def _rollout_engine(src: Source, draft: Draft, server: str) -> None:
    """The inference server's memory share and context length, from its section (sglang or vllm)."""
    share, length = (("vllm.gpu_memory_utilization", "vllm.max_model_len") if server == "vllm" else
                     ("sglang.mem_fraction_static", "sglang.context_length"))
    draft.rollout |= {"gpu_memory_utilization": src.take(share), "max_model_len": src.take(length, kind=int)}
    src.drop_under("sglang", "sglang's settings; rollouts run on vLLM here")
    src.drop_under("vllm", "set on the rollout node's options")


def _asynchrony(src: Source, draft: Draft) -> None:
    stale = src.take("rollout.max_head_offpolicyness", 0, kind=int)
    if stale:
        draft.runtime = {"schedule": "async", "staleness": stale}
        src.remark("rollout.max_head_offpolicyness", f"becomes schedule async with staleness {stale}: the rollout runs "
                                                     f"up to {stale} batches ahead of the training; a generation is "
                                                     "not interrupted by new weights (no partial rollouts here)")
    src.drop_under("rollout", "AReaL's rollout controller; the rollout node's options cover generation")
