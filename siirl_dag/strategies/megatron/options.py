"""The strategy's options: schema defaults, validation, and what this device cannot do.

The JSON Schema under siirl_dag/schemas/strategies/ is the single source of defaults; the config layer
validates pipelines with it, and the engine applies it again so it can be built directly.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from siirl_dag.config.schema import SCHEMA_DIR
from siirl_dag.errors import ConfigError, Problem

SCHEMA_PATH = SCHEMA_DIR / "strategies" / "megatron.schema.json"


@functools.lru_cache(maxsize=1)
def schema() -> dict[str, Any]:
    return json.loads(SCHEMA_PATH.read_text())


def dtype_options(dtype: str, written: dict[str, Any]) -> dict[str, Any]:
    """bf16 training for a bfloat16 model, fp32 for a float32 one, unless the node sets `bf16`."""
    if "bf16" in written:
        return {}
    if dtype == "float16":
        raise ValueError("the megatron strategy trains in bfloat16 or float32, not float16; expected dtype "
                         "bfloat16 or float32, or the option bf16 on the node")
    return {"bf16": dtype == "bfloat16"}


def resolve(options: dict[str, Any] | None) -> dict[str, Any]:
    """Options with defaults filled in; ConfigError listing every violation."""
    from siirl_dag.config.schema import StrictValidator

    sch = schema()
    full = {k: v["default"] for k, v in sch["properties"].items()}
    full.update(options or {})
    errors = sorted(StrictValidator(sch).iter_errors(full), key=lambda e: list(e.path))
    if errors:
        raise ConfigError([Problem(("options", *e.path), e.message) for e in errors])
    problems = []
    if full["lr_decay_style"] != "constant" and full["lr_decay_steps"] is None:
        problems.append(Problem(("options", "lr_decay_steps"), f"needed by lr_decay_style "
                                f"{full['lr_decay_style']!r}; expected a number of optimizer steps"))
    if full["lr_decay_steps"] is not None and full["lr_decay_steps"] <= full["lr_warmup_steps"]:
        problems.append(Problem(("options", "lr_decay_steps"), "must be larger than lr_warmup_steps"))
    if full["min_lr"] > full["lr"]:
        problems.append(Problem(("options", "min_lr"), "is above lr; expected min_lr <= lr"))
    if full["overlap_param_gather"] and not full["use_distributed_optimizer"]:
        problems.append(Problem(("options", "overlap_param_gather"), "needs use_distributed_optimizer: true"))
    if problems:
        raise ConfigError(problems)
    return full


def check_device(options: dict[str, Any], cp: int, te: bool) -> None:
    """Refuse, with the reason, what needs GPU-only kernels (they are built for GPU runs)."""
    problems = []
    if cp > 1 and not te:
        problems.append(Problem(("options", "context_parallel_size"),
                                f"context parallelism (c={cp}) needs Transformer Engine attention, which needs "
                                "CUDA and the transformer_engine package; expected c1 here"))
    if options["moe_grouped_gemm"] and not te:
        problems.append(Problem(("options", "moe_grouped_gemm"),
                                "grouped GEMM experts need Transformer Engine's grouped linear layers, which need "
                                "CUDA and the transformer_engine package; expected false here"))
    if problems:
        raise ConfigError(problems)
