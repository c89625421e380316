"""HF model directory -> what megatron needs to build it: `HFSpec` (shapes, options of the
architecture) and the model-shape part of TransformerConfig.

Supported: Llama, Qwen2 (qkv bias), Qwen3 (q/k norm), Qwen3-MoE (experts, router); anything else is a
ConfigError naming what is not supported. Any of them can be built as a value model (critic).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

import torch.nn.functional as F

from siirl_dag.errors import ConfigError

_ARCHS = ("llama", "qwen2", "qwen3", "qwen3_moe")  # HF model_type


@dataclass(frozen=True)
class HFSpec:
    """What the builder needs from an HF checkpoint directory."""

    path: str
    arch: str
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    norm_eps: float
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    rotary_base: float
    rope_scaling_factor: float | None  # llama3-style scaling, else None
    max_position_embeddings: int
    init_std: float
    num_experts: int | None = None
    moe_ffn_hidden_size: int | None = None
    moe_topk: int | None = None
    moe_norm_topk: bool = True
    moe_layers: tuple[int, ...] = ()  # 1 = MoE layer, 0 = dense, per layer
    value_head: bool = False  # a critic: 1-wide value head (HF `score`) instead of the LM head, never tied


def read_hf_config(path: str, value_head: bool = False) -> HFSpec:
    """Parse and check `config.json` of an HF model directory (as a value model with `value_head`)."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
    except OSError as e:
        raise ConfigError(f"cannot read an HF model at {path!r} ({e}); expected a directory with config.json")
    arch = cfg.get("model_type")
    if arch not in _ARCHS:
        raise ConfigError(f"model_type {cfg.get('model_type')!r} is not supported; expected one of {list(_ARCHS)}")
    if cfg.get("hidden_act", "silu") != "silu" or cfg.get("mlp_bias"):
        raise ConfigError("only SiLU-gated MLPs without bias are supported")
    if cfg.get("use_sliding_window"):
        raise ConfigError("sliding-window attention is not supported")
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    factor = None
    if rope_type == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if any(float(rope.get(k, v)) != v for k, v in expected.items()):
            raise ConfigError(f"llama3 rope scaling is supported only with {expected}; got {rope}")
        factor = float(rope["factor"])
    elif rope_type != "default":
        raise ConfigError(f"rope type {rope_type!r} is not supported; expected 'default' or 'llama3'")
    n_layers = cfg["num_hidden_layers"]
    heads = cfg["num_attention_heads"]
    moe: dict[str, Any] = {}
    if arch == "qwen3_moe":
        dense = set(cfg.get("mlp_only_layers") or [])
        step = cfg.get("decoder_sparse_step", 1)
        moe = dict(
            num_experts=cfg.get("num_experts", cfg.get("num_local_experts")),
            moe_ffn_hidden_size=cfg["moe_intermediate_size"],
            moe_topk=cfg["num_experts_per_tok"],
            moe_norm_topk=bool(cfg.get("norm_topk_prob", False)),
            moe_layers=tuple(int(i not in dense and (i + 1) % step == 0) for i in range(n_layers)),
        )
    return HFSpec(
        path=path,
        arch=arch,
        num_layers=n_layers,
        hidden_size=cfg["hidden_size"],
        ffn_hidden_size=cfg["intermediate_size"],
        num_heads=heads,
        num_kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab_size=cfg["vocab_size"],
        norm_eps=cfg.get("rms_norm_eps", 1e-6),
        tied=bool(cfg.get("tie_word_embeddings", False)) and not value_head,
        qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe"),
        rotary_base=float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0))),
        rope_scaling_factor=factor,
        max_position_embeddings=cfg.get("max_position_embeddings", 4096),
        init_std=cfg.get("initializer_range", 0.02),
        value_head=value_head,
        **moe,
    )


def value_model_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """The HF config of an exported value model: it loads as `AutoModelForTokenClassification`
    with one label and a bias-free `score` head (the trunk's weights keep their names)."""
    archs = [a.replace("ForCausalLM", "ForTokenClassification") for a in cfg.get("architectures") or []]
    return {**cfg, "architectures": archs, "id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0},
            "token_classification_bias": False, "tie_word_embeddings": False}


def transformer_config_kwargs(spec: HFSpec) -> dict[str, Any]:
    """The model-shape part of megatron's TransformerConfig; the engine adds parallelism/training."""
    kw: dict[str, Any] = dict(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_heads,
        num_query_groups=spec.num_kv_heads,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        rotary_interleaved=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        init_method_std=spec.init_std,
        # HF parity and CPU: unfused reference kernels.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
    )
    if spec.num_experts:
        kw.update(
            num_moe_experts=spec.num_experts,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_router_topk=spec.moe_topk,
            # HF: softmax over all experts, top-k, renormalise iff norm_topk_prob. megatron's
            # default (top-k then softmax) is the renormalised form.
            moe_router_pre_softmax=not spec.moe_norm_topk,
            moe_router_dtype="fp32",
            moe_router_load_balancing_type="none",
            moe_aux_loss_coeff=0.0,
            moe_layer_freq=list(spec.moe_layers),
        )
    return kw
