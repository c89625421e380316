"""Leaner forms of two of megatron-core's local layers (its layer spec without Transformer Engine).

Without Transformer Engine megatron-core builds its layers from its own modules, written for any
configuration. Two of them do work the common case does not need:
- core attention (`DotProductAttention`) materialises the [b, heads, s, s] scores, masks and softmaxes
  them in separate ops and copies K and V once per grouped query head; `SdpaAttention` calls torch's
  `scaled_dot_product_attention`, one fused kernel (flash attention on a CPU and on a GPU);
- the MLP's generic gated unit computes act(gate) * (up + offset), clamps aside, so a SwiGLU copies
  the up half of fc1's output once more to add 0; `SwigluMLP` computes silu(gate) * up.
Same math, same parameters and state dict; what they do not cover goes through megatron's own forward.
`use_lean_layers` puts them in a decoder block spec; `build_model` does, whenever it builds without TE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.mlp import MLP

_IS_CAUSAL = {AttnMaskType.causal: True, AttnMaskType.no_mask: False}


class SdpaAttention(DotProductAttention):
    """megatron's DotProductAttention (same constructor, same [s, b, heads, d] -> [s, b, h] contract),
    computed by torch's fused SDPA where the two agree: not with an explicit mask, a sliding window,
    a softmax offset, query-key layer scaling, dropout while training, queries shorter than keys, or
    megatron's deterministic mode (SDPA's GPU backward kernels need not be)."""

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        mask_type = attn_mask_type or self.attn_mask_type
        if (attention_mask is not None or attention_bias is not None or packed_seq_params is not None
                or mask_type not in _IS_CAUSAL or query.shape[0] != key.shape[0]
                or self.scale_mask_softmax.window_size is not None or self.softmax_offset is not None
                or self.config.apply_query_key_layer_scaling or self.config.deterministic_mode
                or (self.training and self.attention_dropout.p > 0)):
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        seq, batch = query.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))  # [s, b, n, d] -> [b, n, s, d]
        context = F.scaled_dot_product_attention(q, k, v, is_causal=_IS_CAUSAL[mask_type], scale=self.softmax_scale,
                                                 enable_gqa=q.shape[1] != k.shape[1])
        return context.permute(2, 0, 1, 3).reshape(seq, batch, self.hidden_size_per_partition)


class SwigluMLP(MLP):
    """megatron's MLP (same constructor, parameters and outputs) whose SwiGLU is silu(gate) * up, when
    the configuration asks for nothing more (no bias, offset, clamp, fusion or per-token scale)."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.plain = (config.gated_linear_unit and config.activation_func is F.silu and not config.add_bias_linear
                      and config.glu_linear_offset == 0.0 and config.activation_func_clamp_value is None
                      and not config.bias_activation_fusion and not config.use_te_activation_func)

    def forward(self, hidden_states, per_token_scale=None, **kwargs):
        if not self.plain or per_token_scale is not None:
            return super().forward(hidden_states, per_token_scale, **kwargs)
        intermediate, _ = self.linear_fc1(hidden_states)
        gate, up = torch.chunk(intermediate, 2, dim=-1)
        return self.linear_fc2(F.silu(gate) * up)


def use_lean_layers(block_spec) -> None:
    """In a decoder block spec, in place: SdpaAttention for megatron's local core attention, SwigluMLP
    for its dense MLP (MoE experts keep theirs)."""
    for layer in block_spec.layer_specs:
        attention = getattr(getattr(layer.submodules, "self_attention", None), "submodules", None)
        if getattr(attention, "core_attention", None) is DotProductAttention:
            attention.core_attention = SdpaAttention
        mlp = getattr(layer.submodules, "mlp", None)
        if getattr(mlp, "module", None) is MLP:
            mlp.module = SwigluMLP
