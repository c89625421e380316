"""What a strategy is, in one place: a `StrategySpec` per strategy (`strategies/<name>/spec.py`),
registered by name in `siirl_dag.registry.STRATEGIES`. Validation reads its options' schema and
rules and how it takes the model's dtype; placement its parallel sizes' option keys; the memory plan
its estimate; the importers the names peers give it; the runtime its engine.

Its functions are `module:function` refs, imported when called: reading a spec loads no torch,
vLLM or Megatron (`validate` and `plan` never do).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from siirl_dag.refs import import_ref


@dataclass(frozen=True)
class StrategySpec:
    name: str
    engine: str  # "module:Class" of its per-rank engine (`strategies.engines`' protocols)
    # ParallelDims size -> the option key that sets it (megatron-core's keyword, vLLM's argument); peers
    # (verl, ROLL) write the same keys
    parallel_options: Mapping[str, str] = field(default_factory=dict)
    lora: bool = False  # trains or serves LoRA adapters (models.<name>.lora)
    # "module:function(options) -> options": its rules across option keys, beyond the schema, raising
    # ConfigError with ("options", key) paths
    option_rules: str | None = None
    # "module:function(dtype, written options) -> options": the precision options a model's dtype sets,
    # ValueError for a dtype it cannot run
    dtype_rule: str | None = None
    memory_model: str | None = None  # "module:function(placement.memory.MeshWork) -> MeshMemory"
    aliases: tuple[str, ...] = ()  # other names peers give it (ROLL's strategy_name)

    @property
    def options_schema(self) -> str:
        """Its options' JSON Schema, under siirl_dag/schemas/."""
        return f"strategies/{self.name}.schema.json"

    def allocation_options(self) -> dict[str, str]:
        """Option key -> the size of the allocation string it must agree with (vpp is an option alone)."""
        return {key: size for size, key in self.parallel_options.items() if size != "vpp"}

    def engine_class(self) -> type:
        return import_ref(self.engine)

    def check_options(self, options: dict[str, Any]) -> dict[str, Any]:
        """The options checked and completed (ConfigError); as written without rules of its own."""
        return import_ref(self.option_rules)(options) if self.option_rules else options

    def options_for_dtype(self, dtype: str, written: dict[str, Any]) -> dict[str, Any]:
        """The options a model's `dtype` sets where `written` does not say otherwise (ValueError)."""
        return import_ref(self.dtype_rule)(dtype, written) if self.dtype_rule else {}

    def estimate_memory(self, work: Any) -> Any:
        """Its memory estimate of a mesh (placement.memory.MeshWork -> MeshMemory); None without a model."""
        return import_ref(self.memory_model)(work) if self.memory_model else None
