"""Checkpoints: a dist checkpoint saved at TP2 (with optimizer state) loads at TP1 and at PP2 with
equal log-probs and an equal next step; `save_hf` writes a directory HF transformers loads."""

from __future__ import annotations

import torch

from dist_utils import dims, hf_logits, make_batch, make_tiny_hf, run_ranks
from siirl_dag.strategies.base import RankContext
from test_megatron_engine import pg_loss

OPTS = {"lr": 1e-3, "eps": 1e-3}


def _save(rank, world, path, sizes, ckpt, hf_dir, device="cpu"):
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    eng = MegatronEngine(RankContext(rank, dims(world, sizes), device=device), {"path": path}, OPTS)
    batch = make_batch(8)
    eng.train(batch, pg_loss, mini_batch_size=8, micro_batch_size=2)
    eng.save_checkpoint(ckpt)
    eng.save_hf(hf_dir)
    saved = eng.compute_logprobs(batch)["logprobs"]
    after = eng.train(batch, pg_loss, mini_batch_size=8, micro_batch_size=2)
    return saved, after


def _load(rank, world, path, sizes, ckpt):
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    eng = MegatronEngine(RankContext(rank, dims(world, sizes)), {"path": path}, OPTS)
    batch = make_batch(8)
    fresh = eng.compute_logprobs(batch)["logprobs"]
    eng.load_checkpoint(ckpt)
    loaded = eng.compute_logprobs(batch)["logprobs"]
    after = eng.train(batch, pg_loss, mini_batch_size=8, micro_batch_size=2)
    return fresh, loaded, after


def test_save_tp2_load_tp1_and_pp2(tmp_path):
    path = make_tiny_hf(str(tmp_path / "m"), "qwen2")
    ckpt, hf_dir = str(tmp_path / "ckpt"), str(tmp_path / "hf")
    saved, after = run_ranks(_save, 2, path, {"tp": 2}, ckpt, hf_dir)[0]
    for sizes, world in (({}, 1), ({"pp": 2}, 2)):
        for fresh, loaded, after_load in run_ranks(_load, world, path, sizes, ckpt):
            assert (fresh - saved).abs().max() > 1e-3, "the checkpoint must differ from the HF weights"
            torch.testing.assert_close(loaded, saved, atol=1e-5, rtol=0)
            # same loss and grad norm on the next step: optimizer state and schedule came back too
            for key in ("loss", "grad_norm", "lr"):
                assert abs(after_load[key] - after[key]) <= 1e-5 * max(1.0, abs(after[key])), key

    # The HF export of the trained model: transformers loads it and gives the engine's log-probs.
    batch = make_batch(8)
    logits = hf_logits(hf_dir, batch["input_ids"], batch["attention_mask"])
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    lp = logits[:, p - 1:p + r - 1].log_softmax(-1).gather(-1, batch["responses"][..., None])[..., 0]
    torch.testing.assert_close(lp * batch["response_mask"], saved, atol=1e-5, rtol=0)


def _bf16_round_trip(rank, world, path, ckpt):
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    eng = MegatronEngine(RankContext(rank, dims(world, {})), {"path": path}, {**OPTS, "bf16": True})
    batch = make_batch(8)
    eng.train(batch, pg_loss, mini_batch_size=8, micro_batch_size=2)
    eng.save_checkpoint(ckpt)
    saved = eng.compute_logprobs(batch)["logprobs"]
    eng.train(batch, pg_loss, mini_batch_size=8, micro_batch_size=2)
    moved = eng.compute_logprobs(batch)["logprobs"]
    eng.load_checkpoint(ckpt)
    return saved, moved, eng.compute_logprobs(batch)["logprobs"]


def test_a_bfloat16_model_saves_its_mixed_precision_optimizer(tmp_path):
    """bf16 weights with float32 master copies (megatron's Float16 optimizer) save and load: every
    weight, the local spec's norms too, is bf16 as that optimizer expects (else: 'Param id ... does not
    match any model sharded param' at the first save, as on the GPU)."""
    path = make_tiny_hf(str(tmp_path / "m"), "qwen3")
    [(saved, moved, loaded)] = run_ranks(_bf16_round_trip, 1, path, str(tmp_path / "ckpt"))
    assert (moved - saved).abs().max() > 0, "the second step must move the weights"
    torch.testing.assert_close(loaded, saved, atol=0, rtol=0)
