"""The generic data side: parquet prompt files and a resumable loader (no algorithm here)."""

from siirl_dag.data.dataset import PromptDataset, PromptLoader

__all__ = ["PromptDataset", "PromptLoader"]
