"""LoRA through the real stack (Ray, Megatron ranks, vLLM): after a training step and a sync, vLLM's
log-probs equal Megatron's (1e-4) for dense adapters at TP1 and TP2, served as in-memory adapters
(only the adapters travel), and for an MoE model with expert adapters at EP2, merged into the weights
on CPU; a reference with the adapters off computes as the base, on the actor's own engine."""

from __future__ import annotations

import os

import pytest

from siirl_dag.config import load_pipeline
from siirl_dag.runtime import Runtime
from test_weight_sync import LOGPROB_INPUTS, TRAIN_STEP, assert_same_logprobs, moe_model_dir, prompts, ray_session  # noqa: F401

PIPELINE = """\
name: lora
cluster: {{nodes: 1, devices_per_node: {devices}, device: cpu}}
models: {{policy: {{path: {model}, dtype: float32, lora: {{rank: 8, alpha: 16, target_modules: {targets}}}}}}}
data: {{train_files: unused.parquet, train_batch_size: 4, max_prompt_length: 16, max_response_length: 8}}
meshes:
  train: "megatron:{train}"
  gen: "vllm:{gen}"
  colo: {{alloc: "vllm:d{world}", colocate_with: train}}
nodes:
  - {{id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: actor_update, options: {rollout}}}
  - {{id: reward, kind: reward, deps: [rollout]}}
  - {{id: advantage, kind: advantage, deps: [reward]}}
  - {{id: old_logprob, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {{output: old_logprobs}}}}
  - {{id: ref_logprob, kind: logprob, deps: [rollout], mesh: train, model: policy,
     params: {{output: ref_logprobs, adapters: "off"}}}}
  - {{id: actor_update, kind: actor_update, deps: [advantage, old_logprob, ref_logprob], mesh: train, model: policy,
     options: {{lr: 1.0e-1, micro_batch_size: 2{sp}}}, params: {{mini_batch_size: 4, entropy_coeff: 0.5}}}}
  - {{id: colo_rollout, kind: rollout, mesh: colo, model: policy, weights_from: actor_update, options: {rollout}}}
  - {{id: colo_logprob, kind: logprob, deps: [colo_rollout], mesh: train, model: policy, params: {{output: old_logprobs}}}}
runtime: {{backend: ray, cpus_per_rank: 0.25, verify_probe_every: 1}}
"""
ROLLOUT = "{n: 2, temperature: 1.0, dtype: float32, kv_cache_gb: 0.05, max_model_len: 32, enforce_eager: true}"
# trainer allocation, its world size, MoE model, the adapters' targets, the separate rollout's allocation
LAYOUTS = {
    "dense-tp1": ("d1", 1, False, "[all-linear]", "d1"),
    "dense-tp2": ("t2", 2, False, "[q_proj, k_proj, v_proj, o_proj, down_proj]", "t2"),
    "moe-ep2-merged": ("d2e2", 2, True, "[q_proj, k_proj, v_proj, experts]", "d1"),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trained_adapters_reach_the_rollouts(tmp_path, tiny_model_dir, moe_model_dir, layout):  # noqa: F811
    train, world, moe, targets, gen = LAYOUTS[layout]
    from siirl_dag.placement.allocation import parse_allocation

    f = tmp_path / "p.yaml"
    f.write_text(PIPELINE.format(devices=world + parse_allocation(f"vllm:{gen}")[0].dims.world_size, world=world,
                                 model=moe_model_dir if moe else tiny_model_dir, train=train, gen=gen, targets=targets,
                                 rollout=ROLLOUT, sp=", sequence_parallel: true" if "t2" in train else ""))
    pipe = load_pipeline(f, [])
    with Runtime(pipe, progress=lambda *_: None) as rt:
        payload = "model" if moe else "adapters"  # on CPU an MoE model's adapters travel merged
        assert rt.routes["rollout"].payload == rt.routes["colo_rollout"].payload == payload
        step = rt.collect(rt.run_step(prompts(0), step=0, nodes=TRAIN_STEP + ["ref_logprob"]),
                          LOGPROB_INPUTS + ["rollout_logprobs", "old_logprobs", "ref_logprobs"])
        assert_same_logprobs(step)
        # before any update the adapters add nothing (B = 0): the reference, adapters off, is the same model
        mask = step["response_mask"].bool()
        assert (step["ref_logprobs"] - step["old_logprobs"])[mask].abs().max() < 1e-5
        metrics = rt.sync_weights()
        assert metrics["sync/rollout/probe_diff"] < 1e-4 and metrics["sync/colo_rollout/probe_diff"] < 1e-4
        for node, logprob in (("rollout", "old_logprob"), ("colo_rollout", "colo_logprob")):
            batch = rt.collect(rt.run_step(prompts(4), step=1, nodes=[node, logprob]),
                               LOGPROB_INPUTS + ["rollout_logprobs", "old_logprobs"])
            assert_same_logprobs(batch)
        # the trained adapters moved the policy away from its base
        trained = rt.collect(rt.run_step(prompts(8), step=2, nodes=["rollout", "old_logprob", "ref_logprob"]),
                             ["old_logprobs", "ref_logprobs", "response_mask"])
        mask = trained["response_mask"].bool()
        assert (trained["old_logprobs"] - trained["ref_logprobs"])[mask].abs().max() > 1e-2
        if payload == "adapters":  # only the adapters travelled: a small part of the model's bytes
            model_bytes = os.path.getsize(os.path.join(pipe.models["policy"].path, "model.safetensors"))
            assert 0 < metrics["sync/rollout/bytes"] < model_bytes / 3, (metrics["sync/rollout/bytes"], model_bytes)
