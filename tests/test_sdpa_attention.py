"""SdpaAttention: torch's fused attention gives megatron's local DotProductAttention's outputs and grads
(causal, grouped queries), falls back to it where the two differ, and is what the local spec builds."""

from __future__ import annotations

import torch

from dist_utils import dims, make_tiny_hf, run_ranks


def _attention_pair(rank, world, path):
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.megatron.engine import MegatronEngine
    from siirl_dag.strategies.megatron.sdpa_attention import SdpaAttention

    engine = MegatronEngine(RankContext(rank, dims(world, {})), {"path": path}, {})  # sets up megatron's groups
    built = sorted({type(m).__name__ for c in engine.chunks for m in c.modules() if isinstance(m, DotProductAttention)})
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                               kv_channels=16, attention_dropout=0.0)
    pair = [cls(config, 1, AttnMaskType.causal, "self") for cls in (DotProductAttention, SdpaAttention)]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 3, 4, 16, generator=g)
    k, v = (torch.randn(7, 3, 2, 16, generator=g) for _ in range(2))
    out = {"built": built}
    for name, mask in (("causal", None), ("explicit_mask", torch.rand(3, 1, 7, 7, generator=g) > 0.5)):
        results = []
        for module in pair:
            inputs = [t.clone().requires_grad_(True) for t in (q, k, v)]
            context = module(*inputs, mask)
            (context * torch.linspace(-1, 1, context.numel()).view_as(context)).sum().backward()
            results.append((context.detach(), [t.grad for t in inputs]))
        out[name] = results
    return out


def test_sdpa_matches_megatrons_attention_and_is_what_the_local_spec_builds(tmp_path):
    out = run_ranks(_attention_pair, 1, make_tiny_hf(str(tmp_path / "m"), "qwen2"))[0]
    assert out["built"] == ["SdpaAttention"]
    for case in ("causal", "explicit_mask"):
        (ref, ref_grads), (got, grads) = out[case]
        assert ref.shape == got.shape == (7, 3, 64)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=case)
        for name, a, b in zip("qkv", grads, ref_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{case} d{name}")
