"""The levers that balance the demo's meshes, as pure logic: which nodes run ahead under one_step_off
(a frozen model's log-probs on the rollout's devices, and the rewards and advantages of generated rows,
join the generating side), where the update's old
policy comes from (params.old_logprobs: checked at the door; `update` is the same update as an input of
the current policy's log-probs), and the run's timings that `plan` shows."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from nodes.actor_update import actor_update
from pipeline_files import errors, load
from siirl_dag.config import schedule
from siirl_dag.trainer import timings

TEXT = """\
name: t
cluster: {nodes: 1, devices_per_node: 3, device: cpu}
models: {policy: {path: no/such/model, dtype: float32}}
data: {train_files: train.parquet, train_batch_size: 8}
meshes:
  gen: vllm:d1
  train: megatron:d1
  ref: {alloc: "megatron:d1", colocate_with: gen}
nodes:
  - {id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: actor_update, options: {n: 4}}
  - {id: reward, kind: reward, deps: [rollout]}
  - {id: advantage, kind: advantage, deps: [reward]}
  - {id: ref_logprob, kind: logprob, deps: [rollout], mesh: ref, model: policy, params: {output: ref_logprobs}}
  - {id: actor_update, kind: actor_update, deps: [advantage, ref_logprob], mesh: train, model: policy,
     params: {mini_batch_size: 8, old_logprobs: update, use_kl_loss: true, rollout_is: token}}
trainer: {total_steps: 2}
runtime: {schedule: one_step_off}
"""


def test_nodes_reading_only_generated_rows_run_ahead_off_the_training_devices(tmp_path):
    # the reference model shares the rollout's device: it computes beside the update, and so do the
    # driver-side reward and advantage, which read only what the rollout made
    generated = {"rollout", "reward", "advantage", "ref_logprob"}
    assert schedule.generating_nodes(load(tmp_path, TEXT)) == generated
    assert "rollout, reward, advantage, ref_logprob run up to 1 batch ahead of actor_update" in \
        schedule.describe(load(tmp_path, TEXT))
    # on the training side's device it waits for the update's turn, as before
    beside_train = TEXT.replace("colocate_with: gen", "colocate_with: train")
    assert schedule.generating_nodes(load(tmp_path, beside_train)) == generated - {"ref_logprob"}
    # on a device of its own it runs ahead too
    alone = TEXT.replace('ref: {alloc: "megatron:d1", colocate_with: gen}', "ref: megatron:d1")
    assert schedule.generating_nodes(load(tmp_path, alone)) == generated
    # a node computing with the weights the update moves stays behind, and what reads it
    moving = TEXT.replace("mesh: ref, model: policy, params: {output: ref_logprobs}",
                          "mesh: train, model: policy, params: {output: ref_logprobs}")
    assert schedule.generating_nodes(load(tmp_path, moving)) == generated - {"ref_logprob"}
    reads_moving = moving.replace("deps: [reward]}", "deps: [reward, ref_logprob]}")
    assert schedule.generating_nodes(load(tmp_path, reads_moving)) == {"rollout", "reward"}
    # after a driver-side node that runs ahead, on the rollout's device: ahead as well
    after_reward = TEXT.replace("deps: [rollout], mesh: ref", "deps: [reward], mesh: ref")
    assert schedule.generating_nodes(load(tmp_path, after_reward)) == generated


def test_old_logprobs_update_consumes_none_and_needs_one_epoch_of_one_mini_batch(tmp_path):
    pipe = load(tmp_path, TEXT)
    assert "old_logprobs" not in pipe.consumes("actor_update") and "rollout_logprobs" in pipe.consumes("actor_update")
    (p,) = errors(tmp_path, TEXT, ["nodes.actor_update.params.mini_batch_size=4"])
    assert p.path == ("nodes", 4, "params", "old_logprobs")
    assert "takes 1 epoch(s) of mini batches of 4 of the step's 8 prompts" in p.message
    assert "expected epochs 1 and mini_batch_size 8, or old_logprobs: input" in p.message
    (p,) = errors(tmp_path, TEXT, ["nodes.actor_update.params.epochs=2"])
    assert p.path == ("nodes", 4, "params", "old_logprobs")
    (p,) = errors(tmp_path, TEXT, ["nodes.actor_update.params.old_logprobs=rollout"])
    assert "rollout_is would count it twice; expected rollout_is: off (rollout_rs still rejects), loss_type: reinforce" \
        in p.message
    pipe = load(tmp_path, TEXT, ["nodes.actor_update.params.old_logprobs=rollout", "nodes.actor_update.params.rollout_is=off"])
    assert "rollout_logprobs" in pipe.consumes("actor_update") and "old_logprobs" not in pipe.consumes("actor_update")
    assert pipe.nodes["actor_update"].params["rollout_is"] == "off"  # YAML's boolean off, read as the setting's word
    # input: the batch must hold them, and here no node makes them
    messages = "\n".join(map(str, errors(tmp_path, TEXT, ["nodes.actor_update.params.old_logprobs=input"])))
    assert "old_logprobs" in messages


class _Engine:
    """Log-probs of one learnable logit per token, in micro batches as the Megatron engine runs them."""

    opts = {"micro_batch_size": 4}
    dp_group = None

    def __init__(self, logits):
        self.w = logits.clone().requires_grad_()

    def train(self, batch, loss_fn, mini_batch_size, micro_batch_size, epochs, replay_routes, entropy_grad):
        self.batch, sums = batch, {}
        for s in range(0, batch["responses"].shape[0], micro_batch_size):
            mb = {k: v[s:s + micro_batch_size] for k, v in batch.items()}
            loss, metrics = loss_fn(torch.nn.functional.logsigmoid(self.w[s:s + micro_batch_size]), None, mb, None)
            loss.backward()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
        return sums


def _update(params, batch, logits):
    engine = _Engine(logits)
    ctx = SimpleNamespace(params=params, engine=engine, samples_per_prompt=4, metrics={})
    actor_update({k: v.clone() for k, v in batch.items()}, ctx)
    return engine.w.grad, ctx.metrics, engine.batch


def test_old_logprobs_from_the_update_equal_the_current_policys_as_input(tmp_path):
    params = dict(load(tmp_path, TEXT).nodes["actor_update"].params)
    torch.manual_seed(0)
    logits, rows, width = torch.randn(8, 5), 8, 5
    batch = {"responses": torch.zeros(rows, width, dtype=torch.long), "response_mask": (torch.rand(rows, width) > 0.2).float(),
             "advantages": torch.randn(rows, width), "ref_logprobs": -torch.rand(rows, width),
             "rollout_logprobs": torch.nn.functional.logsigmoid(logits) - 0.1 * torch.rand(rows, width)}
    given = dict(batch, old_logprobs=torch.nn.functional.logsigmoid(logits))
    grad_in, metrics_in, _ = _update({**params, "old_logprobs": "input"}, given, logits)
    grad_up, metrics_up, _ = _update(params, batch, logits)
    assert torch.allclose(grad_in, grad_up) and grad_up.abs().sum() > 0
    assert metrics_up.keys() == metrics_in.keys() and any(k.startswith("rollout_corr/") for k in metrics_up)
    for key, value in metrics_in.items():
        assert metrics_up[key] == pytest.approx(value, rel=1e-5, abs=1e-7), key


def test_timings_of_a_run_say_the_time_per_mesh_and_the_bottleneck(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pipe = load(tmp_path, TEXT)
    steps = {s: {"timing_s/step": 0.5, "timing_s/rollout": 0.15, "timing_s/ref_logprob": 0.08, "timing_s/reward": 0.01,
                 "timing_s/actor_update": 0.25 + s / 100, "timing_s/idle/gen": 0.2, "timing_s/idle/ref": 0.2,
                 "timing_s/idle/train": 0.1} for s in (1, 2, 3, 4)}
    assert timings.read(pipe.out_dir) is None
    timings.write(pipe.out_dir, pipe, {1: steps[1]})  # one step: warm-up only, nothing to say
    assert timings.read(pipe.out_dir) is None
    timings.write(pipe.out_dir, pipe, steps)
    record = timings.read(pipe.out_dir)
    assert record["steps"] == 3 and record["nodes"]["actor_update"] == pytest.approx(0.28)  # steps 2-4, the median
    said = "\n".join(timings.lines(pipe, record))
    assert "mesh gen + ref" in said and "0.230 s (rollout 0.150, ref_logprob 0.080); busy 0.300 s, idle 0.200 s" in said
    assert "bottleneck: mesh train (its nodes take 0.280 s of each step)" in said
    assert "driver side" in said
    (pipe.out_dir / timings.FILE).write_text(json.dumps([1, 2]))
    assert timings.read(pipe.out_dir) is None
