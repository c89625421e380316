"""HF <-> megatron-core conversion: logits equal HF transformers' and export round-trips exactly,
for Llama, Qwen2 (qkv bias, tied embeddings, padded vocab), Qwen3 (q/k norm) and Qwen3-MoE, at
TP1, TP2 (+SP), PP2 (+VPP) and EP2."""

from __future__ import annotations

import pytest
import torch

from dist_utils import dims, hf_logits, hf_state, make_batch, make_tiny_hf, run_ranks
from siirl_dag.errors import ConfigError
from siirl_dag.strategies.megatron import hf_config, hf_convert

IDS = torch.arange(3, 19).reshape(1, 16) * 7 % 240 + 1


def hf_reference(path: str, batch: dict) -> dict[str, torch.Tensor]:
    """HF logits on IDS, and log-probs + entropy of the batch's response tokens."""
    logits = hf_logits(path, batch["input_ids"], batch["attention_mask"])
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    logp = logits[:, p - 1:p + r - 1].log_softmax(-1)
    mask = batch["response_mask"]
    return {
        "logits": hf_logits(path, IDS),
        "logprobs": logp.gather(-1, batch["responses"][..., None])[..., 0] * mask,
        "entropy": -(logp.exp() * logp).sum(-1) * mask,
    }


def _convert(rank, world, path, sizes, opts):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from siirl_dag.strategies.base import RankContext
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    eng = MegatronEngine(RankContext(rank, dims(world, sizes)), {"path": path}, opts)
    out = eng.compute_logprobs(make_batch(vocab=eng.spec.vocab_size), micro_batch_size=3, return_entropy=True)
    if ps.get_pipeline_model_parallel_world_size() == 1:  # direct forward: whole model on this rank
        with torch.no_grad():
            local = eng.chunks[0](IDS, torch.arange(16)[None], None)
        shards = [torch.empty_like(local) for _ in range(ps.get_tensor_model_parallel_world_size())]
        dist.all_gather(shards, local.contiguous(), group=ps.get_tensor_model_parallel_group())
        out["logits"] = torch.cat(shards, -1)[..., :eng.spec.vocab_size]
    out["export"] = dict(eng.export_hf_weights())
    out["first_rank_export"] = dict(eng.export_hf_weights(first_rank_only=True))
    return out


CASES = {
    "qwen2-tp1": ("qwen2", 1, {}, {}, {}),
    "qwen2-tied-paddedvocab-tp2-sp": ("qwen2", 2, {"tp": 2}, {"sequence_parallel": True},
                                      {"tie_word_embeddings": True, "vocab_size": 251}),
    "llama-pp2-vpp2": ("llama", 2, {"pp": 2, "vpp": 2}, {}, {"num_hidden_layers": 4}),
    "qwen3-tp2": ("qwen3", 2, {"tp": 2}, {}, {}),
    "qwen3moe-ep2-alltoall": ("qwen3_moe", 2, {"ep": 2}, {"moe_token_dispatcher_type": "alltoall"}, {}),
}


@pytest.mark.engines
@pytest.mark.parametrize("case", list(CASES))
def test_logits_logprobs_and_export_match_hf(case, tmp_path):
    arch, world, sizes, opts, overrides = CASES[case]
    path = make_tiny_hf(str(tmp_path / arch), arch, **overrides)
    ref = hf_reference(path, make_batch(vocab=overrides.get("vocab_size", 256)))
    original = hf_state(path)
    outs = run_ranks(_convert, world, path, sizes, opts)
    for out in outs:
        if "logits" in out:
            torch.testing.assert_close(out["logits"], ref["logits"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)
        torch.testing.assert_close(out["entropy"], ref["entropy"], atol=1e-5, rtol=0)
        assert sorted(out["export"]) == sorted(original)
        for name, tensor in original.items():
            assert torch.equal(out["export"][name], tensor), name
    # a single consumer (weight-sync sender, HF writer) on rank 0: whole there, gathered to it only
    first = outs[0]["first_rank_export"]
    assert sorted(first) == sorted(original)
    for name, tensor in original.items():
        assert torch.equal(first[name], tensor), name


def _spec(**kw) -> hf_config.HFSpec:
    base = dict(path="", arch="qwen2", num_layers=1, hidden_size=8, ffn_hidden_size=8, num_heads=4,
                num_kv_heads=2, head_dim=2, vocab_size=10, norm_eps=1e-6, tied=False, qkv_bias=True, qk_norm=False,
                rotary_base=1e4, rope_scaling_factor=None, max_position_embeddings=32, init_std=0.02)
    base.update(kw)
    return hf_config.HFSpec(**base)


def test_fused_layouts_follow_megatron_and_invert():
    spec = _spec()
    q, k, v = torch.arange(8.)[:, None] + 100, torch.arange(4.)[:, None] + 200, torch.arange(4.)[:, None] + 300
    # group 0: q heads 0,1 (rows 0-3), k_0, v_0; group 1: q heads 2,3, k_1, v_1 -- TP shards whole groups
    shard0 = hf_convert.to_mcore("qkv", [q, k, v], spec, 0, 2, 8)
    assert shard0[:, 0].tolist() == [100, 101, 102, 103, 200, 201, 300, 301]
    shards = [hf_convert.to_mcore("qkv", [q, k, v], spec, r, 2, 8) for r in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(hf_convert.to_hf("qkv", shards, spec), (q, k, v)))
    gate, up = torch.randn(6, 3), torch.randn(6, 3)
    fc1 = [hf_convert.to_mcore("gate_up", [gate, up], spec, r, 2, 6) for r in range(2)]
    assert torch.equal(fc1[1][:3], gate[3:]) and torch.equal(fc1[1][3:], up[3:])
    assert all(torch.equal(a, b) for a, b in zip(hf_convert.to_hf("gate_up", fc1, spec), (gate, up)))
    emb = torch.randn(10, 3)
    padded = [hf_convert.to_mcore("vocab", [emb], spec, r, 4, 3) for r in range(4)]  # 10 rows -> 12
    assert padded[3][1:].abs().sum() == 0
    assert torch.equal(hf_convert.to_hf("vocab", padded, spec)[0], emb)


def test_grouped_gemm_experts_bind_like_sequential_ones(monkeypatch):
    """TEGroupedMLP (moe_grouped_gemm on GPUs) names local expert i `linear_fc1.weight{i}`, SequentialMLP
    `local_experts.{i}.linear_fc1.weight`: both bind to the same rules and global expert numbers."""
    def layer(grouped: bool) -> torch.nn.Module:
        experts = torch.nn.Module()
        experts.num_local_experts = 2
        if grouped:
            for fc in ("linear_fc1", "linear_fc2"):
                experts.add_module(fc, torch.nn.Module())
                for i in range(2):
                    getattr(experts, fc).register_parameter(f"weight{i}", torch.nn.Parameter(torch.zeros(1)))
        else:
            experts.local_experts = torch.nn.ModuleList(torch.nn.Module() for _ in range(2))
            for expert in experts.local_experts:
                expert.linear_fc1, expert.linear_fc2 = (torch.nn.Linear(1, 1, bias=False) for _ in range(2))
        out = torch.nn.Module()
        out.layer_number, out.mlp = 4, torch.nn.Module()
        out.mlp.experts = experts
        return out

    ep_rank_1 = type("PS", (), {"get_expert_model_parallel_rank": staticmethod(lambda: 1)})
    monkeypatch.setattr(hf_convert, "_ps", lambda: ep_rank_1)
    bound = {}
    for grouped in (False, True):
        chunk = torch.nn.Module()
        chunk.decoder = torch.nn.Module()
        chunk.decoder.layers = torch.nn.ModuleList([layer(grouped)])
        bound[grouped] = sorted((b.rule.mcore, b.layer, b.expert) for b in hf_convert.bind([chunk]))
    assert bound[True] == bound[False] == sorted(
        (f"mlp.experts.local_experts.{{e}}.{fc}.weight", 3, e) for fc in ("linear_fc1", "linear_fc2") for e in (2, 3))


def test_unsupported_checkpoints_are_config_errors(tmp_path):
    import json

    for cfg, words in [({"model_type": "gpt2"}, "not supported"),
                       ({"model_type": "llama", "rope_parameters": {"rope_type": "yarn"}}, "yarn"),
                       ({"model_type": "qwen2", "use_sliding_window": True}, "sliding")]:
        (tmp_path / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConfigError, match=words):
            hf_config.read_hf_config(str(tmp_path))
    with pytest.raises(ConfigError, match="config.json"):
        hf_config.read_hf_config(str(tmp_path / "missing"))
