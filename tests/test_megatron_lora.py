"""LoRA on megatron-core (strategies/megatron/lora.py): only the adapters train and the base stays
bit-identical; TP2 (with and without sequence parallel), PP2 (and virtual), DP2 with the distributed
optimizer, EP2 and expert-TP2 expert adapters train as one rank does; the model with its adapters off computes as the base; exports split fused adapters as PEFT
would hold them, and the merged export is W + scale * B A."""

from __future__ import annotations

import pytest
import torch

from dist_utils import dims, make_batch, make_tiny_hf, run_ranks
from siirl_dag.models.lora import ATTENTION, MLP, LoraSpec
from siirl_dag.strategies.base import RankContext
from test_megatron_engine import OPTS, _gather_dp, pg_loss

DENSE = LoraSpec(8, 16.0, frozenset(ATTENTION + MLP))
EXPERTS = LoraSpec(8, 16.0, frozenset(ATTENTION + tuple(f"experts.{p}" for p in MLP)))


def _step(rank, world, path, sizes, opts, spec):
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    eng = MegatronEngine(RankContext(rank, dims(world, sizes)), {"path": path, "lora": spec}, {**OPTS, **opts})
    trainable = sorted({n.split("decoder.layers.")[-1].split(".", 1)[-1] for c in eng.chunks
                        for n, p in c.named_parameters() if p.requires_grad})
    base = dict(eng.export_hf_weights(what="base"))
    batch = make_batch(8)
    n = len(batch["uid"]) // eng.dp_size
    batch = {k: v[eng.dp_rank * n:(eng.dp_rank + 1) * n] for k, v in batch.items()}
    before = eng.compute_logprobs(batch, micro_batch_size=2)["logprobs"]
    # two steps: at the first B is zero, so only the second trains A (and tests its gradient's path)
    for _ in range(2):
        metrics = eng.train(batch, pg_loss, mini_batch_size=8, micro_batch_size=2)  # global, as a node gives it
    return {"dp_rank": eng.dp_rank, "before": before, "metrics": metrics, "trainable": trainable,
            "after": eng.compute_logprobs(batch, micro_batch_size=2)["logprobs"],
            "base_off": eng.compute_logprobs(batch, micro_batch_size=2, adapters=False)["logprobs"],
            "base_before": base, "base_after": dict(eng.export_hf_weights(what="base")),
            "adapters": dict(eng.export_hf_weights(what="adapters")), "merged": dict(eng.export_hf_weights()),
            "optimized": sum(p.numel() for g in eng.train_state.optimizer.param_groups for p in g["params"]),
            "trainable_numel": sum(p.numel() for c in eng.chunks for p in c.parameters() if p.requires_grad)}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_lora")
    dense = make_tiny_hf(str(root / "dense"), "qwen2", num_hidden_layers=4)
    moe = make_tiny_hf(str(root / "moe"), "qwen3_moe")
    return {"dense": (dense, run_ranks(_step, 1, dense, {}, {}, DENSE)[0]),
            "moe": (moe, run_ranks(_step, 1, moe, {}, {}, EXPERTS)[0])}


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_only_the_adapters_train_and_the_base_stays_as_it_was(models, model):
    _, ref = models[model]
    assert ref["trainable"] and all(".lora_" in name for name in ref["trainable"]), ref["trainable"]
    assert ref["optimized"] == ref["trainable_numel"] > 0, "the optimizer holds the adapters and nothing else"
    assert sorted(ref["base_after"]) == sorted(ref["base_before"])
    for name, tensor in ref["base_before"].items():
        assert torch.equal(ref["base_after"][name], tensor), f"{name} changed in training"
    # B starts at zero: before the step the model computes as its base, and with its adapters off after it
    torch.testing.assert_close(ref["before"], ref["base_off"], atol=1e-6, rtol=0)
    assert (ref["after"] - ref["before"]).abs().max() > 1e-3, "the step must move the log-probs"


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_exports_hold_peft_adapters_and_the_merged_weights(models, model):
    _, ref = models[model]
    adapters, base, merged = ref["adapters"], ref["base_after"], ref["merged"]
    spec = DENSE if model == "dense" else EXPERTS
    layers = {name.rsplit(".lora_", 1)[0] for name in adapters}
    assert any(".experts." in layer for layer in layers) == (model == "moe")
    assert {"q_proj", "k_proj", "v_proj"} <= {layer.rsplit(".", 1)[-1] for layer in layers}
    for layer in layers:  # every fused projection has its A (shared) and its own rows of B
        a, b = adapters[f"{layer}.lora_A.weight"], adapters[f"{layer}.lora_B.weight"]
        assert a.shape[0] == b.shape[1] == spec.rank
        expected = base[f"{layer}.weight"] + spec.scale * b @ a
        torch.testing.assert_close(merged[f"{layer}.weight"], expected, atol=1e-6, rtol=0, msg=layer)
    qkv = {p: adapters[f"model.layers.0.self_attn.{p}_proj.lora_A.weight"] for p in "qkv"}
    assert torch.equal(qkv["q"], qkv["k"]) and torch.equal(qkv["q"], qkv["v"])
    assert set(merged) == set(base)


LAYOUTS = {
    "tp2": ("dense", {"tp": 2}, {}),
    "tp2-sp": ("dense", {"tp": 2}, {"sequence_parallel": True}),
    "pp2": ("dense", {"pp": 2}, {}),
    "pp2-vpp2": ("dense", {"pp": 2, "vpp": 2}, {"virtual_pipeline_model_parallel_size": 2}),
    "dp2-distopt": ("dense", {"dp": 2}, {"use_distributed_optimizer": True}),
    "ep2-experts": ("moe", {"ep": 2}, {"moe_token_dispatcher_type": "alltoall"}),
    # expert tensor parallel 2 (the attention's TP), and attention TP2 over experts split EP2 at expert TP 1
    "tp2-etp2-experts": ("moe", {"tp": 2}, {"sequence_parallel": True, "moe_token_dispatcher_type": "alltoall"}),
    "tp2-ep2-etp1-experts": ("moe", {"tp": 2, "ep": 2, "etp": 1},
                             {"sequence_parallel": True, "moe_token_dispatcher_type": "alltoall"}),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_layouts_train_the_adapters_as_one_rank_does(models, layout):
    model, sizes, opts = LAYOUTS[layout]
    path, ref = models[model]
    results = run_ranks(_step, 2, path, sizes, opts, DENSE if model == "dense" else EXPERTS)
    torch.testing.assert_close(_gather_dp(results, "before"), ref["before"], atol=1e-5, rtol=0)
    for r in results:
        for key in ("loss", "grad_norm"):
            assert r["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(_gather_dp(results, "after"), ref["after"], atol=1e-5, rtol=0)
    for r in results:
        assert sorted(r["adapters"]) == sorted(ref["adapters"])
        for name, tensor in ref["adapters"].items():
            torch.testing.assert_close(r["adapters"][name], tensor, atol=1e-5, rtol=0, msg=name)
