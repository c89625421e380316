"""Features every peer spells its own way, mapped once onto this engine's: LoRA, the learning-rate
schedule's length, and the refusal of configurations this importer cannot carry (runs that are not
RL training; agents that are the peer's own Python, `agentic`)."""

from __future__ import annotations

from typing import NoReturn

from siirl_dag.errors import ConfigError, Problem
from siirl_dag.importers.draft import Draft
from siirl_dag.importers.source import Source

# Megatron's fused layer names (AReaL, ROLL on Megatron) -> the HF projections they hold
MEGATRON_MODULES = {"linear_qkv": ["q_proj", "k_proj", "v_proj"], "linear_proj": ["o_proj"],
                    "linear_fc1": ["gate_proj", "up_proj"], "linear_fc2": ["down_proj"]}


def lora(draft: Draft, rank, alpha=None, targets=None, dropout=None) -> None:
    """policy.lora from a peer's rank, alpha and target modules (a string, a comma list or a list)."""
    if not rank:
        return
    names = targets if isinstance(targets, list) else str(targets or "all-linear").split(",")
    modules: list[str] = []
    for name in (str(n).strip() for n in names):
        for ours in MEGATRON_MODULES.get(name, ["all-linear" if name in ("all", "all-linear", "all_linear") else name]):
            if ours not in modules:
                modules.append(ours)
    draft.policy["lora"] = {"rank": int(rank), "alpha": alpha, "dropout": dropout or None,
                            "target_modules": ["all-linear"] if "all-linear" in modules else modules}
    draft.policy["lora"] = {k: v for k, v in draft.policy["lora"].items() if v is not None}


def decay_steps(src: Source, draft: Draft, key: str, total_steps: int | None, per_step: int) -> None:
    """A decaying learning rate needs its length in optimizer steps (lr_decay_steps): the run's
    training steps x optimizer steps per training step; unknown, the schedule is kept constant and said so."""
    style = draft.actor.get("lr_decay_style")
    if style in (None, "constant") or draft.actor.get("lr_decay_steps"):
        return
    if total_steps:
        draft.actor["lr_decay_steps"] = total_steps * per_step
        src.remark(key, f"{style} over {total_steps} steps x {per_step} optimizer step(s) = lr_decay_steps "
                        f"{total_steps * per_step}")
        return
    draft.actor["lr_decay_style"] = "constant"
    src.remark(key, f"{style} needs the run's length in optimizer steps, which the source does not give (only epochs): "
                    "kept constant; set the actor's lr_decay_style and lr_decay_steps")


def refuse(src: Source, key: str, message: str) -> NoReturn:
    """Stop: the source is a kind of run this importer does not carry (at the file and line of `key`)."""
    file, line = src.where(key) if key else (src.file, None)
    raise ConfigError(Problem((key,) if key else (), message, file=file, line=line or 1))
