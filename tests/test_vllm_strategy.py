"""The vLLM rollout strategy against a real in-process vLLM engine (one per session, see conftest)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from safetensors.torch import load_file, save_file

from dist_utils import run_ranks
from siirl_dag.errors import ConfigError
from siirl_dag.placement.parallel_dims import ParallelDims
from siirl_dag.strategies.base import RankContext
from siirl_dag.strategies.vllm.rollout import VllmRollout
from siirl_dag.strategies.vllm.options import resolve_options

P, R = 24, 12
PROMPTS = ["Q: 23+58=? A:", "Q: 7+5=? A:", "hello"]


def hf_model(model_dir, state_dict=None):
    """The HF model of `model_dir`, with checkpoint-format `state_dict` instead of its weights if given."""
    from transformers import AutoModelForCausalLM

    if state_dict is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with tempfile.TemporaryDirectory() as tmp:  # from_pretrained converts (e.g. fuses MoE experts)
        shutil.copytree(model_dir, tmp, dirs_exist_ok=True)
        save_file(state_dict, f"{tmp}/model.safetensors", metadata={"format": "pt"})
        return AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.float32).eval()


def hf_logprobs(model, out, temperature=1.0):
    """Log-probs of the sampled response tokens under HF, from the batch's own layout tensors."""
    with torch.no_grad():
        logits = model(input_ids=out["input_ids"], attention_mask=out["attention_mask"],
                       position_ids=out["position_ids"]).logits
    logits = logits[:, P - 1:P + R - 1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, out["responses"].unsqueeze(-1)).squeeze(-1)


def checkpoint(model_dir):
    return load_file(f"{model_dir}/model.safetensors")


def perturb(state_dict, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=gen) for k, v in state_dict.items()}


# --- layout -----------------------------------------------------------------------------------

@pytest.mark.engines
def test_layout_shapes_and_masks(vllm_engine):
    out = vllm_engine.generate(PROMPTS, {"seed": 1}, P, R)
    B = len(PROMPTS)
    for key, shape in [("prompts", (B, P)), ("prompt_mask", (B, P)), ("responses", (B, R)),
                       ("response_mask", (B, R)), ("input_ids", (B, P + R)), ("attention_mask", (B, P + R)),
                       ("position_ids", (B, P + R)), ("rollout_logprobs", (B, R)), ("response_length", (B,))]:
        assert tuple(out[key].shape) == shape, key
    tok, pad = vllm_engine.tokenizer, vllm_engine.pad_token_id
    for row, text in enumerate(PROMPTS):
        ids = tok.encode(text)
        assert out["prompts"][row, P - len(ids):].tolist() == ids  # left-padded
        assert out["prompt_mask"][row].tolist() == [0] * (P - len(ids)) + [1] * len(ids)
        assert (out["prompts"][row, :P - len(ids)] == pad).all()
        n = int(out["response_length"][row])
        assert out["response_mask"][row].tolist() == [1] * n + [0] * (R - n)  # right-padded
        assert (out["responses"][row, n:] == pad).all()
        assert (out["rollout_logprobs"][row, :n] < 0).all() and (out["rollout_logprobs"][row, n:] == 0).all()
        assert out["finish_reason"][row] == ("length" if n == R else "stop")
    assert torch.equal(out["input_ids"], torch.cat([out["prompts"], out["responses"]], 1))
    assert torch.equal(out["attention_mask"], torch.cat([out["prompt_mask"], out["response_mask"]], 1))
    assert torch.equal(out["position_ids"], (out["attention_mask"].cumsum(1) - 1).clamp(min=0))
    assert out["sample_index"] == [0, 1, 2]


@pytest.mark.engines
def test_token_id_prompts_and_chat_template(vllm_engine):
    tok = vllm_engine.tokenizer
    ids = tok.encode("Q: 1+1=? A:")
    out = vllm_engine.generate([ids], {"greedy": True, "max_tokens": 4}, P, R)
    assert out["prompts"][0, P - len(ids):].tolist() == ids
    chat = vllm_engine.generate(["1+1"], {"greedy": True, "max_tokens": 4}, P, R, chat_template=True)
    expected = tok.encode("user: 1+1\nassistant:")
    assert chat["prompts"][0, P - len(expected):].tolist() == expected
    assert int(chat["prompt_mask"].sum()) == len(expected)
    # a chat list (the prompt column of verl-style data, e.g. scripts/convert_gsm8k.py) is always templated
    listed = vllm_engine.generate([[{"role": "user", "content": "1+1"}]], {"greedy": True, "max_tokens": 4}, P, R)
    assert torch.equal(listed["prompts"], chat["prompts"]) and torch.equal(listed["responses"], chat["responses"])


@pytest.mark.engines
def test_n_samples_are_grouped(vllm_engine):
    out = vllm_engine.generate(PROMPTS[:2], {"n": 3, "seed": 7}, P, R)
    assert out["sample_index"] == [0, 0, 0, 1, 1, 1]
    assert out["responses"].shape == (6, R)
    for group in (slice(0, 3), slice(3, 6)):
        prompts = out["prompts"][group]
        assert (prompts == prompts[0]).all()
        assert len({tuple(r.tolist()) for r in out["responses"][group]}) > 1  # samples differ


@pytest.mark.engines
def test_seed_reproducible_and_distinct_per_prompt(vllm_engine):
    a = vllm_engine.generate(["same", "same"], {"n": 2, "seed": 5}, P, R)
    host = torch.get_rng_state()
    b = vllm_engine.generate(["same", "same"], {"n": 2, "seed": 5}, P, R)
    assert torch.equal(a["responses"], b["responses"])
    assert torch.equal(torch.get_rng_state(), host)  # the call's seed leaves the process's own stream as it was
    # equal prompts still get their own random streams (no seed shared between rows)
    assert len({tuple(r.tolist()) for r in a["responses"]}) == 4
    c = vllm_engine.generate(["same", "same"], {"n": 2, "seed": 6}, P, R)
    assert not torch.equal(a["responses"], c["responses"])


@pytest.mark.engines
def test_greedy_is_deterministic_and_matches_hf(vllm_engine, tiny_model_dir):
    a = vllm_engine.generate(PROMPTS, {"greedy": True}, P, R)
    b = vllm_engine.generate(PROMPTS, {"greedy": True, "seed": 123}, P, R)
    assert torch.equal(a["responses"], b["responses"])
    model = hf_model(tiny_model_dir)
    for row, text in enumerate(PROMPTS):
        ids = torch.tensor([vllm_engine.tokenizer.encode(text)])
        hf = model.generate(ids, max_new_tokens=R, do_sample=False, eos_token_id=None, pad_token_id=0)
        assert hf[0, ids.shape[1]:].tolist() == a["responses"][row].tolist()


@pytest.mark.engines
def test_a_rollout_in_segments_is_the_rollout_in_one_go(vllm_engine, tiny_model_dir):
    """Partial rollouts: segments of 5 tokens, each continued after its prompt and the tokens so far,
    give greedy's tokens; every token's log-prob is HF's for the sample as a whole."""
    from siirl_dag.strategies.samples import PARTIAL, unpack_batch

    whole = vllm_engine.generate(PROMPTS, {"greedy": True}, P, R)
    out, segments = vllm_engine.generate(PROMPTS, {"greedy": True}, P, R, max_new_tokens=5), 1
    assert out["finish_reason"] == [PARTIAL] * 3 and out["response_length"].tolist() == [5] * 3
    while PARTIAL in out["finish_reason"]:
        out, segments = vllm_engine.resume(*unpack_batch(out), {"greedy": True}, P, R, 5), segments + 1
    assert segments == 3 and out["finish_reason"] == whole["finish_reason"]
    for key in ("prompts", "responses", "attention_mask", "position_ids", "response_length"):
        assert torch.equal(out[key], whole[key]), key
    ref = hf_logprobs(hf_model(tiny_model_dir), out)
    mask = out["response_mask"].bool()
    assert torch.allclose(out["rollout_logprobs"][mask], ref[mask], atol=1e-3)


@pytest.mark.engines
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_rollout_logprobs_match_hf(vllm_engine, tiny_model_dir, temperature):
    out = vllm_engine.generate(PROMPTS, {"n": 2, "seed": 11, "temperature": temperature}, P, R)
    ref = hf_logprobs(hf_model(tiny_model_dir), out, temperature)
    mask = out["response_mask"].bool()
    assert mask.sum() > 0
    torch.testing.assert_close(out["rollout_logprobs"][mask], ref[mask], atol=1e-4, rtol=0)


# --- stopping -----------------------------------------------------------------------------------

def stop_candidate(response: list[int], tokenizer) -> int:
    """A position >= 2 holding a printable ASCII character token that occurs there first."""
    for j, t in enumerate(response):
        text = tokenizer.decode([t])
        plain = len(text) == 1 and text.isascii() and text.isprintable() and text != "#"
        if j >= 2 and response.index(t) == j and plain:
            return j
    pytest.skip("sampled response has no token to stop on")


@pytest.mark.engines
def test_stop_strings_and_stop_token_ids(vllm_engine):
    sampling = {"seed": 3}  # same seed: the same tokens up to the stop
    full = vllm_engine.generate(PROMPTS[:1], sampling, P, R)["responses"][0].tolist()
    j = stop_candidate(full, vllm_engine.tokenizer)
    for stop in ({"stop": [vllm_engine.tokenizer.decode([full[j]])]}, {"stop_token_ids": [full[j]]}):
        out = vllm_engine.generate(PROMPTS[:1], {**sampling, **stop}, P, R)
        assert out["finish_reason"] == ["stop"], stop
        assert out["response_length"].tolist() == [j + 1], stop  # the stopping token is kept
        assert out["responses"][0, :j + 1].tolist() == full[:j + 1]


# --- errors -------------------------------------------------------------------------------------

@pytest.mark.engines
def test_too_long_prompt_is_refused(vllm_engine):
    with pytest.raises(ConfigError, match=r"prompt 1 has 30 tokens.*max_prompt_length=24"):
        vllm_engine.generate(["ok", "x" * 30], None, P, R)


@pytest.mark.engines
def test_bad_lengths_and_keys_are_refused(vllm_engine):
    with pytest.raises(ConfigError, match="max_tokens=20 exceeds max_response_length=12"):
        vllm_engine.generate(["ok"], {"max_tokens": 20}, P, R)
    with pytest.raises(ConfigError, match=r"sampling\.temprature: unknown sampling key"):
        vllm_engine.generate(["ok"], {"temprature": 0.5}, P, R)


def test_options_are_checked_before_any_engine_starts(tiny_model_dir):
    with pytest.raises(ConfigError, match="options: Additional properties"):
        VllmRollout(RankContext(0, 1), tiny_model_dir, {"temprature": 1.0})
    with pytest.raises(RuntimeError, match="process group"):  # none, or vLLM's own of 1 rank
        VllmRollout(RankContext(0, ParallelDims(tp=2)), tiny_model_dir, {})
    assert resolve_options({})["kv_cache_gb"] == 1.0


# --- weights ------------------------------------------------------------------------------------

@pytest.mark.engines
def test_weight_update_changes_outputs_and_restore_brings_them_back(vllm_engine, tiny_model_dir):
    original = checkpoint(tiny_model_dir)
    perturbed = perturb(original)
    before = vllm_engine.generate(PROMPTS, {"greedy": True}, P, R)
    v0 = vllm_engine.weights_version

    # streamed as a generator, as the weight-sync layer does with buckets
    vllm_engine.load_weights(((k, v) for k, v in perturbed.items()), version=v0 + 1)
    assert vllm_engine.weights_version == v0 + 1
    changed = vllm_engine.generate(PROMPTS, {"greedy": True}, P, R)
    assert not torch.equal(changed["responses"], before["responses"])
    mask = changed["response_mask"].bool()
    ref = hf_logprobs(hf_model(tiny_model_dir, perturbed), changed)
    torch.testing.assert_close(changed["rollout_logprobs"][mask], ref[mask], atol=1e-4, rtol=0)

    vllm_engine.load_weights(original.items(), version=v0 + 2)
    assert vllm_engine.weights_version == v0 + 2
    restored = vllm_engine.generate(PROMPTS, {"greedy": True}, P, R)
    assert torch.equal(restored["responses"], before["responses"])
    assert torch.equal(restored["rollout_logprobs"], before["rollout_logprobs"])

    with pytest.raises(ValueError, match="older than"):
        vllm_engine.load_weights(original.items(), version=v0)

    def failing_half_way():
        yield from list(perturbed.items())[:3]
        raise ConnectionError("the trainer went away")

    with pytest.raises(ConnectionError):
        vllm_engine.load_weights(failing_half_way(), version=v0 + 3)
    assert vllm_engine.weights_version == v0 + 2
    with pytest.raises(RuntimeError, match="a weight load that failed part-way"):
        vllm_engine.generate(PROMPTS, {"greedy": True}, P, R)  # never from half-updated weights
    vllm_engine.load_weights(original.items(), version=v0 + 3)
    assert torch.equal(vllm_engine.generate(PROMPTS, {"greedy": True}, P, R)["responses"], before["responses"])


@pytest.mark.engines
def test_offload_onload_keep_the_engine_usable(vllm_engine):
    before = vllm_engine.generate(PROMPTS[:1], {"greedy": True}, P, R)
    vllm_engine.offload()
    vllm_engine.onload()
    after = vllm_engine.generate(PROMPTS[:1], {"greedy": True}, P, R)
    assert torch.equal(before["responses"], after["responses"])


# --- in fresh processes: tensor parallel over two gloo ranks, and an MoE model ---------------------

def _rank_main(rank, world, sizes, model_dir, *update_paths):
    """One rank (gloo group made by dist_utils): greedy rollout, then after each weight update (files, in
    order) greedy again. Every rollout on CPU keeps its weights plain, and MoE experts are prepacked
    again after each load (cpu_compat.after_load): two updates check that the second takes too."""
    from conftest import VLLM_TEST_OPTIONS

    engine = VllmRollout(RankContext(rank, ParallelDims(**sizes)), model_dir, dict(VLLM_TEST_OPTIONS))
    outs = [engine.generate(PROMPTS, {"greedy": True}, P, R)]
    for version, path in enumerate(update_paths, 1):
        engine.load_weights(iter(load_file(path).items()), version=version)
        outs.append(engine.generate(PROMPTS, {"greedy": True}, P, R))
    sockets = [path for path in engine._left if os.path.dirname(path) == engine._sockets]
    engine.close()
    # vLLM binds a TP group's message-queue sockets as files on the group's first rank, and never removes them
    assert bool(sockets) == (sizes["tp"] > 1 and rank % sizes["tp"] == 0), sockets
    assert not any(map(os.path.exists, sockets)) and not os.path.exists(engine._sockets)
    return outs


def updates(model_dir, folder, *seeds):
    """Perturbed checkpoints saved as files (for ranks in other processes): [(state dict, path)]."""
    out = []
    for seed in seeds:
        state = perturb(checkpoint(model_dir), seed=seed)
        save_file(state, folder / f"update{seed}.safetensors")
        out.append((state, str(folder / f"update{seed}.safetensors")))
    return out


@pytest.mark.engines
@pytest.mark.parametrize("dp", [1, 2], ids=["d1t2", "d2t2"])
def test_tensor_parallel_2_matches_t1_and_takes_weight_updates(vllm_engine, tiny_model_dir, tmp_path, dp):
    """d2t2: four ranks make two engines of two shards each; every rank must see its engine's batch."""
    changes = updates(tiny_model_dir, tmp_path, 1, 3)
    outs = run_ranks(_rank_main, 2 * dp, {"dp": dp, "tp": 2}, tiny_model_dir, *[path for _, path in changes],
                     timeout=400)
    reference = vllm_engine.generate(PROMPTS, {"greedy": True}, P, R)
    for before, *after in outs:  # both ranks of the one engine return the same batch
        assert torch.equal(before["responses"], reference["responses"])
        torch.testing.assert_close(before["rollout_logprobs"], reference["rollout_logprobs"], atol=1e-5, rtol=0)
        for batch, (state, _) in zip(after, changes):
            mask = batch["response_mask"].bool()
            torch.testing.assert_close(batch["rollout_logprobs"][mask],
                                       hf_logprobs(hf_model(tiny_model_dir, state), batch)[mask], atol=1e-4, rtol=0)


@pytest.mark.engines
def test_moe_model_with_untied_head_takes_weight_updates(tmp_path):
    from make_tiny_model import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "moe", arch="qwen3_moe", num_experts=4, tie_word_embeddings=False)
    changes = updates(model_dir, tmp_path, 2, 4)
    [outs] = run_ranks(_rank_main, 1, {"dp": 1, "tp": 1}, model_dir, *[path for _, path in changes], timeout=300)
    for batch, state in zip(outs, [None] + [state for state, _ in changes]):
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(batch["rollout_logprobs"][mask], hf_logprobs(hf_model(model_dir, state), batch)[mask],
                                   atol=1e-4, rtol=0)
    assert not torch.equal(outs[0]["responses"], outs[1]["responses"])


def test_the_engine_sleeps_and_wakes_only_across_a_change(monkeypatch):
    """On a GPU a colocated rollout sleeps for the trainer and wakes for itself; a wake of an engine that
    is awake (a run's first sync: vLLM warns "Executor is not sleeping") or a sleep of one asleep never
    reaches vLLM. vLLM stands in as a recorder: this is the strategy's own logic."""
    from types import SimpleNamespace

    from siirl_dag.strategies.vllm import rollout

    calls = []
    monkeypatch.setattr(rollout.cpu_compat, "active", lambda: False)
    engine = VllmRollout.__new__(VllmRollout)
    engine.options, engine._asleep, engine._needs_weights = {"sleep_level": 2}, False, False
    engine.llm = SimpleNamespace(sleep=lambda level: calls.append(f"sleep {level}"), wake_up=lambda: calls.append("wake"))
    engine.onload()
    engine.offload()
    engine.offload()
    assert engine._needs_weights, "a level-2 sleep drops the weights: the next generate needs a sync first"
    engine.onload()
    engine.onload()
    assert calls == ["sleep 2", "wake"]
