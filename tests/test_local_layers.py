"""local_layers: SdpaAttention and SwigluMLP give the outputs and grads of megatron's local
DotProductAttention and MLP (causal grouped-query attention; SwiGLU), fall back to them where they
differ, and are what the engine's local spec builds."""

from __future__ import annotations

import torch

from dist_utils import dims, make_tiny_hf, run_ranks


def _outputs_and_grads(module, inputs, *args):
    inputs = [t.clone().requires_grad_(True) for t in inputs]
    out = module(*inputs, *args)
    out = out[0] if isinstance(out, tuple) else out
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    return out.detach(), [t.grad for t in inputs]


def _pairs(rank, world, path):
    import torch.nn.functional as F
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.mlp import MLP

    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.megatron.engine import MegatronEngine
    from siirl_dag.strategies.megatron.local_layers import SdpaAttention, SwigluMLP

    engine = MegatronEngine(RankContext(rank, dims(world, {})), {"path": path}, {})  # sets up megatron's groups
    built = sorted({type(m).__name__ for c in engine.chunks for m in c.modules() if isinstance(m, (DotProductAttention, MLP))})
    config = TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
                               ffn_hidden_size=96, gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                               bias_activation_fusion=False, attention_dropout=0.0)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(7, 3, 4, 16, generator=g)
    k, v = (torch.randn(7, 3, 2, 16, generator=g) for _ in range(2))
    out = {"built": built}
    attention = [cls(config, 1, AttnMaskType.causal, "self") for cls in (DotProductAttention, SdpaAttention)]
    for name, mask in (("causal", None), ("explicit_mask", torch.rand(3, 1, 7, 7, generator=g) > 0.5)):
        out[name] = [_outputs_and_grads(m, (q, k, v), mask) for m in attention]
    mlp_spec = get_gpt_layer_local_spec().submodules.mlp.submodules
    mlps = [MLP(config, mlp_spec), SwigluMLP(config, mlp_spec)]
    mlps[1].load_state_dict(mlps[0].state_dict())  # same parameters, same names
    out["plain"] = mlps[1].plain
    x = torch.randn(5, 3, 64, generator=g)
    out["mlp"] = [_outputs_and_grads(m, (x,)) for m in mlps]
    return out


def test_lean_layers_match_megatrons_and_are_what_the_local_spec_builds(tmp_path):
    out = run_ranks(_pairs, 1, make_tiny_hf(str(tmp_path / "m"), "qwen2"))[0]
    assert out["built"] == ["SdpaAttention", "SwigluMLP"]
    assert out["plain"]
    for case, shape in (("causal", (7, 3, 64)), ("explicit_mask", (7, 3, 64)), ("mlp", (5, 3, 64))):
        (ref, ref_grads), (got, grads) = out[case]
        assert ref.shape == got.shape == shape
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5, msg=case)
        for a, b in zip(grads, ref_grads):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5, msg=f"{case} grads")
