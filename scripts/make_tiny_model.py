"""Build a tiny random-init HF causal LM plus a character-level tokenizer, fully offline.

Tests and the demo need a real model that every engine (transformers, vLLM, megatron-core) loads the
same way, without downloads. The tokenizer is character-level (so arithmetic like `Q: 23+58=? A:` ->
` #### 81` is learnable by a 0.5M-param model), with `####` kept as one token. It is built as a
byte-level BPE whose only merges make `####`: transformers 5 rebuilds any tokenizer of a `qwen2` model
as a `Qwen2Tokenizer` (byte-level BPE from vocab + merges), so this is the form that loads identically
through AutoTokenizer, vLLM and PreTrainedTokenizerFast for every architecture.

    python scripts/make_tiny_model.py OUT_DIR [--arch qwen2|llama|qwen3|qwen3_moe] [--num-experts 4]
        [--vocab-size N] [--max-positions N] [--no-weights]

`--vocab-size` pads the model's vocabulary beyond the tokenizer's (as real checkpoints pad theirs: a
real model's embedding and sampling cost); `--no-weights` writes the config and tokenizer only, for
an engine that makes its own random weights (vLLM's `load_format: dummy`, a model too large to
initialize here).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from tokenizers.pre_tokenizers import ByteLevel  # noqa: E402
from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    LlamaConfig,
    Qwen2Config,
    Qwen2Tokenizer,
    Qwen3Config,
    Qwen3MoeConfig,
)

SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
# Role headers and the assistant cue are plain characters of the vocabulary.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CONFIGS = {"qwen2": Qwen2Config, "llama": LlamaConfig, "qwen3": Qwen3Config, "qwen3_moe": Qwen3MoeConfig}


def vocabulary() -> dict[str, int]:
    """Special tokens (ids 0..3), `####` and its half `##`, then all 256 byte symbols (no text is lost)."""
    tokens = list(SPECIAL_TOKENS.values()) + ["####", "##"] + sorted(ByteLevel.alphabet())
    return {tok: i for i, tok in enumerate(dict.fromkeys(tokens))}


def make_tokenizer() -> Qwen2Tokenizer:
    """One token per byte (= per character for ASCII); the merges `# #` and `## ##` make `####` one token."""
    return Qwen2Tokenizer(vocab=vocabulary(), merges=[("#", "#"), ("##", "##")],
                          chat_template=CHAT_TEMPLATE, padding_side="left", **SPECIAL_TOKENS)


def make_config(arch, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads,
                intermediate_size, tie_word_embeddings, num_experts, special_ids, max_positions=1024, init_std=0.02):
    if arch not in CONFIGS:
        raise ValueError(f"arch {arch!r} is not one of {sorted(CONFIGS)}")
    head_dim = hidden_size // num_heads
    if head_dim * num_heads != hidden_size or head_dim < 32:
        raise ValueError(f"hidden_size/num_heads = {hidden_size}/{num_heads} must be a whole head_dim >= 32 "
                         "(vLLM's CPU attention supports head sizes 32, 64, 80, ...)")
    if (arch == "qwen3_moe") != (num_experts > 0):
        raise ValueError(f"num_experts={num_experts}: MoE experts are for arch 'qwen3_moe' only, which needs >= 2")
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_layers,
        num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        intermediate_size=intermediate_size, tie_word_embeddings=tie_word_embeddings,
        max_position_embeddings=max_positions, initializer_range=init_std, dtype="float32", **special_ids,
    )
    if arch in ("qwen3", "qwen3_moe"):
        kwargs["head_dim"] = head_dim
    if arch == "qwen3_moe":
        kwargs.update(num_experts=num_experts, num_experts_per_tok=min(2, num_experts),
                      moe_intermediate_size=intermediate_size // 2, decoder_sparse_step=1, mlp_only_layers=[])
    return CONFIGS[arch](**kwargs)


def make_tiny_model(out_dir, arch="qwen2", hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                    intermediate_size=512, tie_word_embeddings=True, num_experts=0, seed=0, vocab_size=None,
                    max_positions=1024, weights=True, init_std=0.02) -> str:
    """Write a random-init model (safetensors, fp32; the config alone without `weights`) and its
    tokenizer to `out_dir`; return the path. `init_std`: the weights' normal init (transformers' default 0.02)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    special_ids = {
        "pad_token_id": tokenizer.pad_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
    }
    if vocab_size is not None and vocab_size < len(tokenizer):
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")
    config = make_config(arch, vocab_size or len(tokenizer), hidden_size, num_layers, num_heads, num_kv_heads,
                         intermediate_size, tie_word_embeddings, num_experts, special_ids, max_positions, init_std)
    tokenizer.save_pretrained(out)
    if not weights:  # the architecture save_pretrained would record, by which engines pick the model class
        config.architectures = [AutoModelForCausalLM._model_mapping[type(config)].__name__]
        config.save_pretrained(out)
        return str(out)
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir")
    p.add_argument("--arch", default="qwen2", choices=sorted(CONFIGS))
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=4)
    p.add_argument("--num-kv-heads", type=int, default=2)
    p.add_argument("--intermediate-size", type=int, default=512)
    p.add_argument("--untied", action="store_true", help="separate lm_head instead of tied embeddings")
    p.add_argument("--num-experts", type=int, default=None, help="default: 4 for qwen3_moe, else 0")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=None, help="default: the tokenizer's; more pads it")
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--no-weights", action="store_true", help="config and tokenizer only (vLLM load_format dummy)")
    a = p.parse_args()
    num_experts = a.num_experts if a.num_experts is not None else (4 if a.arch == "qwen3_moe" else 0)
    path = make_tiny_model(a.out_dir, a.arch, a.hidden_size, a.num_layers, a.num_heads, a.num_kv_heads,
                           a.intermediate_size, not a.untied, num_experts, a.seed, a.vocab_size, a.max_positions,
                           not a.no_weights)
    print(path)


if __name__ == "__main__":
    main()
