"""A decoder's parameter counts and KV size from its Hugging Face config.json (no torch here).

The memory plan (siirl_dag.placement.memory) shards these over a mesh's parallel sizes. Covers the
Llama family (Llama, Qwen2/2.5/3, Mistral) and its MoE variants (Qwen2-MoE, Qwen3-MoE, Mixtral):
gated MLPs, grouped-query attention, optional q/k norms, qkv biases and shared experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from siirl_dag.models.lora import ATTENTION, MLP, LoraSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_NEEDED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    ffn: int  # a dense MLP's intermediate size (0: every layer is MoE)
    experts: int  # routed experts per MoE layer (0: dense)
    expert_ffn: int
    top_k: int
    shared_ffn: int  # a shared expert's intermediate size (0: none)
    tied: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool

    @classmethod
    def from_hf(cls, cfg: dict[str, Any] | None) -> ModelShape | None:
        """None when the config lacks a size the plan needs (a model not on disk, with only overrides)."""
        if not cfg or any(not isinstance(cfg.get(k), int) for k in _NEEDED):
            return None
        heads = cfg["num_attention_heads"]
        experts = cfg.get("num_experts") or cfg.get("num_local_experts") or 0
        return cls(hidden=cfg["hidden_size"], layers=cfg["num_hidden_layers"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, vocab=cfg["vocab_size"],
                   ffn=0 if experts else cfg.get("intermediate_size", 4 * cfg["hidden_size"]), experts=experts,
                   expert_ffn=cfg.get("moe_intermediate_size") or cfg.get("intermediate_size", 0) if experts else 0,
                   top_k=cfg.get("num_experts_per_tok", 2) if experts else 0,
                   shared_ffn=cfg.get("shared_expert_intermediate_size") or 0,
                   tied=bool(cfg.get("tie_word_embeddings", False)),
                   qkv_bias=bool(cfg.get("attention_bias")) or cfg.get("model_type") == "qwen2",
                   o_bias=bool(cfg.get("attention_bias")),  # Llama's and Qwen3's flag biases o_proj too
                   qk_norm=cfg.get("model_type", "").startswith("qwen3"))

    # -- parameters per layer and outside the layers ---------------------------------------------------
    @property
    def attention_params(self) -> int:
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        bias = ((q + 2 * kv) if self.qkv_bias else 0) + (h if self.o_bias else 0)
        return h * q + 2 * h * kv + q * h + bias + (2 * self.head_dim if self.qk_norm else 0) + 2 * h

    @property
    def dense_mlp_params(self) -> int:
        """The MLP parameters every rank of a tensor-parallel group shares out: a dense MLP, or a MoE
        layer's router and shared expert."""
        if not self.experts:
            return 3 * self.hidden * self.ffn
        shared = 3 * self.hidden * self.shared_ffn + self.hidden if self.shared_ffn else 0
        return self.hidden * self.experts + shared

    @property
    def expert_params(self) -> int:
        """One layer's routed experts, sharded over ep x etp."""
        return 3 * self.hidden * self.expert_ffn * self.experts

    @property
    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    @property
    def total_params(self) -> int:
        per_layer = self.attention_params + self.dense_mlp_params + self.expert_params
        return self.layers * per_layer + self.embedding_params * (1 if self.tied else 2) + self.hidden

    @property
    def active_ffn(self) -> int:
        """The MLP width one token passes through (for activations)."""
        return self.ffn or self.top_k * self.expert_ffn + self.shared_ffn

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * dtype_bytes

    def lora_params(self, spec: LoraSpec) -> tuple[int, int]:
        """(per layer shared over tp, per layer in the routed experts) adapter parameters at `spec.rank`."""
        h, q, kv, r = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, spec.rank
        shapes = {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h)}
        if self.ffn:
            shapes.update({"gate_proj": (h, self.ffn), "up_proj": (h, self.ffn), "down_proj": (self.ffn, h)})
        dense = sum(r * (i + o) for name, (i, o) in shapes.items() if name in spec.targets and name in ATTENTION + MLP)
        experts = sum(r * (h + self.expert_ffn) * self.experts for name in MLP if f"experts.{name}" in spec.targets)
        return dense, experts
