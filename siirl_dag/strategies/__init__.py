"""Per-rank engines, one package each (`vllm/`, `megatron/`), registered by name in
`siirl_dag.registry.STRATEGIES`; `base` holds what they share, `rollout_layout` the batch a rollout
produces. Importing the package loads nothing heavy."""
