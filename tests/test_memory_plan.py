"""The memory plan at the door: parameter counts equal the HF models', a layout that cannot fit is
refused at its mesh's line with the numbers, the largest term and an option change checked to fit;
colocated meshes add up; `plan` and `validate` show it. (Measured against real ranks in
test_memory_measured.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from siirl_dag.config import load_pipeline
from siirl_dag.models.shape import ModelShape
from siirl_dag.errors import ConfigError
from siirl_dag.main import main

ROOT = Path(__file__).resolve().parents[1]
QWEN3_8B = ROOT / "graphs" / "qwen3_8b_grpo_megatron.yaml"
# Qwen3-8B's published config.json, the sizes the plan reads
QWEN3_8B_CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_size": 4096,
                   "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                   "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936, "tie_word_embeddings": False,
                   "max_position_embeddings": 40960}
OFFLOADS_OFF = [f"nodes.actor_update.options.{k}=false" for k in ("param_offload", "grad_offload", "optimizer_offload")]


@pytest.fixture(scope="module")
def qwen3_8b(tmp_path_factory) -> list[str]:
    """Overrides that point the shipped 8B pipeline at a folder with the model's config.json."""
    folder = tmp_path_factory.mktemp("qwen3_8b")
    (folder / "config.json").write_text(json.dumps(QWEN3_8B_CONFIG))
    return [f"models.qwen3_8b.path={folder}"]


@pytest.mark.parametrize("arch, extra", [("qwen2", {}), ("qwen2", {"tie_word_embeddings": False}), ("qwen3", {}),
                                         ("llama", {"attention_bias": True}), ("qwen3_moe", {})])
def test_parameter_count_is_the_hf_models(arch, extra):
    import transformers

    from dist_utils import TINY

    config_cls, model_cls = {"qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
                             "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
                             "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                             "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM)}[arch]
    moe = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64} if arch == "qwen3_moe" else {}
    config = config_cls(**{**TINY, **moe, **extra})
    model = model_cls(config)
    expected = sum(p.numel() for p in model.parameters())
    assert ModelShape.from_hf(config.to_dict()).total_params == expected


def test_qwen3_8b_has_its_published_size():
    assert ModelShape.from_hf(QWEN3_8B_CONFIG).total_params == 8_190_735_360  # "8.2B"


def test_a_model_not_on_disk_has_no_estimate_and_is_not_refused():
    pipe = load_pipeline(QWEN3_8B)  # models/Qwen3-8B is not there: only override_config's layer count
    assert pipe.memory.meshes == {} and pipe.memory.missing == ["actor", "gen", "ref"]


def test_the_8b_layout_fits_an_h100(qwen3_8b):
    pipe = load_pipeline(QWEN3_8B, qwen3_8b)
    assert pipe.cluster.memory_gb == 80.0
    actor, gen = pipe.memory.meshes["actor"], pipe.memory.meshes["gen"]
    assert gen.peak == pytest.approx(0.45 * 80)  # vLLM takes its share, the KV cache what the rest leaves
    assert gen.terms["kv_cache"] > 20 and gen.resident == ("runtime",)  # colocated: asleep while the actor works
    assert actor.held == 0.0  # every offload on: nothing stays while vLLM generates
    # bf16 weights of the fullest stage (9 layers and the embedding, over t2): about 1.18e9 parameters
    assert actor.terms["weights"] == pytest.approx(1.18e9 * 2 / 2**30, rel=0.02)
    assert actor.terms["optimizer"] == pytest.approx(6 * actor.terms["weights"], rel=1e-6)  # 12 bytes: fp32 master + Adam
    fullest, mesh = max(pipe.memory.device_peaks.values())
    assert mesh == "actor" and fullest == pytest.approx(actor.peak + gen.held)


def test_the_8b_agent_layout_fits_an_h100(qwen3_8b):
    """graphs/qwen3_8b_agent.yaml: the engines on half the machine, the trainer and its reference on the other."""
    agent = ROOT / "graphs" / "qwen3_8b_agent.yaml"
    pipe = load_pipeline(agent, [qwen3_8b[0].replace("models.qwen3_8b.", "models.policy.")])
    fullest, mesh = max(pipe.memory.device_peaks.values())
    assert mesh == "gen" and fullest == pytest.approx(0.85 * 80) and pipe.memory.meshes["gen"].terms["kv_cache"] > 50
    assert pipe.memory.meshes["train"].held + pipe.memory.meshes["ref"].peak < 80


def refused(overrides) -> str:
    with pytest.raises(ConfigError) as exc:
        load_pipeline(QWEN3_8B, overrides)
    return "\n".join(str(p) for p in exc.value.problems if p.severity == "error")


def test_a_layout_that_cannot_fit_is_refused_with_a_fix_that_fits(qwen3_8b):
    message = refused([*qwen3_8b, "cluster.device_memory_gb=40"])
    line = next(i for i, text in enumerate(QWEN3_8B.read_text().splitlines(), 1) if text.startswith("  actor:"))
    assert message.startswith(f"{QWEN3_8B}:{line}:3: meshes.actor: needs 40.08 GiB on device 0, which holds 40.00 GiB")
    assert "the largest term is logits" in message and "logits 13.91 GiB" in message
    assert "with micro_batch_size: 4 in the options of mesh 'actor' it would need 30.75 GiB" in message
    fixed = [*qwen3_8b, "cluster.device_memory_gb=40"] + [f"nodes.{n}.options.micro_batch_size=4"
                                                           for n in ("old_logprob", "actor_update")]
    assert load_pipeline(QWEN3_8B, fixed).memory.device_peaks[0][0] == pytest.approx(30.75, abs=0.01)


def test_colocated_meshes_add_up(qwen3_8b):
    """Without offload the actor keeps its state while vLLM generates: share and state together overflow."""
    base = [*qwen3_8b, *OFFLOADS_OFF, "nodes.rollout.options.gpu_memory_utilization=0.9"]
    message = refused(base)
    assert "meshes.gen: needs 91.7" in message and "mesh 'actor' beside it holds 19.7" in message
    assert "with gpu_memory_utilization: 0.75 in the options of mesh 'gen' it would need 79.77 GiB" in message
    pipe = load_pipeline(QWEN3_8B, [*qwen3_8b, *OFFLOADS_OFF, "nodes.rollout.options.gpu_memory_utilization=0.75"])
    assert max(pipe.memory.device_peaks.values())[0] <= 80


def test_a_vllm_share_without_room_for_one_sequence_is_refused_at_the_option(qwen3_8b):
    message = refused([*qwen3_8b, "nodes.rollout.options.gpu_memory_utilization=0.1"])
    assert "nodes[0].options.gpu_memory_utilization: 0.1 of 80.0 GiB leaves 0.00 GiB for the KV cache" in message
    assert "meshes.gen" not in message  # one message for one cause


def test_device_memory_gb_is_checked_at_the_door(capsys):
    assert main(["validate", str(ROOT / "graphs" / "tiny_grpo_cpu.yaml"), "cluster.device_memory_gb=-1"]) == 2
    assert "cluster.device_memory_gb" in capsys.readouterr().err


def test_plan_and_validate_show_it(capsys, tiny_model_dir):
    tiny, model = str(ROOT / "graphs" / "tiny_grpo_cpu.yaml"), f"models.policy.path={tiny_model_dir}"
    assert main(["plan", tiny, model, "--json"]) == 0
    memory = json.loads(capsys.readouterr().out)["memory"]
    assert set(memory["meshes"]) == {"gen", "train", "ref"}
    train = memory["meshes"]["train"]["terms_gb"]
    assert set(train) == {"weights", "gradients", "optimizer", "activations", "logits"}
    assert train["optimizer"] == pytest.approx(2 * train["weights"], rel=0.01)  # fp32 Adam: two moments, no master
    assert main(["plan", tiny, model]) == 0 and "memory per device (estimate" in capsys.readouterr().out
    assert main(["validate", tiny, model]) == 0 and "fullest device: " in capsys.readouterr().out
