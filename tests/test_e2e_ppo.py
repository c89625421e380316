"""PPO with a critic end to end: graphs/ppo_critic_cpu.yaml, shrunk by overrides, runs 2 steps through
Ray (real vLLM rollout, Megatron actor on 2 ranks, Megatron critic with a value head, GAE) as a real
`python -m siirl_dag.main` process."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from test_e2e import tensorboard_tags

ROOT = Path(__file__).resolve().parents[1]
CRITIC_METRICS = ["critic/vf_loss", "critic/vf_clipfrac", "critic/vpred_mean", "critic/grad_norm", "critic/lr",
                  "critic/values/mean", "critic/vf_explained_var", "critic/returns/mean", "timing_s/values",
                  "timing_s/critic_update"]


def with_value_head(model_dir: str, out: Path) -> Path:
    """The model with a random `score` head added, so the critic's values are not 0 from the start
    (the random policy earns no reward, so a zero head would never move)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model_dir, out)
    weights = load_file(out / "model.safetensors")
    hidden = weights["model.norm.weight"].shape[0]
    weights["score.weight"] = 0.1 * torch.randn(1, hidden, generator=torch.Generator().manual_seed(0))
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_ppo_critic_pipeline_through_ray(tmp_path, tiny_model_dir, demo_data):
    critic = with_value_head(tiny_model_dir, tmp_path / "critic_model")
    overrides = [f"models.policy.path={tiny_model_dir}", f"models.critic.path={critic}",
                 f"data.train_files={demo_data}/train.parquet", "data.val_files=null", "data.train_batch_size=8",
                 "trainer.total_steps=2", "trainer.logger=[tensorboard]", f"trainer.default_local_dir={tmp_path}/ckpt",
                 f"trainer.tensorboard_dir={tmp_path}/tb", f"trainer.log_dir={tmp_path}/logs",
                 "nodes.rollout.options.kv_cache_gb=0.25", "nodes.rollout.options.max_model_len=64"]
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", "graphs/ppo_critic_cpu.yaml", "--json", *overrides],
                         capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-4000:]
    history = json.loads(res.stdout)  # --json: the document alone

    assert set(history["steps"]) == {"1", "2"}
    assert set(CRITIC_METRICS) <= tensorboard_tags(tmp_path / "tb")
    for step in history["steps"].values():
        assert step["critic/values/mean"] != 0.0, "the values come from the checkpoint's head"
        assert step["critic/vf_loss"] > 0 and step["critic/grad_norm"] > 0 and step["critic/lr"] > 0
    state = json.loads((tmp_path / "ckpt" / "global_step_2" / "trainer_state.json").read_text())
    assert state["versions"] == {"actor_update": 2, "critic_update": 2}
    config = json.loads((tmp_path / "ckpt" / "global_step_2" / "critic_update.hf" / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForTokenClassification"], "the critic is exported as a value model"
