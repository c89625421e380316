"""slime: a run script calling `train.py` / `train_async.py` with `--flag value` arguments -> a pipeline.

The flags (Megatron's and slime's, mostly in bash arrays) are read by `shell_flags`. The trainer is
Megatron on `--actor-num-nodes x --actor-num-gpus-per-node` devices with the `--*-parallel-size`
layout; the rollout's SGLang engines of `--rollout-num-gpus-per-engine` devices become vLLM ones, on
the same devices with `--colocate`, else on `--rollout-num-gpus` of their own (`train_async.py`:
`schedule: one_step_off`, the next batch generated while this one trains). `--global-batch-size`
counts samples per optimizer step (our `mini_batch_size` counts prompts). Megatron flags that are
options here (`--sequence-parallel`, `--recompute-*`, `--lr` ...) carry over by name. slime's loss
averages each sample's tokens, then the samples (`seq-mean-token-mean`) unless
`--calculate-per-token-loss`. The model's architecture flags (`MODEL_ARGS`, sourced from slime's
`scripts/models/`) are not needed: the checkpoint's config.json gives it.
"""

from __future__ import annotations

import re
from pathlib import Path

from siirl_dag.config import schema
from siirl_dag.importers import corrections, layout, side_files
from siirl_dag.importers.draft import PARQUET_NOTE, Draft, all_parquet
from siirl_dag.importers.shell_flags import read_flags
from siirl_dag.importers.source import Source
from siirl_dag.placement.rules import option_sizes, parallel_sizes
from siirl_dag.registry import STRATEGIES

ENTRY = re.compile(r"(?:^|/)(train(?:_async)?\.py)$")
NOT_RL = re.compile(r"(?:^|/)(train_sft\w*\.py|\w*sft\w*\.sh)\b")
ASYNC = "train_async.py"
ESTIMATORS = {"grpo": "grpo", "gspo": "grpo", "reinforce_plus_plus": "reinforce_plus_plus",
              "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline", "ppo": "gae"}
HANDLED = {"lr", "seed", "micro_batch_size"}  # Megatron options here that are read on their own
NO_COUNTERPART = {
    "--ref-load": "the reference loads the policy's HF checkpoint here (no torch_dist conversion)",
    "--wandb-key": "W&B reads its key from the environment (WANDB_API_KEY)",
    "--balance-data": "micro batches are packed by tokens with dynamic_micro_batch_tokens",
    "--offload": "colocated meshes sleep between phases by the rollout's sleep_level",
    "--offload-train": "colocated meshes sleep between phases by the rollout's sleep_level",
    "--offload-rollout": "colocated meshes sleep between phases by the rollout's sleep_level",
    "--n-samples-per-eval-prompt": "validation samples once per prompt here",
    "--eval-max-response-len": "validation uses data.max_response_length",
    "--eval-top-p": "validation samples with the rollout's top_p",
    "--accumulate-allreduce-grads-in-fp32": "gradients are reduced as Megatron's defaults here",
    "--attention-softmax-in-fp32": "Megatron's default here",
    "--attention-backend": "Megatron picks the attention backend here",
}


def read(path: str | Path) -> Source:
    """The flags the script's `train.py` / `train_async.py` command passes; which one, as the key `train_async.py`."""
    src = read_flags(path, ENTRY, NOT_RL, "slime's `python3 train.py` (or `train_async.py`) with --flag arguments")
    text = Path(path).read_text(encoding="utf-8", errors="replace")
    m = re.search(r"\btrain_async\.py\b", text)
    if m:
        src.keys[ASYNC] = (True, text.count("\n", 0, m.start()) + 1)
    config = src.value("--custom-config-path")
    if config:  # slime sets each of its keys on the arguments, over the flags
        found, _ = side_files.find(src, "--custom-config-path")
        if found is not None:
            side_files.read(src, found, prefix=f"{found.name}:")
            src.take("--custom-config-path")
    return src


def convert(src: Source) -> Draft:
    layout.hide(src, "--wandb-key")
    for key, why in NO_COUNTERPART.items():
        src.drop(key, why)
    if src.take("--optimizer", "adam") != "adam":
        src.problem("--optimizer", f"{src.value('--optimizer')!r} has no counterpart; expected adam")
    for key in [k for k in src.unresolved if "MODEL_ARGS" in k]:
        src.drop(key, "slime's model architecture flags (scripts/models/*.sh): the checkpoint's config.json gives it here")
    nodes, per_node = src.take("--actor-num-nodes", 1, kind=int), src.take("--actor-num-gpus-per-node", 8, kind=int)
    colocated = src.take("--colocate", False, kind=bool)
    sizes = parallel_sizes("megatron", {k: src.take("--" + k.replace("_", "-"), kind=int) for k in option_sizes("megatron")})
    gen_devices = src.take("--rollout-num-gpus", nodes * per_node if colocated else None, kind=int)
    if gen_devices is None:
        src.problem("--actor-num-nodes", "no --rollout-num-gpus: without --colocate the rollout needs GPUs of its own; "
                                         "expected --rollout-num-gpus N or --colocate")
        gen_devices = nodes * per_node
    n = src.take("--n-samples-per-prompt", 1, kind=int)
    estimator = src.take("--advantage-estimator", "grpo", kind=str)
    if estimator not in ESTIMATORS:
        src.problem("--advantage-estimator", f"'{estimator}' has no counterpart; expected one of {', '.join(ESTIMATORS)}")
    meshes = {"actor": layout.actor_mesh(src, "--tensor-model-parallel-size", nodes * per_node, sizes),
              "gen": layout.rollout_mesh(src, "--rollout-num-gpus-per-engine", gen_devices,
                                         src.take("--rollout-num-gpus-per-engine", 1, kind=int),
                                         nodes * per_node if colocated else None)}
    draft = Draft(
        name=str(src.value("--wandb-group") or Path(src.file).stem).replace("_", "-").replace(".", "-"),
        cluster=layout.cluster(nodes * per_node, per_node, gen_devices, colocated),
        policy={"path": src.take_path("--hf-checkpoint"), "dtype": "bfloat16"},
        data={"train_files": src.take_path("--prompt-data"), "prompt_key": src.take("--input-key", kind=str),
              "train_batch_size": src.take("--rollout-batch-size", kind=int),
              "max_prompt_length": src.take("--rollout-max-prompt-len", kind=int),
              "max_response_length": src.take("--rollout-max-response-len", kind=int),
              "shuffle": src.take("--rollout-shuffle", kind=bool)},
        meshes=meshes,
        rollout={"n": n, "temperature": src.take("--rollout-temperature"), "top_p": src.take("--rollout-top-p"),
                 "top_k": _top_k(src.take("--rollout-top-k", kind=int)),
                 "chat_template": src.take("--apply-chat-template", kind=bool),
                 "gpu_memory_utilization": src.take("--sglang-mem-fraction-static"),
                 "val_temperature": src.take("--eval-temperature")},
        advantage={"estimator": ESTIMATORS.get(estimator, "grpo"), "gamma": src.take("--gamma"), "lam": src.take("--lambd"),
                   "norm_by_std": False if src.take("--disable-grpo-std-normalization", False) else None},
        actor=_megatron_options(src),
        trainer={"total_steps": src.take("--num-rollout", kind=int), "total_epochs": src.take("--num-epoch", kind=int),
                 "seed": src.take("--seed", kind=int), "save_freq": src.take("--save-interval", kind=int),
                 "test_freq": src.take("--eval-interval", kind=int), "default_local_dir": src.take_path("--save"),
                 "project_name": src.take("--wandb-project"), "experiment_name": src.take("--wandb-group"),
                 "logger": layout.loggers(src, wandb="--use-wandb", tensorboard="--use-tensorboard")},
    )
    draft.rollout["max_tokens"] = draft.data["max_response_length"]
    if draft.rollout["gpu_memory_utilization"] is not None:
        src.remark("--sglang-mem-fraction-static", "SGLang's memory share becomes vLLM's gpu_memory_utilization")
    for key in [k for k in src.keys if k.startswith("--sglang-")]:
        src.drop(key, "SGLang's settings; rollouts run on vLLM here")
    _loss(src, draft, estimator, n)
    _kl(src, draft)
    _data(src, draft)
    _checkpoints(src, draft)
    corrections.slime(src, draft, config=f"{Path(str(src.value('--custom-config-path') or '')).name}:")
    if src.take(ASYNC, False):
        draft.runtime = {"schedule": "one_step_off"}
        src.remark(ASYNC, "becomes schedule one_step_off: the next batch is generated while this one trains")
    src.raise_problems()
    return draft


def _top_k(value: int | None) -> int | None:
    return None if value is None or value < 1 else value  # -1: no top-k


def _megatron_options(src: Source) -> dict:
    """The Megatron flags that are options here, by name (sizes went to the mesh); Adam's and the schedule's."""
    known = set(schema.load_schema(STRATEGIES["megatron"].options_schema)["properties"]) - set(option_sizes("megatron"))
    options = {name: src.take(flag) for flag in list(src.keys)
               if flag.startswith("--") and (name := flag[2:].replace("-", "_")) in known and name not in HANDLED}
    betas = [src.take("--adam-beta1", 0.9), src.take("--adam-beta2", 0.999)]
    options |= {"lr": src.take("--lr"), "betas": betas if betas != [0.9, 0.999] else None, "eps": src.take("--adam-eps"),
                "lr_warmup_steps": src.take("--lr-warmup-iters", kind=int),
                "lr_decay_steps": src.take("--lr-decay-iters", kind=int),
                "micro_batch_size": src.take("--micro-batch-size", kind=int)}
    if src.take("--use-dynamic-batch-size", False, kind=bool):
        options["dynamic_micro_batch_tokens"] = src.take("--max-tokens-per-gpu", kind=int)
    return options


def _loss(src: Source, draft: Draft, estimator: str, n: int) -> None:
    clip = src.take("--eps-clip", 0.2)
    steps = src.take("--num-steps-per-rollout", kind=int)
    samples = src.take("--global-batch-size", kind=int)
    if samples is None and steps and draft.data["train_batch_size"]:
        samples = draft.data["train_batch_size"] * n // steps
    draft.actor_params = {
        "mini_batch_size": layout.prompts_per_step(src, "--global-batch-size", samples, n),
        "clip_ratio_low": clip, "clip_ratio_high": src.take("--eps-clip-high", clip), "clip_ratio_c": src.take("--eps-clip-c"),
        "entropy_coeff": src.take("--entropy-coef"), "policy_loss": "gspo" if estimator == "gspo" else None,
        "loss_agg_mode": None if src.take("--calculate-per-token-loss", False) else "seq-mean-token-mean",
        "routing_replay": src.take("--use-routing-replay", False) or src.take("--use-rollout-routing-replay", False) or None}
    if estimator == "gspo":
        src.remark("--advantage-estimator", "gspo becomes the grpo estimator with policy_loss: gspo")
    if estimator.startswith("reinforce"):
        src.take("--normalize-advantages")  # slime requires it there; the estimator whitens here
    if estimator == "ppo":
        draft.meshes["critic"] = {"alloc": draft.meshes["actor"], "colocate_with": "actor"}
        draft.critic_model = {"path": src.take_path("--critic-hf-checkpoint", draft.policy["path"]), "dtype": "bfloat16"}
        draft.critic = {"lr": src.take("--critic-lr")}
        draft.critic_params = {"mini_batch_size": draft.actor_params["mini_batch_size"], "cliprange_value": src.take("--value-clip")}


def _kl(src: Source, draft: Draft) -> None:
    """KL as a loss (--use-kl-loss with a coefficient) or in the reward (--kl-coef): both need the reference."""
    coef, in_reward = src.take("--kl-loss-coef", 0.0), src.take("--kl-coef", 0.0)
    use = src.take("--use-kl-loss", False, kind=bool) and bool(coef)
    if use:
        draft.actor_params |= {"use_kl_loss": True, "kl_loss_coef": coef, "kl_loss_type": src.take("--kl-loss-type", "k1")}
    else:
        src.drop("--use-kl-loss", "--kl-loss-coef is 0: no KL loss, and no reference log-probs")
        src.drop("--kl-loss-type", "no KL loss")
    if in_reward:
        draft.reward = {"kl_coef": in_reward, "kl_estimator": src.take("--kl-loss-type", "k1")}
    if use or in_reward:
        draft.meshes["ref"] = {"alloc": draft.meshes["actor"], "colocate_with": "actor"}


def _data(src: Source, draft: Draft) -> None:
    if not all_parquet(draft.data["train_files"]):
        src.remark("--prompt-data", PARQUET_NOTE)
    evals = src.take("--eval-prompt-data")  # name path [name path ...]
    if isinstance(evals, list) and len(evals) % 2 == 0:
        draft.data["val_files"] = [str(p) for p in evals[1::2]]
        src.remark("--eval-prompt-data", f"the files of {', '.join(map(str, evals[::2]))}; validation reports them together")
    elif evals is not None:
        src.problem("--eval-prompt-data", f"{evals!r} is not pairs of a name and a file; expected NAME FILE [NAME FILE ...]")
    filter_path = str(src.value("--dynamic-sampling-filter-path", ""))
    if filter_path.endswith("check_reward_nonzero_std"):
        draft.filter_groups = {"metric": "token_level_scores"}
        src.take("--dynamic-sampling-filter-path")
        src.remark("--dynamic-sampling-filter-path", "becomes a filter_groups node: groups whose scores all agree are dropped")
    else:
        src.drop("--dynamic-sampling-filter-path", "a filter of your own: not read here")


def _checkpoints(src: Source, draft: Draft) -> None:
    """--save is where checkpoints go and where a run resumes from here; a --load elsewhere is said."""
    load, save = src.value("--load"), src.value("--save")
    if load is not None and load == save:
        src.take("--load")
    elif load is not None:
        src.remark("--load", f"a run resumes from default_local_dir ({save}) here: copy {load}'s checkpoint there")
        src.take("--load")
