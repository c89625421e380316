"""scripts/make_tiny_model.py: a model of a real shape without its weights (vLLM's load_format dummy
makes its own), its vocabulary padded past the tokenizer's as real checkpoints pad theirs."""

import json

import pytest
from transformers import AutoConfig, AutoTokenizer

from make_tiny_model import make_tiny_model


def test_config_only_model_names_its_architecture_and_pads_the_vocabulary(tmp_path):
    path = make_tiny_model(tmp_path / "m", arch="qwen3", hidden_size=256, num_layers=3, num_heads=2, num_kv_heads=1,
                           intermediate_size=512, tie_word_embeddings=False, vocab_size=1000, max_positions=2048,
                           weights=False)
    files = sorted(p.name for p in (tmp_path / "m").iterdir())
    assert not any(f.endswith(".safetensors") for f in files) and "config.json" in files
    config = AutoConfig.from_pretrained(path)
    assert config.architectures == ["Qwen3ForCausalLM"]  # what vLLM picks the model class by
    assert (config.vocab_size, config.max_position_embeddings, config.head_dim) == (1000, 2048, 128)
    assert len(AutoTokenizer.from_pretrained(path)) < config.vocab_size
    assert json.loads((tmp_path / "m" / "config.json").read_text())["tie_word_embeddings"] is False


def test_a_vocabulary_smaller_than_the_tokenizer_is_refused(tmp_path):
    with pytest.raises(ValueError, match="smaller than the tokenizer"):
        make_tiny_model(tmp_path / "m", vocab_size=10, weights=False)
