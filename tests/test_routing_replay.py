"""Routing replay in the Megatron engine: a router replaying the experts it would choose itself
changes nothing, and records them as HF's fp32 forward routes; replayed routes bring its log-probs
closer to those of the bf16 forward that chose them (vLLM's, captured from a prefill on CPU, and
HF's); recording and replay under TP2 + SP, PP2 and EP2, and with activation recompute, give the routes,
log-probs, loss and grad norm of one rank. And the YAML that asks for it, at the door."""

from __future__ import annotations

import pytest
import torch

from bench_routing_replay import hf_routes
from dist_utils import dims, make_batch, make_tiny_hf, run_ranks
from siirl_dag.strategies.base import RankContext
from test_megatron_engine import OPTS, _gather_dp, _shard, pg_loss


def random_routes(batch: dict, layers: int, experts: int, topk: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    B, T = batch["input_ids"].shape
    return torch.rand(B, T, layers, experts, generator=g).argsort(-1)[..., :topk].to(torch.uint8)


def _replayed(rank, world, path, sizes, opts, routes, others=None):
    """Log-probs of its own routes and replaying `routes`, a step replaying them, log-probs after;
    and log-probs replaying each of `others` (name -> routes) before the step."""
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    eng = MegatronEngine(RankContext(rank, dims(world, sizes)), {"path": path}, {**OPTS, **opts})
    batch = _shard({**make_batch(8), "routed_experts": routes}, eng.dp_rank, eng.dp_size)
    own = eng.compute_logprobs(batch, micro_batch_size=2, record_routes=True)
    out = {"dp_rank": eng.dp_rank, "own": own["logprobs"], "recorded": own["routed_experts"],
           "before": eng.compute_logprobs(batch, micro_batch_size=2, replay_routes=True)["logprobs"]}
    for name, other in (others or {}).items():
        out[name] = eng.compute_logprobs({**batch, "routed_experts": other}, replay_routes=True)["logprobs"]
    out["metrics"] = eng.train(batch, pg_loss, mini_batch_size=8, micro_batch_size=2, replay_routes=True)
    out["after"] = eng.compute_logprobs(batch, micro_batch_size=4, replay_routes=True)["logprobs"]
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    path = make_tiny_hf(str(tmp_path_factory.mktemp("routing_replay") / "moe"), "qwen3_moe")
    batch = make_batch(8)
    routes = random_routes(batch, layers=2, experts=4, topk=2)
    own, _ = hf_routes(path, batch, torch.float32)  # megatron's fp32 forward routes as HF's fp32 does
    rollout, rollout_lp = hf_routes(path, batch, torch.bfloat16)
    ref = run_ranks(_replayed, 1, path, {}, {}, routes, {"own_replayed": own, "rollout_replayed": rollout})[0]
    return path, routes, {**ref, "flips": (own != rollout).any(-1).float().mean(), "rollout_lp": rollout_lp,
                          "own_routes": own}


@pytest.mark.engines
def test_replaying_its_own_routes_changes_nothing_and_rollout_routes_come_closer(moe):
    _, _, ref = moe
    torch.testing.assert_close(ref["own_replayed"], ref["own"], atol=1e-5, rtol=0)
    real = make_batch(8)["attention_mask"].bool()
    recorded, own = ref["recorded"][real].long().sort(-1).values, ref["own_routes"][real].long().sort(-1).values
    assert torch.equal(recorded, own), "the routes megatron records are the ones it (and HF in fp32) takes"
    assert ref["recorded"][~real].eq(0).all()
    mask = make_batch(8)["response_mask"].bool()
    without = (ref["own"] - ref["rollout_lp"]).abs()[mask]
    with_replay = (ref["rollout_replayed"] - ref["rollout_lp"]).abs()[mask]
    assert ref["flips"] > 0, "bfloat16 must flip some routes of this model for the comparison to mean anything"
    assert with_replay.mean() < without.mean() and with_replay.max() < without.max()


@pytest.mark.engines
def test_megatron_replaying_vllms_routes_comes_closer_to_vllms_log_probs():
    """vLLM (bf16, each row prefilled alone, its routers' choices captured) against Megatron (fp32):
    scripts/bench_routing_replay.py measures both ways."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    res = subprocess.run([sys.executable, "scripts/bench_routing_replay.py", "--json", "--rows", "8"], cwd=root,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    r = json.loads(res.stdout)
    assert r["sampler"] == "vllm" and r["routes_flipped"] > 0
    assert r["mean_abs_diff_replayed"] < r["mean_abs_diff_without"]
    assert r["max_abs_diff_replayed"] < r["max_abs_diff_without"]


@pytest.mark.engines
def test_replay_steers_log_probs_and_training(moe):
    _, _, ref = moe
    assert (ref["before"] - ref["own"]).abs().max() > 0.1, "replaying other experts must change the log-probs"
    assert (ref["after"] - ref["before"]).abs().max() > 1e-3, "the step must move the log-probs"


CASES = {
    "tp2-sp": ({"tp": 2}, {"sequence_parallel": True, "moe_token_dispatcher_type": "alltoall"}),
    "pp2": ({"pp": 2}, {}),
    "ep2": ({"ep": 2}, {"moe_token_dispatcher_type": "alltoall"}),
    # the backward re-runs the routers: they replay the queued routes, in 1F1B order across two stages
    "pp2-full-recompute": ({"pp": 2}, {"recompute_granularity": "full"}),
    "ep2-moe-layer-recompute": ({"ep": 2}, {"moe_token_dispatcher_type": "alltoall", "moe_layer_recompute": True}),
}


@pytest.mark.engines
@pytest.mark.parametrize("case", list(CASES))
def test_replay_under_parallel_layouts_matches_one_rank(case, moe):
    path, routes, ref = moe
    sizes, opts = CASES[case]
    results = run_ranks(_replayed, 2, path, sizes, opts, routes)
    for key in ("before", "after"):
        torch.testing.assert_close(_gather_dp(results, key), ref[key], atol=2e-5, rtol=0, msg=key)
    assert torch.equal(_gather_dp(results, "recorded"), ref["recorded"]), "the routes recorded (R2)"
    for r in results:
        for key in ("loss", "grad_norm"):
            assert r["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-6), key


def test_route_alignment_follows_the_tokens():
    """Rows are shifted left to start at position 0; the last real token and the padding take 0..K-1."""
    from siirl_dag.strategies.megatron.routing_replay import align

    routes = torch.tensor([[[[9, 8]], [[7, 6]], [[5, 4]], [[3, 2]]]], dtype=torch.uint8)  # [1, 4 tokens, 1 layer, 2]
    src = torch.tensor([[1, 2, 3, 3, 3]])  # a row whose prompt padding was position 0
    out = align(routes, src, torch.tensor([3]), topk=2)
    assert out[0, :, 0].tolist() == [[7, 6], [5, 4], [0, 1], [0, 1], [0, 1]]
    with pytest.raises(ValueError, match="routes to 3"):
        align(routes, src, torch.tensor([3]), topk=3)


# ------------------------------------------------------------------ the YAML, at the door
MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 4, "num_experts_per_tok": 2}


def replay_pipeline(tmp_path, device="cuda", hf_config=MOE, record=True, recorder="rollout"):
    import json

    from test_config import BASE

    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(hf_config))
    text = (BASE.replace("device: cpu", f"device: {device}").replace("no/such/model", str(model))
            .replace("options: {n: 4}}", "options: {n: 4}" + (", params: {routed_experts: true}}"
                                                              if record and recorder == "rollout" else "}"))
            .replace("params: {output: old_logprobs}", "params: {output: old_logprobs, routing_replay: true}"
                     if recorder == "rollout" else "params: {output: old_logprobs, routed_experts: true}")
            .replace("    params: {mini_batch_size: 4}",
                     "    params: {mini_batch_size: 4, routing_replay: true}"))
    f = tmp_path / "p.yaml"
    f.write_text(text)
    return f


def refusal(tmp_path, **kwargs):
    from siirl_dag.config import load_pipeline
    from siirl_dag.errors import ConfigError

    f = replay_pipeline(tmp_path, **kwargs)
    with pytest.raises(ConfigError) as info:
        load_pipeline(f)
    errors = [p for p in info.value.problems if p.severity == "error"]
    assert errors and all(p.file == str(f) for p in errors)
    return errors, f.read_text().splitlines()


def test_a_recording_rollout_starts_its_engine_recording_and_feeds_the_replaying_nodes(tmp_path):
    from siirl_dag.config import load_pipeline

    pipe = load_pipeline(replay_pipeline(tmp_path))
    assert pipe.nodes["rollout"].options["return_routed_experts"] is True
    assert "routed_experts" in pipe.produces("rollout")
    assert "routed_experts" in pipe.consumes("old_logprob") and "routed_experts" in pipe.consumes("actor_update")


def test_old_log_probs_record_routes_for_the_update_on_cpu(tmp_path):
    """R2: the old log-probs (Megatron) record, the update replays; no GPU needed."""
    from siirl_dag.config import load_pipeline

    pipe = load_pipeline(replay_pipeline(tmp_path, device="cpu", recorder="old_logprob"))
    assert "routed_experts" in pipe.produces("old_logprob") and "routed_experts" in pipe.consumes("actor_update")
    assert "routed_experts" not in pipe.produces("rollout")


def test_routes_from_vllm_on_cpu_are_refused_with_the_reason(tmp_path):
    errors, lines = refusal(tmp_path, device="cpu")
    (p,) = errors
    assert "needs a GPU" in p.message and "routed_experts: true" in lines[p.line - 1]


def test_replay_on_a_dense_model_is_refused(tmp_path):
    errors, lines = refusal(tmp_path, hf_config={"model_type": "qwen2", "num_hidden_layers": 2})
    assert len(errors) == 3 and all("no routed experts" in p.message for p in errors)
    assert all("routed_experts: true" in lines[p.line - 1] or "routing_replay: true" in lines[p.line - 1]
               for p in errors)


def test_replay_without_recorded_routes_is_refused(tmp_path):
    errors, _ = refusal(tmp_path, record=False)
    assert errors and all("routed_experts" in p.message for p in errors)



def test_packed_routes_sit_under_their_tokens_and_survive_a_partial_rollouts_unpacking():
    """vLLM's [prompt + tokens - 1, L, K] per sample -> the batch's [B, P+R, L, K] and back."""
    import numpy as np

    from siirl_dag.strategies.megatron import batching
    from siirl_dag.strategies.samples import Sample, pack_batch, unpack_batch

    def routes(n):  # token t routed to experts (t, t+1) of every layer
        return np.stack([np.arange(n), np.arange(n) + 1], -1)[:, None, :].repeat(2, 1).astype(np.uint8)

    prompts = [[5, 6, 7], [8]]
    samples = [Sample(0, [1, 2], [0.0, 0.0], "stop", routed_experts=routes(3 + 2 - 1)),
               Sample(1, [3, 4, 9], [0.0] * 3, "length", routed_experts=routes(1 + 3 - 1))]
    batch = pack_batch(prompts, samples, 4, 3, pad_token_id=0)
    got = batch["routed_experts"]
    assert got.shape == (2, 7, 2, 2) and got.dtype == torch.uint8
    assert got[0, 1:5, 0, 0].tolist() == [0, 1, 2, 3] and got[0, :1].sum() == 0 and got[0, 5:].sum() == 0
    assert got[1, 3:6, 1, 1].tolist() == [1, 2, 3]
    _, back = unpack_batch(batch)
    for s, b in zip(samples, back):
        np.testing.assert_array_equal(b.routed_experts, s.routed_experts)
    # megatron's left-aligned rows: token t of a row at position t, the last token and padding 0..K-1
    aligned = batching.align(batch, 6, replay_topk=2)["routed_experts"]
    assert aligned[0, :, 0, 0].tolist() == [0, 1, 2, 3, 0, 0]
    assert aligned[1, :, 0].tolist() == [[0, 1], [1, 2], [2, 3], [0, 1], [0, 1], [0, 1]]


def test_plan_says_who_records_the_routes_and_who_replays_them(tmp_path):
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", "plan", str(replay_pipeline(tmp_path))],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    lines = {line.split()[0]: line for line in res.stdout.splitlines()[1:6]}
    assert lines["rollout"].endswith("records the experts each token is routed to")
    assert lines["actor_update"].endswith("routes each token through the experts rollout recorded")
