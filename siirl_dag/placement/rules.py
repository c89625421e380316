"""Checks of a mesh's strategy options against its allocation string and the device kind.

Each is a rule megatron-core (or vLLM) would enforce deep inside worker start-up, after devices
were reserved and processes spawned; here they fail at the door, all at once, with the YAML key.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Mapping, Sequence

from siirl_dag.errors import PathPart, Problem
from siirl_dag.placement.allocation import Component
from siirl_dag.placement.parallel_dims import ParallelDims
from siirl_dag.registry import STRATEGIES

_SPELLING = {"tp": "t", "pp": "p", "cp": "c", "ep": "e", "etp": "ffn t (expert tensor parallel)"}


def strategy_problems(
    c: Component,
    options: Mapping[str, Any],
    model_info: Mapping[str, Any] | None,
    device: str,
    path: Sequence[PathPart],
    options_path: Sequence[PathPart],
) -> list[Problem]:
    """Everything wrong with running component `c` with these options on `device` ("cuda"/"cpu")."""
    path, options_path = tuple(path), tuple(options_path)
    out: list[Problem] = []
    for key, attr in option_sizes(c.backend).items():
        value = options.get(key)
        if value is not None and value != getattr(c.dims, attr):
            hint = ("; etp is ffn's t in megatron:(attn:<dims>|ffn:<dims>), a plain string implies etp = t "
                    "without e and etp = 1 with e") if attr == "etp" else ""
            out.append(Problem(options_path + (key,), (
                f"{key}={value} contradicts the mesh allocation {c.text or c.backend!r}, which has "
                f"{_SPELLING[attr]}={getattr(c.dims, attr)}; set them equal or drop the option{hint}")))
    out += _head_rules(c, model_info or {}, path)
    if c.backend == "megatron":
        out += _megatron_rules(c.dims, options, model_info or {}, device, path, options_path)
    if c.backend == "vllm" and c.dims.pp > 1:
        out.append(Problem(path, f"p{c.dims.pp}: a vLLM rollout mesh has only d and t (the in-process engine cannot "
                                 "pipeline; use t for large models)"))
    return out


def _divisors(n: int) -> str:
    return ", ".join(f"t{d}" for d in range(1, n + 1) if n % d == 0)


def _head_rules(c: Component, model_info, path) -> list[Problem]:
    """Tensor parallel splits the attention heads and the KV heads (query groups) over its ranks.
    Megatron-core needs t to divide both; vLLM replicates KV heads when t is a multiple of them."""
    heads, kv, tp = model_info.get("num_heads"), model_info.get("num_kv_heads"), c.dims.tp
    if not heads or tp == 1:
        return []
    if heads % tp:
        return [Problem(path, f"t{tp} (tensor parallel) does not divide the model's {heads} attention heads; "
                              f"expected t dividing {heads} ({_divisors(heads)})")]
    if not kv or kv % tp == 0:
        return []
    if c.backend == "vllm" and tp % kv == 0:
        return []  # vLLM gives each rank a copy of a KV head
    fits = _divisors(kv) + (f", or a multiple of {kv} dividing {heads}" if c.backend == "vllm" else "")
    return [Problem(path, f"t{tp} (tensor parallel) does not divide the model's {kv} KV heads "
                          f"(num_key_value_heads); expected {fits}")]


def option_sizes(strategy: Any) -> dict[str, str]:
    """Option key -> the size of the allocation string it must agree with, for a strategy's name
    (`StrategySpec.parallel_options`; none for a name that is no strategy)."""
    spec = STRATEGIES.get(strategy) if isinstance(strategy, str) else None
    return spec.allocation_options() if spec else {}


def parallel_sizes(strategy: Any, options: Mapping[str, Any]) -> dict[str, int]:
    """The parallel sizes options in a strategy's keys set (as verl and ROLL write them too), by
    ParallelDims' names: 1 where absent or null; expert tensor parallel = tensor parallel unless
    written (megatron-core's default)."""
    written = {size: options.get(key) for key, size in option_sizes(strategy).items()}
    sizes = {"tp": 1, "pp": 1, "cp": 1, "ep": 1} | {size: value or 1 for size, value in written.items()}
    return sizes | {"etp": written.get("etp") or sizes["tp"]}


def _megatron_rules(c: ParallelDims, options, model_info, device, path, options_path) -> list[Problem]:
    out: list[Problem] = []

    def bad(where, message):
        out.append(Problem(where, message))

    vpp = options.get("virtual_pipeline_model_parallel_size") or 1
    try:
        replace(c, vpp=vpp)
    except ValueError as exc:
        bad(options_path + ("virtual_pipeline_model_parallel_size",), f"{exc}; use p>=2 or drop it")
    num_layers = model_info.get("num_layers")
    if num_layers and c.pp * vpp > num_layers:
        bad(path, f"p{c.pp} x vpp{vpp} = {c.pp * vpp} pipeline chunks for a model of {num_layers} layers: some would "
                  f"hold no layer; expected at most {num_layers} chunks, dividing the layer count")
    elif num_layers and num_layers % (c.pp * vpp):
        bad(path, f"{num_layers} layers do not split evenly over p{c.pp} x vpp{vpp} = {c.pp * vpp} "
                  "pipeline chunks; choose p (and vpp) dividing the layer count")
    sp = bool(options.get("sequence_parallel"))
    if sp and c.tp == 1:
        bad(options_path + ("sequence_parallel",),
            "sequence_parallel needs tensor parallel > 1, the mesh has t1; drop it or use t>=2")
    experts = model_info.get("num_experts", options.get("num_moe_experts"))
    if (c.ep > 1 or (experts or 0) > 1) and c.tp > 1 and not sp:
        bad(options_path + ("sequence_parallel",),
            f"an MoE model with tensor parallel t{c.tp} needs sequence_parallel: true (megatron-core refuses "
            "MoE training with TP and without sequence parallel)")
    if (experts or 0) > 1 and c.ep == 1 and c.etp != c.tp:
        bad(path, f"expert tensor parallel t{c.etp} differs from the attention's t{c.tp} without expert parallel: "
                  "megatron-core 0.16 trains such a mesh wrongly (its expert gradients differ from one rank's); "
                  "expected ffn t equal to attn t, or e>1")
    if c.ep > 1 and experts is not None:
        if experts <= 1:
            bad(path, f"e{c.ep} (expert parallel) needs an MoE model, this one has num_experts={experts}; expected e1 for a dense model")
        elif experts % c.ep:
            bad(path, f"{experts} experts do not split evenly over e{c.ep}; choose e dividing num_experts")
    if device == "cpu":
        if c.cp > 1:
            bad(path, f"context parallel (c{c.cp}) needs CUDA (TransformerEngine attention); use a cuda "
                      "cluster or set c1 in the allocation")
        if options.get("moe_grouped_gemm"):
            bad(options_path + ("moe_grouped_gemm",),
                "moe_grouped_gemm needs CUDA (grouped_gemm kernels); use a cuda cluster or set "
                "moe_grouped_gemm: false")
    return out
