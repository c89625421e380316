"""The CUDA paths, skipped where there is no GPU (CI has none; run them on a GPU machine).

A Megatron rank on the GPU gives the CPU rank's log-probs, loss, grad norm and update, and exports
the HF weights exactly; offload moves its training state off the GPU and onload brings all of it
back (the next step still matches the CPU's); a checkpoint it saves resumes on a CPU rank; and the
weight sync's buckets broadcast over NCCL arrive bit-exact (two GPUs); expert adapters train on the GPU as on
the CPU, vLLM's CUDA MoE LoRA applies adapters given in memory as the merged model computes, and the
routes vLLM returns bring Megatron's log-probs closer to its own (routing replay)."""

from __future__ import annotations

import pytest
import torch

from dist_utils import _free_port, hf_state, make_batch, make_tiny_hf, run_ranks
from siirl_dag.placement.parallel_dims import ParallelDims
from siirl_dag.strategies.base import RankContext
from test_megatron_checkpoint import _load, _save
from test_megatron_engine import OPTS, pg_loss

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

OFFLOAD = {"param_offload": True, "grad_offload": True, "optimizer_offload": True}


def _step(rank, world, path, device, opts):
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 products, to compare with the CPU's
    eng = MegatronEngine(RankContext(rank, ParallelDims(dp=world), device=device), {"path": path}, {**OPTS, **OFFLOAD, **opts})
    batch = make_batch(8)
    out = {"export": {name: t.cpu() for name, t in eng.export_hf_weights()},
           "before": eng.compute_logprobs(batch, micro_batch_size=2)["logprobs"],
           "metrics": eng.train(batch, pg_loss, mini_batch_size=8, micro_batch_size=2),
           "after": eng.compute_logprobs(batch, micro_batch_size=3)["logprobs"]}
    if device == "cuda":
        out["on_device"] = str(next(eng.chunks[0].parameters()).device)
        params = sum(p.numel() * p.element_size() for c in eng.chunks for p in c.parameters())
        for _ in range(2):  # the second time into the host copies the first one made
            used = torch.cuda.memory_allocated()
            eng.offload()
            # params, their grads and Adam's two moments (fp32); cuBLAS's workspaces stay
            out["freed"] = (used - torch.cuda.memory_allocated(), 4 * params)
            eng.onload()
        out["after_onload"] = eng.compute_logprobs(batch, micro_batch_size=3)["logprobs"]
    out["metrics2"] = eng.train(batch, pg_loss, mini_batch_size=8, micro_batch_size=2)
    out["after2"] = eng.compute_logprobs(batch, micro_batch_size=3)["logprobs"]
    return out


@pytest.mark.parametrize("arch, opts", [("qwen2", {}), ("qwen3_moe", {}),
                                        ("qwen2", {"use_distributed_optimizer": True})], ids=["dense", "moe", "distopt"])
def test_megatron_on_a_gpu_gives_the_cpu_runs_numbers(arch, opts, tmp_path, monkeypatch):
    path = make_tiny_hf(str(tmp_path / arch), arch)
    gpu = run_ranks(_step, 1, path, "cuda", opts, backend="nccl")[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the reference rank sees no GPU, as on CI
    cpu = run_ranks(_step, 1, path, "cpu", opts)[0]

    assert gpu["on_device"].startswith("cuda")
    expected = hf_state(path)
    assert sorted(gpu["export"]) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(gpu["export"][name], tensor), name
    torch.testing.assert_close(gpu["before"], cpu["before"], atol=1e-5, rtol=0)
    for key in ("loss", "entropy", "grad_norm"):
        assert gpu["metrics"][key] == pytest.approx(cpu["metrics"][key], rel=1e-5, abs=1e-6), key
    torch.testing.assert_close(gpu["after"], cpu["after"], atol=2e-5, rtol=0)

    freed, state = gpu["freed"]
    assert freed >= state, f"offload freed {freed} bytes of the GPU, expected the training state's {state}"
    assert torch.equal(gpu["after_onload"], gpu["after"])
    for key in ("loss", "grad_norm"):
        assert gpu["metrics2"][key] == pytest.approx(cpu["metrics2"][key], rel=1e-4, abs=1e-6), key
    torch.testing.assert_close(gpu["after2"], cpu["after2"], atol=5e-5, rtol=0)


def test_a_checkpoint_saved_on_a_gpu_resumes_on_a_cpu(tmp_path, monkeypatch):
    path = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2")
    ckpt, hf_dir = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    saved, after = run_ranks(_save, 1, path, {}, ckpt, hf_dir, "cuda", backend="nccl")[0]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    fresh, loaded, after_load = run_ranks(_load, 1, path, {}, ckpt)[0]
    assert (fresh - saved).abs().max() > 1e-3, "the checkpoint must differ from the HF weights"
    torch.testing.assert_close(loaded, saved, atol=1e-5, rtol=0)
    for key in ("loss", "grad_norm", "lr"):  # the optimizer state and schedule came back too
        assert after_load[key] == pytest.approx(after[key], rel=1e-5, abs=1e-6), key


def _broadcast(rank, world, port, path, bucket_bytes):
    from siirl_dag.weight_sync.process_group import SyncGroup
    from siirl_dag.weight_sync.stream import Buckets, End

    torch.cuda.set_device(rank)
    group = SyncGroup("127.0.0.1", port, rank, world, "cuda")
    try:
        if rank == 0:
            buckets = Buckets(hf_state(path).items(), bucket_bytes, {})
            while (bucket := buckets.next()) is not None:
                group.write(bucket)
            group.write(End(None))
            return buckets.stats
        got = {}
        while not isinstance(bucket := group.read(), End):
            assert all(t.is_cuda for _, t in bucket)
            got.update((name, t.cpu()) for name, t in bucket)
        return got
    finally:
        group.close()


@pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.device_count() < 2, reason="NCCL refuses two ranks on one GPU ('Duplicate GPU detected')")
def test_weight_buckets_broadcast_over_nccl_arrive_exactly(tmp_path):
    path = make_tiny_hf(str(tmp_path / "qwen2"), "qwen2")
    expected = hf_state(path)
    sent, received = run_ranks(_broadcast, 2, _free_port(), path, 200_000)
    assert sent["sync/buckets"] > 2
    assert sorted(received) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(received[name], tensor), name


def _lora_step(rank, world, path, device):
    from siirl_dag.strategies.megatron.engine import MegatronEngine
    from test_megatron_lora import EXPERTS

    torch.backends.cuda.matmul.allow_tf32 = False
    eng = MegatronEngine(RankContext(rank, ParallelDims(dp=world), device=device), {"path": path, "lora": EXPERTS}, OPTS)
    batch = make_batch(8)
    for _ in range(2):
        eng.train(batch, pg_loss, mini_batch_size=8, micro_batch_size=2)
    return {"after": eng.compute_logprobs(batch, micro_batch_size=2)["logprobs"],
            "adapters": {n: t.cpu() for n, t in eng.export_hf_weights(what="adapters")}}


def test_expert_adapters_train_on_a_gpu_as_on_the_cpu(tmp_path, monkeypatch):
    path = make_tiny_hf(str(tmp_path / "moe"), "qwen3_moe")
    [gpu] = run_ranks(_lora_step, 1, path, "cuda", backend="nccl")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    [cpu] = run_ranks(_lora_step, 1, path, "cpu")
    torch.testing.assert_close(gpu["after"], cpu["after"], atol=1e-4, rtol=0)
    for name, t in cpu["adapters"].items():
        torch.testing.assert_close(gpu["adapters"][name], t, atol=1e-4, rtol=0, msg=name)


def _vllm_moe_adapters(rank, world, path, adapters):
    from siirl_dag.strategies.vllm.rollout import VllmRollout
    from test_megatron_lora import EXPERTS

    engine = VllmRollout(RankContext(0, device="cuda"), {"path": path, "lora": EXPERTS},
                         {"dtype": "float16", "max_model_len": 64, "enforce_eager": True, "gpu_memory_utilization": 0.3})
    assert engine.adapters, "on a GPU an MoE model's adapters are served as adapters"
    engine.load_adapters(iter(adapters.items()), version=1)
    return engine.generate(["Q: 1+2=? A:", "Q: 20+3=? A:"], {"greedy": True}, 16, 8)


def test_vllm_applies_expert_adapters_from_memory_as_the_merged_model_computes(tmp_path):
    """vLLM's CUDA MoE LoRA, given adapters in memory (what an adapter-only sync delivers), computes as
    the HF model with them merged (PEFT's W + scale * B A), up to float16's rounding (its Triton LoRA
    kernels take 16-bit weights only)."""
    pytest.importorskip("vllm")
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from make_tiny_model import make_tiny_model
    from test_megatron_lora import EXPERTS

    path = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_experts=4, tie_word_embeddings=False)
    weights, g = load_file(f"{path}/model.safetensors"), torch.Generator().manual_seed(0)
    adapters, merged = {}, dict(weights)
    for name, w in weights.items():
        proj = name.split(".")[-2]
        if w.dim() == 2 and (proj in ("q_proj", "k_proj", "v_proj") or (".experts." in name and proj.endswith("proj"))):
            a, b = 0.1 * torch.randn(8, w.shape[1], generator=g), 0.1 * torch.randn(w.shape[0], 8, generator=g)
            adapters[name.replace(".weight", ".lora_A.weight")], adapters[name.replace(".weight", ".lora_B.weight")] = a, b
            merged[name] = w + EXPERTS.scale * b @ a
    [batch] = run_ranks(_vllm_moe_adapters, 1, path, adapters, backend="nccl")
    save_file(merged, f"{path}/model.safetensors", metadata={"format": "pt"})
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, 15:23]
    ref = torch.log_softmax(logits.float(), -1).gather(-1, batch["responses"].unsqueeze(-1)).squeeze(-1)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(batch["rollout_logprobs"][mask], ref[mask], atol=2e-2, rtol=0)


def _vllm_routes(rank, world, path):
    from siirl_dag.strategies.vllm.rollout import VllmRollout

    engine = VllmRollout(RankContext(0, device="cuda"), {"path": path},
                         {"dtype": "bfloat16", "max_model_len": 64, "enforce_eager": True, "gpu_memory_utilization": 0.3,
                          "return_routed_experts": True, "n": 4, "temperature": 1.0})
    return engine.generate(["Q: 1+2=? A:", "Q: 20+3=? A:", "Q: 7+5=? A:", "Q: 31+4=? A:"], {"seed": 0}, 16, 12)


def _megatron_replay(rank, world, path, batch):
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    torch.backends.cuda.matmul.allow_tf32 = False
    eng = MegatronEngine(RankContext(rank, ParallelDims(dp=world), device="cuda"), {"path": path}, {"bf16": False})
    return {"free": eng.compute_logprobs(batch)["logprobs"],
            "replayed": eng.compute_logprobs(batch, replay_routes=True)["logprobs"]}


def test_routes_vllm_returns_bring_megatrons_log_probs_closer(tmp_path):
    """Routing replay end to end on a GPU: vLLM (bf16) returns the experts of every token with its
    samples; Megatron (fp32) replaying them is closer to vLLM's log-probs than routing by itself."""
    pytest.importorskip("vllm")
    from make_tiny_model import make_tiny_model

    path = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_layers=4, num_experts=8)
    [batch] = run_ranks(_vllm_routes, 1, path, backend="nccl")
    assert batch["routed_experts"].shape == (*batch["input_ids"].shape, 4, 2)
    [out] = run_ranks(_megatron_replay, 1, path, batch, backend="nccl")
    mask = batch["response_mask"].bool()
    free = (out["free"] - batch["rollout_logprobs"]).abs()[mask].mean()
    replayed = (out["replayed"] - batch["rollout_logprobs"]).abs()[mask].mean()
    print(f"mean |megatron - vllm| log-prob: {free:.5f} routing itself, {replayed:.5f} replaying vLLM's routes")
    assert replayed < free
