"""DAPO and GSPO as YAML, end to end through the real stack (vLLM rollout, Megatron actor, local
runtime): dynamic sampling re-runs rollout -> reward -> filter until the step is full, and says so in
one line when it cannot, under the sync schedule and under one_step_off (the shipped graph, on Ray);
GSPO with rollout importance weights and a straight-through KL trains; the rollout correction (IcePop,
batch-normalized, chained rejections) runs in the real update."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path


from test_e2e import PIPELINE, QUICK, SEPARATE, parsed

DAPO = PIPELINE.replace(
    "  - {{id: reward, kind: reward, deps: [rollout]}}\n  - {{id: advantage, kind: advantage, deps: [reward]}}\n",
    "  - {{id: reward, kind: reward, deps: [rollout], params: {{overlong_buffer_len: 2}}}}\n"
    "  - {{id: filter, kind: filter_groups, deps: [reward], params: {{metric: METRIC, max_gen_batches: 16}}}}\n"
    "  - {{id: advantage, kind: advantage, deps: [filter]}}\n",
).replace("use_kl_loss: true, entropy_coeff: 0.001", "use_kl_loss: true, clip_ratio_high: 0.28")
GSPO = PIPELINE.replace(
    "use_kl_loss: true, entropy_coeff: 0.001",
    "use_kl_loss: true, kl_loss_type: k3+, policy_loss: gspo, clip_ratio_low: 3.0e-4, clip_ratio_high: 4.0e-4, "
    "loss_agg_mode: seq-mean-token-mean, rollout_is: token")

CORRECTED = PIPELINE.replace(  # IcePop weights, batch-normalized, and two chained rejections, before the update
    "use_kl_loss: true, entropy_coeff: 0.001",
    "use_kl_loss: true, rollout_is: token, rollout_is_threshold: \"0.5_5.0\", rollout_is_batch_normalize: true, "
    "rollout_rs: \"token_k1,seq_mean_k3\", rollout_rs_threshold: \"0.5_2.0,0.05\"")


def launch(tmp_path, text, model, data, metric="token_level_rewards") -> subprocess.CompletedProcess:
    f = tmp_path / "pipeline.yaml"
    f.write_text(text.replace("METRIC", metric).format(devices=2, model=model, data=data, meshes=SEPARATE,
                                                          out=tmp_path, backend="local"))
    assert any(word in f.read_text() for word in ("filter_groups", "gspo", "rollout_rs"))
    return subprocess.run([sys.executable, "-m", "siirl_dag.main", str(f), "--json", *QUICK], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])


def test_dapo_fills_each_step_with_prompts_whose_samples_differ(tmp_path, tiny_model_dir, demo_data):
    # the tiny random model never answers right: its rewards differ by the overlong penalty alone, in the
    # groups where a sample drew EOS (~3% of samples): about one in a round of 8 prompts x 4 samples
    history = parsed(launch(tmp_path, DAPO, tiny_model_dir, demo_data))
    for step in ("1", "2"):
        m = history["steps"][step]
        assert 1 <= m["dynamic_sampling/rounds"] <= 16
        assert m["dynamic_sampling/kept_groups"] >= 8  # train_batch_size prompts at least
        assert 0 < m["dynamic_sampling/kept_ratio"] <= 1
        assert "reward/overlong_penalty" in m and m["actor/grad_norm"] > 0
        # each kept group's rewards differ, so its advantages do
        assert m["critic/advantages/max"] > 0 > m["critic/advantages/min"]


def test_dapo_that_cannot_fill_a_step_stops_in_one_line(tmp_path, tiny_model_dir, demo_data):
    # the prompt mask never differs between a prompt's samples: no group is ever kept
    res = launch(tmp_path, DAPO, tiny_model_dir, demo_data, metric="prompt_mask")
    assert res.returncode != 0 and "Traceback" not in res.stderr
    assert "dynamic sampling kept 0 of the 8 prompts a step needs after 16 generation rounds" in res.stderr
    assert "raise max_gen_batches" in res.stderr


def test_gspo_with_rollout_importance_weights_trains(tmp_path, tiny_model_dir, demo_data):
    history = parsed(launch(tmp_path, GSPO, tiny_model_dir, demo_data))
    m = history["steps"]["2"]
    assert m["actor/grad_norm"] > 0 and "actor/kl_loss" in m
    assert 0 < m["rollout_corr/rollout_is_mean"] <= 2.0 and m["rollout_corr/rollout_is_max"] <= 2.0
    assert math.isfinite(m["rollout_corr/kl"]) and m["rollout_corr/training_ppl"] > 1


def test_rollout_correction_before_the_update_trains_and_says_what_it_masked(tmp_path, tiny_model_dir, demo_data):
    history = parsed(launch(tmp_path, CORRECTED, tiny_model_dir, demo_data))
    for step in ("1", "2"):
        m = history["steps"][step]
        assert m["actor/grad_norm"] > 0 and math.isfinite(m["actor/pg_loss"])
        assert 0 <= m["rollout_corr/rollout_rs_masked_fraction"] <= 1
        assert m["rollout_corr/rollout_rs_token_k1_masked_fraction"] <= m["rollout_corr/rollout_rs_masked_fraction"]
        assert 0 <= m["rollout_corr/rollout_is_oob_ratio"] <= 1 and m["rollout_corr/rollout_is_batch_norm_factor"] > 0


def test_shipped_dapo_runs_one_step_off_through_ray(tmp_path, tiny_model_dir, demo_data):
    """graphs/tiny_dapo_cpu.yaml under runtime.schedule=one_step_off: the rounds of rollout -> reward ->
    filter of the next step run beside this step's update; the batch generated ahead at the checkpoint
    (the kept rows) is saved with it."""
    overrides = [f"models.policy.path={tiny_model_dir}", f"data.train_files={demo_data}/train.parquet",
                 f"data.val_files={demo_data}/test.parquet", "data.train_batch_size=8", "trainer.total_steps=3",
                 "trainer.save_freq=2", "trainer.logger=[tensorboard]", f"trainer.default_local_dir={tmp_path}/ckpt",
                 f"trainer.tensorboard_dir={tmp_path}/tb", f"trainer.log_dir={tmp_path}/logs",
                 "nodes.actor_update.params.mini_batch_size=8", "runtime.schedule=one_step_off", *QUICK,
                 # the tiny random model never answers right: its rewards differ by the overlong penalty alone
                 "nodes.filter.params.metric=token_level_rewards", "nodes.filter.params.max_gen_batches=16"]
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", "graphs/tiny_dapo_cpu.yaml", "--json", *overrides],
                         capture_output=True, text=True, timeout=900, cwd=Path(__file__).resolve().parents[1])
    steps = parsed(res)["steps"]
    # batches 2 and 3 are generated beside the update before them: samples one version old, unless every
    # row a step kept came from rounds after the sync that dynamic sampling lets in between two rounds
    staleness = [steps[s]["async/staleness/max"] for s in ("1", "2", "3")]
    assert staleness[0] == 0 and max(staleness[1:]) == 1 and all(v <= 1 for v in staleness)
    for m in steps.values():
        assert 1 <= m["dynamic_sampling/rounds"] <= 16 and m["dynamic_sampling/kept_groups"] >= 8
        assert m["actor/grad_norm"] > 0 and m["critic/advantages/max"] > 0 > m["critic/advantages/min"]
    state = json.loads((tmp_path / "ckpt" / "global_step_2" / "trainer_state.json").read_text())
    assert state["in_flight"] == [3]
