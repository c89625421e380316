"""LoRA through the real stack (Ray, Megatron ranks, vLLM): after a training step and a sync, vLLM's
log-probs equal Megatron's (1e-4) for dense adapters at TP1 and TP2, served as in-memory adapters
(only the adapters travel), and for an MoE model with expert adapters at EP2, merged into the weights
on CPU; a reference with the adapters off computes as the base, on the actor's own engine."""

from __future__ import annotations

import os

import pytest
import torch

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
     params: {{output: ref_logprobs, adapters: off}}}}
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


# --- a whole run: adapter checkpoints resume exactly; the PEFT folder loads in peft and in vLLM -------

def _lora_run(out, model, data, *overrides):
    import json
    import subprocess
    import sys
    from pathlib import Path

    args = [f"models.policy.path={model}", f"data.train_files={data}/train.parquet", "data.val_files=null",
            "data.train_batch_size=8", "nodes.actor_update.params.mini_batch_size=8", "trainer.total_steps=4",
            "nodes.actor_update.params.entropy_coeff=0.5",  # a gradient though the random model earns no reward
            "trainer.save_freq=2", "trainer.logger=[tensorboard]",
            f"trainer.default_local_dir={out}/ckpt", f"trainer.tensorboard_dir={out}/tb", f"trainer.log_dir={out}/logs",
            "runtime.backend=local", "nodes.rollout.options.kv_cache_gb=0.25", "nodes.rollout.options.max_model_len=64",
            *overrides]
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", "graphs/tiny_grpo_lora_cpu.yaml", "--json", *args],
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout)


def _vllm_with_peft(rank, world, base, peft_folder, merged_folder):
    """vLLM on the base with the PEFT folder as its adapter, and on the merged HF export: both greedy."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    from siirl_dag.strategies.vllm import cpu_compat

    params = SamplingParams(temperature=0, max_tokens=6, logprobs=0)
    prompts = [{"prompt_token_ids": [5 + i, 6, 7, 8]} for i in range(4)]
    out = []
    for path, lora in ((base, LoRARequest("run", 1, peft_folder)), (merged_folder, None)):
        with cpu_compat.building([0], []):
            llm = LLM(model=path, dtype="float32", kv_cache_memory_bytes=2**27, max_model_len=64, enforce_eager=True,
                      enable_lora=lora is not None, max_lora_rank=8, max_loras=1)
        outs = llm.generate(prompts, params, lora_request=lora, use_tqdm=False)
        out.append([[lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs])
        llm.llm_engine.engine_core.shutdown()
    return out


def test_adapter_checkpoints_resume_exactly_and_export_as_peft_folders(tmp_path, tiny_model_dir):
    import shutil

    from safetensors.torch import load_file

    from dist_utils import run_ranks
    from make_demo_task import write_task

    write_task(tmp_path / "data", seed=0)
    straight = _lora_run(tmp_path / "a", tiny_model_dir, tmp_path / "data")
    step2 = tmp_path / "a" / "ckpt" / "global_step_2"
    assert sorted(p.name for p in step2.iterdir()) == ["actor_update", "actor_update.lora", "trainer_state.json"]
    engine_bytes = sum(f.stat().st_size for f in (step2 / "actor_update").glob("*.distcp"))
    assert engine_bytes < os.path.getsize(os.path.join(tiny_model_dir, "model.safetensors")), "adapters and their optimizer only"

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(tmp_path / "b" / "ckpt" / "global_step_4")
    resumed = _lora_run(tmp_path / "b", tiny_model_dir, tmp_path / "data")
    assert set(resumed["steps"]) == {"3", "4"}
    for step in ("3", "4"):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm"):
            assert resumed["steps"][step][key] == pytest.approx(straight["steps"][step][key], abs=1e-6), (step, key)

    last = tmp_path / "a" / "ckpt" / "global_step_4"
    peft_folder, merged = last / "actor_update.lora", last / "actor_update.hf"
    adapters = load_file(peft_folder / "adapter_model.safetensors")
    assert all(k.startswith("base_model.model.model.layers.") for k in adapters) and len(adapters) == 2 * 7 * 2
    # peft applies the folder to the base as the run merged it
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32),
                                               str(peft_folder)).eval()
        merged_model = AutoModelForCausalLM.from_pretrained(str(merged), dtype=torch.float32).eval()
        base_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
        torch.testing.assert_close(peft_model(ids).logits, merged_model(ids).logits, atol=1e-5, rtol=0)
        assert (merged_model(ids).logits - base_model(ids).logits).abs().max() > 1e-3
    # and vLLM serves the folder as the run's merged weights
    [(with_adapter, with_merged)] = run_ranks(_vllm_with_peft, 1, tiny_model_dir, str(peft_folder), str(merged), timeout=300)
    torch.testing.assert_close(torch.tensor(with_adapter), torch.tensor(with_merged), atol=1e-4, rtol=0)


def test_the_moe_lora_pipeline_runs_end_to_end(tmp_path, moe_model_dir):  # noqa: F811
    """graphs/tiny_grpo_moe_lora_cpu.yaml: expert adapters on two expert-parallel ranks, merged into the
    rollout's weights on CPU, verified at every sync; the update replays the routes the old log-probs recorded."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    from make_demo_task import write_task

    write_task(tmp_path / "data", seed=0)
    args = [f"models.policy.path={moe_model_dir}", f"data.train_files={tmp_path}/data/train.parquet",
            f"data.val_files={tmp_path}/data/test.parquet", "trainer.total_steps=2", "trainer.test_freq=-1",
            "trainer.save_freq=2", "trainer.export_hf=false", "trainer.logger=[]", "runtime.verify_probe_every=1",
            f"trainer.default_local_dir={tmp_path}/ckpt", f"trainer.log_dir={tmp_path}/logs",
            f"trainer.tensorboard_dir={tmp_path}/tb", "nodes.rollout.options.max_model_len=64"]
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", "graphs/tiny_grpo_moe_lora_cpu.yaml", "--json", *args],
                         capture_output=True, text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr[-4000:]
    steps = json.loads(res.stdout)["steps"]
    assert set(steps) == {"1", "2"} and all(s["sync/probe_diff"] < 1e-4 for s in steps.values())
    adapters = tmp_path / "ckpt" / "global_step_2" / "actor_update.lora" / "adapter_model.safetensors"
    from safetensors.torch import load_file

    assert any(".mlp.experts.3.down_proj.lora_B" in name for name in load_file(adapters)), "every expert's adapters"
