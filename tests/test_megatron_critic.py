"""The value model (PPO critic) of the Megatron strategy: values equal HF's token classifier on the
same weights, are 0 on padding, TP2+SP and PP2 give the 1-rank values, step and export; training
lowers the value loss; a checkpoint reloads at another layout; the HF export loads in transformers."""

from __future__ import annotations

import pytest
import torch

from dist_utils import TINY, dims, make_batch, make_tiny_hf, randomize_norms_and_biases, run_ranks
from siirl_dag.errors import ConfigError
from siirl_dag.strategies.base import RankContext

OPTS = {"value_head": True, "lr": 1e-3, "eps": 1e-3, "weight_decay": 0.1, "betas": [0.8, 0.95], "clip_grad": 1.0}
STEPS = 5  # training steps of the 1-rank run after the first (shared) one


def make_critic_hf(directory: str, seed: int = 0) -> str:
    """A tiny HF value model: Qwen2ForTokenClassification with one label and a bias-free `score`."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.Qwen2Config(**TINY, num_labels=1, token_classification_bias=False)
    model = transformers.Qwen2ForTokenClassification(config).float()
    randomize_norms_and_biases(model)
    model.save_pretrained(directory)
    return directory


def hf_values(path: str, batch: dict) -> torch.Tensor:
    """HF's value of the state before each response token (output at P+j-1), 0 on padding."""
    import transformers

    model = transformers.AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    return out[:, p - 1:p + r - 1] * batch["response_mask"]


def critic_batch() -> dict:
    """A fixed batch with returns to regress on and old values (the engine's, set by the caller)."""
    batch = make_batch(8)
    g = torch.Generator().manual_seed(1)
    batch["returns"] = (1.0 + torch.randn(batch["responses"].shape, generator=g)) * batch["response_mask"]
    return batch


def critic_loss(values, mb, totals):
    from nodes.algos.losses import ppo_critic_loss

    return ppo_critic_loss(values, mb["values"], mb["returns"], mb["response_mask"], cliprange_value=100.0,
                           totals=totals)


def _engine(rank, world, path, sizes, opts=OPTS, lora=None):
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    return MegatronEngine(RankContext(rank, dims(world, sizes)), {"path": path, "lora": lora}, opts)


def _one_rank(rank, world, path, lm_path, ckpt, hf_dir):
    eng = _engine(rank, world, path, {})
    batch = critic_batch()
    out = {"before": eng.compute_values(batch, micro_batch_size=3)}
    batch["values"] = out["before"]
    out["metrics"] = eng.train_values(batch, critic_loss, mini_batch_size=8, micro_batch_size=2)
    out["after"] = eng.compute_values(batch)
    out["weights"] = dict(eng.export_hf_weights())
    out["losses"] = [out["metrics"]["critic/vf_loss"]] + [
        eng.train_values(batch, critic_loss, mini_batch_size=8, micro_batch_size=2)["critic/vf_loss"]
        for _ in range(STEPS)]
    eng.save_checkpoint(ckpt)
    eng.save_hf(hf_dir)
    out["saved"] = eng.compute_values(batch)
    out["next"] = eng.train_values(batch, critic_loss, mini_batch_size=8, micro_batch_size=2)
    # an LM checkpoint (no `score` head) as a critic: the head starts at zero; log-probs are refused
    fresh = _engine(rank, world, lm_path, {})
    out["fresh"] = fresh.compute_values(batch)
    with pytest.raises(ConfigError, match="value_head") as refused:
        fresh.compute_logprobs(batch)
    out["refused"] = str(refused.value)
    return out


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    root = tmp_path_factory.mktemp("critic")
    path = make_critic_hf(str(root / "critic"))
    lm_path = make_tiny_hf(str(root / "lm"), "qwen2", tie_word_embeddings=True)
    ckpt, hf_dir = str(root / "ckpt"), str(root / "hf")
    return path, ckpt, hf_dir, run_ranks(_one_rank, 1, path, lm_path, ckpt, hf_dir)[0]


def test_values_are_hf_token_classifier_outputs_masked(one_rank):
    path, _, _, out = one_rank
    batch = critic_batch()
    values = out["before"]
    assert values.shape == batch["responses"].shape
    assert values.abs().max() > 1e-2, "a loaded value head gives non-zero values"
    assert torch.all(values[batch["response_mask"] == 0] == 0)
    torch.testing.assert_close(values, hf_values(path, batch), atol=1e-5, rtol=0)


def test_a_critic_without_a_head_starts_at_zero(one_rank):
    out = one_rank[3]
    assert torch.all(out["fresh"] == 0)
    assert "compute_logprobs needs a language model" in out["refused"]


def test_training_lowers_the_value_loss(one_rank):
    losses = one_rank[3]["losses"]
    assert losses[-1] < 0.25 * losses[0], losses


def _layout(rank, world, path, sizes, opts, ckpt):
    eng = _engine(rank, world, path, sizes, {**OPTS, **opts})
    batch = critic_batch()
    batch["values"] = eng.compute_values(batch)
    out = {"before": batch["values"]}
    out["metrics"] = eng.train_values(batch, critic_loss, mini_batch_size=8, micro_batch_size=2)
    out["after"] = eng.compute_values(batch)
    out["weights"] = dict(eng.export_hf_weights())
    eng.load_checkpoint(ckpt)  # saved by the 1-rank run, resharded to this layout
    out["loaded"] = eng.compute_values(batch)
    out["next"] = eng.train_values(batch, critic_loss, mini_batch_size=8, micro_batch_size=2)
    return out


@pytest.mark.parametrize("sizes, opts", [({"tp": 2}, {"sequence_parallel": True}), ({"pp": 2}, {})],
                         ids=["tp2-sp", "pp2"])
def test_parallel_layouts_match_one_rank_and_load_its_checkpoint(one_rank, sizes, opts):
    path, ckpt, _, ref = one_rank
    for r in run_ranks(_layout, 2, path, sizes, opts, ckpt):
        torch.testing.assert_close(r["before"], ref["before"], atol=1e-5, rtol=0)
        for key in ("loss", "critic/vf_loss", "critic/vpred_mean", "grad_norm"):
            assert r["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), key
        torch.testing.assert_close(r["after"], ref["after"], atol=1e-5, rtol=0)
        assert sorted(r["weights"]) == sorted(ref["weights"]) and "score.weight" in r["weights"]
        for name, tensor in ref["weights"].items():
            torch.testing.assert_close(r["weights"][name], tensor, atol=1e-6, rtol=0, msg=name)
        # the checkpoint: same values, and the same next step (optimizer state and schedule came back)
        torch.testing.assert_close(r["loaded"], ref["saved"], atol=1e-5, rtol=0)
        for key in ("loss", "grad_norm", "lr"):
            assert r["next"][key] == pytest.approx(ref["next"][key], rel=1e-5, abs=1e-6), key
    assert (ref["after"] - ref["before"]).abs().max() > 1e-3, "the step must move the values"


def test_hf_export_loads_as_a_token_classifier(one_rank):
    _, _, hf_dir, out = one_rank
    assert (out["saved"] - out["before"]).abs().max() > 1e-2, "the export must hold the trained head"
    torch.testing.assert_close(hf_values(hf_dir, critic_batch()), out["saved"], atol=1e-5, rtol=0)


def _lora_critic(rank, world, path, ckpt, peft_dir):
    from siirl_dag.models.lora import ATTENTION, MLP, LoraSpec

    spec = LoraSpec(8, 16.0, frozenset(ATTENTION + MLP))
    eng = _engine(rank, world, path, {}, OPTS, spec)
    batch = critic_batch()
    batch["values"] = eng.compute_values(batch)
    out = {"trainable": sorted(n for c in eng.chunks for n, p in c.named_parameters() if p.requires_grad),
           "base": dict(eng.export_hf_weights(what="base")), "before": batch["values"]}
    out["losses"] = [eng.train_values(batch, critic_loss, mini_batch_size=8, micro_batch_size=2)["critic/vf_loss"]
                     for _ in range(STEPS)]
    out["base_after"], out["values"] = dict(eng.export_hf_weights(what="base")), eng.compute_values(batch)
    eng.save_checkpoint(ckpt)
    eng.save_adapters(peft_dir)
    fresh = _engine(rank, world, path, {}, OPTS, spec)
    fresh.load_checkpoint(ckpt)
    out["loaded"] = fresh.compute_values(batch)
    return out


def test_a_critic_with_lora_trains_its_adapters_and_head_and_exports_them_as_peft(one_rank, tmp_path):
    """The base frozen, the adapters and the new value head trained; a checkpoint holds both, and the
    PEFT folder (adapters + `score` as a module to save) computes the same values in peft + HF."""
    import json

    from peft import PeftModel
    from transformers import AutoModelForTokenClassification

    path = one_rank[0]
    out = run_ranks(_lora_critic, 1, path, str(tmp_path / "ckpt"), str(tmp_path / "peft"))[0]
    assert "output_layer.weight" in out["trainable"]
    assert all(".lora_" in n or n == "output_layer.weight" for n in out["trainable"]), out["trainable"]
    assert out["losses"][-1] < 0.5 * out["losses"][0], out["losses"]
    changed = {n for n, t in out["base"].items() if not torch.equal(out["base_after"][n], t)}
    assert changed == {"score.weight"}, changed
    torch.testing.assert_close(out["loaded"], out["values"], atol=1e-6, rtol=0)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["task_type"] == "TOKEN_CLS" and config["modules_to_save"] == ["score"]
    model = PeftModel.from_pretrained(AutoModelForTokenClassification.from_pretrained(path, dtype=torch.float32),
                                      str(tmp_path / "peft")).eval()
    batch = critic_batch()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[..., 0]
    p, r = batch["prompts"].shape[1], batch["responses"].shape[1]
    torch.testing.assert_close(logits[:, p - 1:p + r - 1] * batch["response_mask"], out["values"], atol=1e-4, rtol=0)
