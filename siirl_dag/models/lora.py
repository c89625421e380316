"""`models.<name>.lora`: the adapters a model trains and its rollouts serve (no torch here).

On the model, not on a node: the trainer and every rollout of the model must hold the same adapter
shape, and a reference node uses the same model with its adapters off. Targets are HF projection
names with PEFT's meaning (a name adapts every layer of that name: `gate_proj` the dense MLPs and the
routed experts alike), plus `experts` (the routed experts' gate/up/down) and `all-linear` (every
projection, not the router nor the LM head). Checked at the door: targets the model has, fused
projections whole (megatron fuses q/k/v and gate/up into one layer, which gets one adapter), a rank
vLLM serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from siirl_dag.errors import Problem

VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values
ATTENTION, MLP = ("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj")
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


@dataclass(frozen=True)
class LoraSpec:
    rank: int
    alpha: float
    targets: frozenset[str]  # HF projections: dense ones ("q_proj") and routed experts' ("experts.gate_proj")
    dropout: float = 0.0
    init: str = "kaiming"  # kaiming (PEFT's default for A) | gaussian; B starts at zero either way
    moe: bool = False  # the model has routed experts

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @property
    def on_experts(self) -> bool:
        return any(t.startswith("experts.") for t in self.targets)

    def peft_config(self, base_model: str, value_head: bool = False) -> dict[str, Any]:
        """adapter_config.json of a PEFT folder (vLLM and peft read it); a value model (critic) is a token
        classifier whose new `score` head is saved beside the adapters."""
        modules = sorted({t.removeprefix("experts.") for t in self.targets})
        return {"peft_type": "LORA", "task_type": "TOKEN_CLS" if value_head else "CAUSAL_LM",
                "base_model_name_or_path": base_model, "r": self.rank, "lora_alpha": self.alpha,
                "lora_dropout": self.dropout, "target_modules": modules, "bias": "none", "fan_in_fan_out": False,
                "use_rslora": False, "modules_to_save": ["score"] if value_head else None}


def payload(spec: LoraSpec | None, device: str) -> tuple[str, str]:
    """What travels from a model's trainer to its rollouts, and why: "model" (its weights, adapters
    merged in) or "adapters" (only them; the rollout applies them to the base it loaded)."""
    if spec is None:
        return "model", "the model's weights"
    if device == "cpu" and spec.moe:
        return "model", ("the weights with the adapters merged in: vLLM serves LoRA on an MoE model through "
                         "Triton kernels, which CPUs lack")
    return "adapters", "only the adapters: vLLM applies them to the base it loaded"


def layers_of(hf_config: dict[str, Any]) -> tuple[bool, bool]:
    """(the model has dense MLPs, it has routed experts), as its HF config says."""
    experts = int(hf_config.get("num_experts") or hf_config.get("num_local_experts") or 0) > 0
    if not experts:
        return True, False
    n, step = int(hf_config.get("num_hidden_layers", 1)), int(hf_config.get("decoder_sparse_step", 1))
    dense = set(hf_config.get("mlp_only_layers") or [])
    return any(i in dense or (i + 1) % step for i in range(n)), True


def resolve(raw: dict[str, Any], hf_config: dict[str, Any] | None, path: tuple) -> tuple[LoraSpec | None, list[Problem]]:
    """The spec of a `lora:` block (schema-checked already), or the problems that refuse it."""
    # A model not on disk yet (validate before download): trust the names, experts where named.
    dense, experts = layers_of(hf_config) if hf_config is not None else (True, "experts" in raw["target_modules"])
    have = set(ATTENTION) | ({f"experts.{p}" for p in MLP} if experts else set()) | (set(MLP) if dense else set())
    targets, problems = set(), []
    for name in raw["target_modules"]:
        if name == "all-linear":
            found = have
        elif name == "experts":
            found = {f"experts.{p}" for p in MLP} & have
        else:
            found = {t for t in have if t.split(".")[-1] == name}
        if not found:
            accepted = sorted({t.split(".")[-1] for t in have} | {"all-linear"} | ({"experts"} if experts else set()))
            problems.append(Problem(path + ("target_modules",), f"{name!r}: the model has no such projection; "
                                                               f"expected some of {accepted}"))
        targets |= found
    for group in FUSED:
        for scope in ("", "experts."):
            chosen = [p for p in group if scope + p in targets]
            if chosen and len(chosen) < len(group):
                problems.append(Problem(path + ("target_modules",), (
                    f"{', '.join(chosen)} without {', '.join(p for p in group if p not in chosen)}: megatron computes "
                    f"{'/'.join(group)} as one fused layer, which gets one adapter; expected all of them or none")))
    if raw["rank"] not in VLLM_RANKS:
        problems.append(Problem(path + ("rank",), f"{raw['rank']} is a rank vLLM cannot serve; expected one of "
                                                  f"{list(VLLM_RANKS)}"))
    if problems:
        return None, problems
    return LoraSpec(raw["rank"], float(raw.get("alpha") or raw["rank"]), frozenset(targets), raw["dropout"],
                    raw["init"], experts), []
