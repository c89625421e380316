"""`models.<name>.lora` at the door: each way a LoRA block can fail to fit its model, its meshes or its
nodes gets one message at the YAML line of the key, and nothing starts."""

from __future__ import annotations

import json
import subprocess
import sys

from pathlib import Path

import pytest

from siirl_dag.config import load_pipeline
from siirl_dag.errors import ConfigError
from test_config import BASE as CONFIG_BASE

DENSE = {"model_type": "qwen2", "num_hidden_layers": 2}
MOE = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "num_experts": 4}

# test_config's pipeline with a LoRA model, and slots for what each case changes
BASE = (CONFIG_BASE.replace("device: cpu", "device: DEVICE")
        .replace("policy: {path: no/such/model, dtype: float32}",
                 "policy:\n    path: MODEL\n    dtype: float32\n    lora: {rank: 8, target_modules: TARGETS}")
        .replace("train: megatron:d2", "train: TRAIN_MESH").replace("options: {n: 4}}", "options: ROLLOUT_OPTIONS}")
        .replace("    params: {mini_batch_size: 4}", "    options: TRAIN_OPTIONS\n    params: {mini_batch_size: 4}"))


def bf16(text: str) -> str:
    """The pipeline with its model in bfloat16, as a GPU's rollout of adapters takes it."""
    return text.replace("dtype: float32", "dtype: bfloat16", 1)


def pipeline(tmp_path, hf_config=DENSE, targets="[q_proj, k_proj, v_proj]", device="cpu",
             train_mesh="megatron:d2", train_options="{}", rollout_options="{n: 4}", edit=lambda t: t):
    model = tmp_path / "model"
    if hf_config is not None:
        model.mkdir(exist_ok=True)
        (model / "config.json").write_text(json.dumps(hf_config))
    text = (BASE.replace("DEVICE", device).replace("MODEL", str(model)).replace("TARGETS", targets)
            .replace("TRAIN_MESH", train_mesh).replace("TRAIN_OPTIONS", train_options)
            .replace("ROLLOUT_OPTIONS", rollout_options))
    f = tmp_path / "p.yaml"
    f.write_text(edit(text))
    return f


def refused(tmp_path, **kwargs):
    """The one error a broken pipeline gets, and the line its key sits on."""
    f = pipeline(tmp_path, **kwargs)
    with pytest.raises(ConfigError) as info:
        load_pipeline(f)
    errors = [p for p in info.value.problems if p.severity == "error"]
    assert len(errors) == 1, [str(e) for e in errors]
    (p,) = errors
    assert p.file == str(f)
    return p, f.read_text().splitlines()[p.line - 1]


def test_targets_resolve_to_what_the_model_has(tmp_path):
    spec = load_pipeline(pipeline(tmp_path, MOE, "[all-linear]")).models["policy"].lora
    assert spec.moe and spec.on_experts
    # Qwen3-MoE has no dense MLP: all-linear is the attention and the experts' projections
    assert spec.targets == {"q_proj", "k_proj", "v_proj", "o_proj",
                            "experts.gate_proj", "experts.up_proj", "experts.down_proj"}
    spec = load_pipeline(pipeline(tmp_path, DENSE, "[gate_proj, up_proj]")).models["policy"].lora
    assert spec.targets == {"gate_proj", "up_proj"} and not spec.moe and spec.scale == 1.0


def test_a_model_not_on_disk_yet_trusts_the_names(tmp_path):
    spec = load_pipeline(pipeline(tmp_path, None, "[q_proj, k_proj, v_proj, experts]")).models["policy"].lora
    assert spec.on_experts and "q_proj" in spec.targets


def test_a_rank_vllm_cannot_serve(tmp_path):
    p, line = refused(tmp_path, edit=lambda t: t.replace("rank: 8", "rank: 7"))
    assert p.path == ("models", "policy", "lora", "rank") and "rank: 7" in line
    assert "7 is a rank vLLM cannot serve; expected one of [1, 8, 16" in p.message


def test_a_projection_the_model_lacks(tmp_path):
    p, line = refused(tmp_path, targets="[q_proj, k_proj, v_proj, experts]")
    assert p.path == ("models", "policy", "lora", "target_modules") and "target_modules" in line
    assert "'experts': the model has no such projection; expected some of" in p.message


def test_part_of_a_fused_layer(tmp_path):
    p, _ = refused(tmp_path, targets="[q_proj, v_proj]")
    assert "q_proj, v_proj without k_proj: megatron computes q_proj/k_proj/v_proj as one fused layer" in p.message
    p, _ = refused(tmp_path, hf_config=MOE, targets="[q_proj, k_proj, v_proj, gate_proj]")
    assert "gate_proj without up_proj" in p.message  # the experts' gate/up are fused too


def test_adapters_off_on_a_model_without_adapters(tmp_path):
    def edit(text):
        text = text.replace("    lora: {rank: 8, target_modules: [q_proj, k_proj, v_proj]}\n", "")
        return text.replace("params: {output: old_logprobs}", "params: {output: old_logprobs, adapters: off}")
    p, line = refused(tmp_path, edit=edit)
    assert p.path == ("nodes", 3, "params", "adapters") and "adapters: off" in line
    assert "model 'policy' has no LoRA adapters to switch off" in p.message


def test_context_parallel_is_refused_once_for_its_mesh(tmp_path):
    p, line = refused(tmp_path, device="cuda", train_mesh="megatron:d1c2", edit=bf16)
    assert p.path == ("meshes", "train") and line.strip().startswith("train:")
    assert "LoRA with context parallel (c2) is not supported" in p.message


def test_grouped_gemm_experts_take_no_adapters(tmp_path):
    p, _ = refused(tmp_path, hf_config=MOE, targets="[experts]", device="cuda", train_mesh="megatron:d2e2", edit=bf16,
                   train_options="{moe_grouped_gemm: true}")
    assert p.path == ("nodes", 3, "options", "moe_grouped_gemm")
    assert "expected moe_grouped_gemm: false" in p.message


def test_expert_tensor_parallel_takes_adapters(tmp_path):
    pipe = load_pipeline(pipeline(tmp_path, MOE, "[experts]", train_mesh="megatron:t2",
                                  train_options="{sequence_parallel: true}",
                                  edit=lambda t: t.replace("{output: old_logprobs}",
                                                           "{output: old_logprobs}, options: {sequence_parallel: true}")))
    assert pipe.plan.meshes["train"].dims.etp == 2


def test_a_critic_takes_adapters():
    """Its head trains beside them (tests/test_megatron_critic.py); nothing to refuse at the door."""
    ppo = Path(__file__).resolve().parents[1] / "graphs" / "ppo_critic_cpu.yaml"
    pipe = load_pipeline(ppo, ["models.critic.lora={rank: 8, alpha: 16, target_modules: [all-linear]}"])
    assert pipe.models["critic"].lora.rank == 8 and pipe.models["policy"].lora is None


def test_a_dummy_base_cannot_take_adapters(tmp_path):
    p, line = refused(tmp_path, rollout_options="{n: 4, load_format: dummy}")
    assert p.path == ("nodes", 0, "options", "load_format") and "load_format: dummy" in line
    assert "expected load_format auto" in p.message


def test_a_rollout_applying_adapters_on_cuda_computes_in_16_bits(tmp_path):
    """vLLM's CUDA LoRA kernels take bfloat16 or float16 weights: float32 would fail its first rollout."""
    p, line = refused(tmp_path, device="cuda", train_mesh="megatron:d1")
    assert p.path == ("models", "policy", "dtype") and line.strip() == "dtype: float32"
    assert "expected dtype bfloat16" in p.message
    p, line = refused(tmp_path, device="cuda", train_mesh="megatron:d1", rollout_options="{n: 4, dtype: float32}",
                      edit=bf16)
    assert p.path == ("nodes", 0, "options", "dtype") and "dtype: float32" in line


def test_cli_names_file_line_and_key_and_exits_2(tmp_path):
    f = pipeline(tmp_path, edit=lambda t: t.replace("rank: 8", "rank: 7"))
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", "validate", str(f)], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{f}:7:" in res.stderr and "models.policy.lora.rank: 7 is a rank vLLM cannot serve" in res.stderr
