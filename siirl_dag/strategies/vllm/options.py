"""Strategy options (siirl_dag/schemas/strategies/vllm.schema.json) and per-call sampling parameters."""

from __future__ import annotations

import functools
import json
import os
from typing import Any

from siirl_dag.config.schema import SCHEMA_DIR, StrictValidator
from siirl_dag.errors import ConfigError, Problem

SCHEMA_PATH = SCHEMA_DIR / "strategies" / "vllm.schema.json"
SAMPLING_OPTIONS = ("n", "temperature", "top_p", "top_k", "max_tokens", "stop", "stop_token_ids")
# Per-call keys: the options above, plus a seed and two shorthands for evaluation rollouts.
SAMPLING_KEYS = SAMPLING_OPTIONS + ("seed", "greedy", "validate")
# why `return_routed_experts` (a rollout's routed_experts: true) is refused without CUDA
ROUTES_NEED_GPU = "vLLM returns routed experts only from its Triton model runner, which needs a GPU"


@functools.cache
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def resolve_options(options: dict[str, Any]) -> dict[str, Any]:
    """Check `options` against the schema and fill its defaults.

    The config layer does the same at the door; repeating it here keeps a strategy built directly
    (tests, scripts) as strict as one built from a pipeline file.
    """
    errors = StrictValidator(schema()).iter_errors(options)
    problems = [Problem(("options", *e.absolute_path), e.message) for e in errors]
    if problems:
        raise ConfigError(problems)
    defaults = {k: p["default"] for k, p in schema()["properties"].items() if "default" in p}
    full = {**defaults, **options}
    limit = max_samples_per_prompt()
    if full["n"] > limit:  # vLLM's own check would fail the first rollout, after everything started
        raise ConfigError([Problem(("options", "n"), f"{full['n']} samples per prompt are above vLLM's limit; expected "
                                   f"at most {limit} (the environment variable VLLM_MAX_N_SEQUENCES raises it)")])
    return full


def max_samples_per_prompt() -> int:
    """vLLM's limit on n (SamplingParams), read as vLLM reads it, without importing vLLM."""
    try:
        return int(os.environ.get("VLLM_MAX_N_SEQUENCES", "16384"))
    except ValueError:
        return 16384


def dtype_options(dtype: str, written: dict[str, Any]) -> dict[str, Any]:
    """The engine computes in the model's dtype unless the node sets its own `dtype`."""
    return {} if "dtype" in written else {"dtype": dtype}


def sampling_kwargs(options: dict[str, Any], overrides: dict[str, Any], max_response_length: int) -> dict[str, Any]:
    """Keyword arguments of vLLM's SamplingParams: the options' sampling defaults, then the call's, and
    the sampled token's log-prob at each position (`sampled_logprobs` reads them).

    `greedy` means temperature 0 and one sample; `validate` means one sample at `val_temperature`.
    """
    unknown = sorted(set(overrides) - set(SAMPLING_KEYS))
    if unknown:
        raise ConfigError([Problem(("sampling", k), f"unknown sampling key; expected one of {list(SAMPLING_KEYS)}")
                           for k in unknown])
    kw = {k: overrides.get(k, options[k]) for k in SAMPLING_OPTIONS}
    if overrides.get("validate"):
        kw.update(n=1, temperature=options["val_temperature"])
    if overrides.get("greedy"):
        kw.update(n=1, temperature=0.0)
    kw["max_tokens"] = kw["max_tokens"] or max_response_length
    if "max_tokens" not in overrides:  # the option: above the padded length, responses stop there (validate warns)
        kw["max_tokens"] = min(kw["max_tokens"], max_response_length)
    if kw["max_tokens"] > max_response_length:
        raise ConfigError([Problem(("sampling", "max_tokens"),
                                   f"max_tokens={kw['max_tokens']} exceeds max_response_length={max_response_length}; "
                                   "responses are padded to max_response_length, so max_tokens must not exceed it")])
    kw["stop"], kw["stop_token_ids"] = list(kw["stop"]), list(kw["stop_token_ids"])
    kw["seed"] = overrides.get("seed")
    # flat: a few lists per request instead of a dict and a Logprob object per token (1.7% of the demo's rollout)
    kw.update(logprobs=0, flat_logprobs=True)
    return kw


def sampled_logprobs(completion: Any) -> list[float]:
    """The log-prob of each token a completion sampled: vLLM's flat log-probs (`sampling_kwargs`) hold
    one entry per position, the sampled token's, since they ask for no alternatives."""
    flat = completion.logprobs
    return [flat.logprobs[start] for start in flat.start_indices]
