"""cpu_compat: megatron-core runs on CPU while torch, HF transformers and our code stay untouched.

Each check runs in a fresh spawned process, so "before the shims" really is before them.
"""

from __future__ import annotations

import pytest
import torch

from dist_utils import make_tiny_hf, run_ranks

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the shims apply only without CUDA")


def _hf_before_and_after(rank, world, path):
    import transformers

    from siirl_dag.strategies.megatron import cpu_compat

    ids = torch.arange(1, 17)[None]

    def load():
        model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        with torch.no_grad():
            return model(ids).logits, model.model.rotary_emb.inv_freq.clone()

    before = load()
    cpu_compat.apply()
    cpu_compat.apply_without_te()
    after = load()
    return before, after


def test_hf_loading_is_exact_after_the_shims(tmp_path):
    # Llama with llama3 rope scaling: its inv_freq is what a global torch.tensor shim once broke.
    path = make_tiny_hf(str(tmp_path / "llama"), "llama", rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    (logits0, freq0), (logits1, freq1) = run_ranks(_hf_before_and_after, 1, path, fresh=True)[0]
    assert torch.equal(freq0, freq1)
    assert torch.equal(logits0, logits1)


def _narrow_and_idempotent(rank, world):
    import megatron.core.tensor_parallel.layers as layers

    from siirl_dag.strategies.megatron import cpu_compat

    cpu_compat.apply()
    proxy = layers.torch
    wrapped = __import__("megatron.core.optimizer.distrib_optimizer", fromlist=["x"]).DistributedOptimizer.__init__
    cpu_compat.apply()
    from megatron.core.optimizer import clip_grads, optimizer
    from megatron.core.transformer.moe import token_dispatcher

    out = {
        "same_proxy": layers.torch is proxy,
        "not_rewrapped": wrapped.__wrapped__.__name__ == "__init__" and not hasattr(wrapped.__wrapped__, "_siirl_cpu"),
        "megatron_device": layers.torch.cuda.current_device(),
        "megatron_factory": str(layers.torch.zeros(2, device="cuda").device),
        "global_factory_untouched": _raises(lambda: torch.zeros(1, device="cuda")),
        "global_cuda_untouched": _raises(torch.cuda.current_device),
        "type_outside": torch.ones(1).type(),
        "clip_rebound": optimizer.clip_grad_by_total_norm_fp32 is clip_grads.clip_grad_by_total_norm_fp32,
        "splits": type(token_dispatcher.maybe_move_tensor_to_cpu(torch.tensor([1, 2]), as_numpy=True)).__name__,
    }
    with cpu_compat._tensors_answer_as_cuda():
        out["type_inside"] = torch.ones(1).type()
        out["cuda_inside"] = torch.ones(1).cuda().device.type
    return out


def _raises(fn) -> bool:
    try:
        fn()
    except (AssertionError, RuntimeError):
        return True
    return False


def test_shims_are_narrow_and_idempotent():
    out = run_ranks(_narrow_and_idempotent, 1, fresh=True)[0]
    assert out["same_proxy"] and out["not_rewrapped"] and out["clip_rebound"]
    assert out["megatron_device"] == "cpu" and out["megatron_factory"] == "cpu"
    assert out["global_cuda_untouched"] and out["global_factory_untouched"], "torch itself must be unchanged"
    assert out["type_outside"] == "torch.FloatTensor"
    assert out["type_inside"] == "torch.cuda.FloatTensor" and out["cuda_inside"] == "cpu"
    assert out["splits"] == "ndarray"


def _rng_and_norm(rank, world):
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from siirl_dag.strategies.megatron import cpu_compat

    cpu_compat.apply()
    cpu_compat.apply_without_te()
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(7)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    torch.manual_seed(0)
    outer = torch.get_rng_state()
    with tracker.fork():
        a = torch.rand(3)
    restored = torch.equal(outer, torch.get_rng_state())
    tensor_parallel.model_parallel_cuda_manual_seed(7, force_reset_rng=True)
    with tensor_parallel.get_cuda_rng_tracker().fork():
        b = torch.rand(3)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, normalization="RMSNorm")
    plain = WrappedTorchNorm(config, 8)
    config.sequence_parallel = True  # as with tp > 1 (config validation wants TP for it)
    norm = WrappedTorchNorm(config, 8)
    return {"restored": restored, "reproducible": torch.equal(a, b),
            "sp_tagged": all(getattr(p, "sequence_parallel", False) for p in norm.parameters()),
            "plain_untagged": not any(getattr(p, "sequence_parallel", False) for p in plain.parameters()),
            "norm_type": type(norm).__name__}


def test_rng_tracker_uses_cpu_state_and_torch_norm_takes_sequence_parallel():
    out = run_ranks(_rng_and_norm, 1, fresh=True)[0]
    assert out["restored"] and out["reproducible"]
    assert out["norm_type"] == "RMSNorm" and out["sp_tagged"] and out["plain_untagged"]


def _warnings_at_import(rank, world):
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        from siirl_dag.strategies.megatron import engine  # noqa: F401 - as a rank starts: the strategy first,
        from megatron.core import parallel_state  # noqa: F401 - then megatron (model.init_parallel)
    return [str(w.message) for w in caught]


def test_megatrons_warnings_about_cuda_only_libraries_are_not_shown():
    """Transformer Engine and Apex cannot run on CPU: megatron's import-time warnings that it falls back
    without them (seven at each rank's start) say nothing there."""
    caught = run_ranks(_warnings_at_import, 1, fresh=True)[0]
    assert not [m for m in caught if "not installed" in m], caught
