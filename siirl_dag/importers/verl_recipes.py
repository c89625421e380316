"""What verl says outside its plain PPO keys: the named config a script starts from
(`--config-name=ppo_megatron_trainer`, or a config of the script's own, read), the one-step-off and
fully-async recipes' split between rollout and trainer devices, DAPO's dynamic sampling and overlong
shaping, dynamic batch sizes."""

from __future__ import annotations

import math

from siirl_dag.importers import side_files
from siirl_dag.importers.draft import Draft
from siirl_dag.importers.source import Source

A = "actor_rollout_ref"
# verl's named configs -> the defaults (of its keys) that differ from ppo_trainer's and matter here
MEGATRON_DEFAULTS = {f"{A}.actor.strategy": "megatron", "critic.strategy": "megatron",
                     f"{A}.actor.megatron.sequence_parallel": True, f"{A}.actor.megatron.use_distributed_optimizer": True,
                     f"{A}.ref.megatron.sequence_parallel": True}
KNOWN_CONFIGS = ("ppo_trainer", "ppo_megatron_trainer", "one_step_off_ppo_trainer", "one_step_off_ppo_megatron_trainer",
                 "fully_async_ppo_trainer", "fully_async_ppo_megatron_trainer", "dapo_trainer", "dapo_megatron_trainer")
SCORES = {"acc": "token_level_scores", "score": "token_level_scores", "seq_final_reward": "token_level_scores",
          "seq_reward": "token_level_rewards"}


def named_config(src: Source) -> None:
    """Apply the defaults of the config the script names (what it does not override itself): verl's own
    are known by name; the script's own (a Hydra config on top of one of verl's) is read where it is
    found (`side_files`), its keys used where the script does not set them."""
    name = str(src.take("--config-name", "ppo_trainer")).removesuffix(".yaml").strip("'\"")
    base = name if name in KNOWN_CONFIGS else _own_config(src, name)
    src.take("--config-path")
    if "megatron" in base:
        tp = src.value(f"{A}.actor.megatron.tensor_model_parallel_size", 1)
        for key, value in MEGATRON_DEFAULTS.items():
            if key not in src.keys and not (key.endswith("sequence_parallel") and tp == 1):
                src.keys[key] = (value, None)  # as the named config sets it; line: none in the script


def _own_config(src: Source, name: str) -> str:
    """Read the script's own named config where it is found; returns the verl config it starts from."""
    fallback = "ppo_megatron_trainer" if "megatron" in name else "ppo_trainer"
    path, tried = side_files.find(src, "--config-path", f"{name}.yaml")
    if path is None:
        src.remark("--config-name", f"{name}.yaml is not found (tried {', '.join(side_files.shown(src, p) for p in tried)}): "
                                    f"its own settings are not known here, verl's {fallback} defaults are used")
        return fallback
    side_files.read(src, path)
    src.taken.add("--config-path")  # found, also where the script's variables leave the path unknown
    defaults = src.value("defaults")
    named = [d for d in defaults if isinstance(d, str) and d != "_self_"] if isinstance(defaults, list) else []
    base = named[0] if named else fallback
    src.drop("defaults", f"Hydra's defaults list: verl's {base} defaults are used")
    src.drop_under("hydra", "Hydra's own settings")
    src.remark("--config-name", f"read {side_files.shown(src, path)}: its keys are used where the script does not set "
                                f"them, over verl's {base} defaults")
    return base


def split_layout(src: Source, cluster: dict) -> tuple[int, int, dict] | None:
    """The one-step-off / fully-async recipes: `rollout.nnodes x rollout.n_gpus_per_node` devices generate
    while `trainer.*` ones train. Returns (rollout devices, trainer devices, runtime), or None for a
    colocated run; `cluster` grows to hold both."""
    r_per = src.take("rollout.n_gpus_per_node", kind=int)
    if not r_per:
        return None
    r_nodes = src.take("rollout.nnodes", 1, kind=int)
    t_nodes, t_per = cluster["nodes"], cluster["devices_per_node"]
    src.take(f"{A}.hybrid_engine")
    if r_nodes == t_nodes:
        cluster["devices_per_node"] = r_per + t_per
    else:
        per = max(r_per, t_per)
        cluster |= {"nodes": math.ceil(r_nodes * r_per / per) + math.ceil(t_nodes * t_per / per), "devices_per_node": per}
    stale = src.take("async_training.staleness_threshold")
    if src.has("async_training.staleness_threshold") or src.value("async_training.partial_rollout") is not None:
        partial = bool(src.take("async_training.partial_rollout", False))
        runtime = {"schedule": "async", "staleness": 1} | ({"partial_rollout": True} if partial else {})
        src.remark("async_training.staleness_threshold", f"fully async becomes schedule async, at most 1 weight "
                   f"version behind (verl bounds the share of stale samples, {stale}, not their age)")
    else:
        runtime = {"schedule": "one_step_off"}
        src.remark("rollout.n_gpus_per_node", f"one step off policy: the rollout on {r_nodes * r_per} devices of its "
                   f"own generates the next batch while {t_nodes * t_per} devices train (schedule one_step_off)")
    src.drop_under("async_training", "fully async's own knobs; the schedule's staleness bounds it here")
    return r_nodes * r_per, t_nodes * t_per, runtime


def dapo(src: Source, draft: Draft) -> None:
    """Dynamic sampling (algorithm.filter_groups) and overlong shaping, in verl's or the reward kwargs' keys."""
    if src.take("algorithm.filter_groups.enable", False, kind=bool):
        metric = src.take("algorithm.filter_groups.metric", "acc")
        rounds = src.take("algorithm.filter_groups.max_num_gen_batches", 10, kind=int)
        draft.filter_groups = {"metric": SCORES.get(metric, "token_level_scores"), "max_gen_batches": rounds or None}
        if metric not in SCORES or not rounds:
            src.remark("algorithm.filter_groups.metric", f"groups are kept by the spread of their {SCORES.get(metric, 'scores')}"
                       + ("; no limit on generation rounds becomes the default limit (10)" if not rounds else ""))
    else:
        src.drop_under("algorithm.filter_groups", "dynamic sampling is off")
    for prefix in ("reward_model.overlong_buffer", "reward_model.reward_kwargs.overlong_buffer_cfg"):
        if src.take(f"{prefix}.enable", False, kind=bool):
            draft.reward |= {"overlong_buffer_len": src.take(f"{prefix}.len", kind=int),
                             "overlong_penalty_factor": src.take(f"{prefix}.penalty_factor")}
            src.take(f"{prefix}.log")
        else:
            src.drop_under(prefix, "overlong shaping is off")
    length = src.value("reward_model.reward_kwargs.max_resp_len")
    if length is not None and length == draft.data.get("max_response_length"):
        src.take("reward_model.reward_kwargs.max_resp_len")
    if src.value("reward_model.reward_manager") in ("naive", "dapo", None):
        src.take("reward_model.reward_manager")  # the reward node scores (and shapes) as both do


def dynamic_batches(src: Source, draft: Draft) -> None:
    """use_dynamic_bsz: micro batches packed by tokens, for the update, old and reference log-probs."""
    if src.take(f"{A}.actor.use_dynamic_bsz", False, kind=bool):
        draft.actor["dynamic_micro_batch_tokens"] = src.take(f"{A}.actor.ppo_max_token_len_per_gpu", 16384, kind=int)
    for role, target in (("rollout", draft.logprob), ("ref", draft.ref)):
        if src.take(f"{A}.{role}.log_prob_use_dynamic_bsz", False, kind=bool):
            key = f"{A}.{role}.log_prob_max_token_len_per_gpu"
            tokens, trained = src.take(key, 16384, kind=int), draft.actor.get("dynamic_micro_batch_tokens")
            if role == "rollout" and trained not in (None, tokens):  # old log-probs run on the training engine
                src.remark(key, f"old log-probs run on the training engine, packed as it is ({trained} tokens), not {tokens}")
                continue
            target["dynamic_micro_batch_tokens"] = tokens
