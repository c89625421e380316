"""Per-rank engines, one package each (`vllm/`, `megatron/`), each described by its `spec.py` (a
`spec.StrategySpec`) and registered by name in `siirl_dag.registry.STRATEGIES`; `base` holds what
they share, `engines` what the runtime calls on them, `samples` a rollout's generated samples and
the batch it packs them into. Importing the package loads nothing heavy."""
