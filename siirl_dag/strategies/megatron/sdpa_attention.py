"""Core attention through torch's `scaled_dot_product_attention`, for megatron's local layer spec.

Without Transformer Engine megatron-core builds its layers from its own modules, whose core attention
(`DotProductAttention`) materialises the [b, heads, s, s] scores, masks and softmaxes them in separate
ops and copies K and V once per grouped query head. torch's SDPA computes the same thing in one fused
kernel (flash attention on a CPU and on a GPU) with none of that. `SdpaAttention` is that module with
the fused path: `build_model` puts it in the local spec wherever the spec asks for `DotProductAttention`.

Same math, no parameters of its own; what SDPA does not express the same way (an explicit mask,
a sliding window, a softmax offset, query-key layer scaling, dropout while training, queries shorter
than keys) and megatron's deterministic mode (SDPA's GPU backward kernels need not be) go through
megatron's own forward.
"""

from __future__ import annotations

import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.transformer.enums import AttnMaskType

_IS_CAUSAL = {AttnMaskType.causal: True, AttnMaskType.no_mask: False}


class SdpaAttention(DotProductAttention):
    """megatron's DotProductAttention (same constructor, same [s, b, heads, d] -> [s, b, h] contract),
    computed by torch's fused SDPA where the two agree."""

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


def use_sdpa(block_spec) -> None:
    """Swap megatron's local core attention for `SdpaAttention` in a decoder block spec, in place."""
    for layer in block_spec.layer_specs:
        attention = getattr(layer.submodules, "self_attention", None)
        submodules = getattr(attention, "submodules", None)
        if getattr(submodules, "core_attention", None) is DotProductAttention:
            submodules.core_attention = SdpaAttention
