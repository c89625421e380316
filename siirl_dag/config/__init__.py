"""Config: the pipeline YAML, checked once at the door."""

from siirl_dag.config.loader import load_pipeline
from siirl_dag.config.pipeline import DataSpec, MeshSpec, ModelSpec, NodeSpec, Pipeline, RuntimeSpec, TrainerSpec

__all__ = ["load_pipeline", "Pipeline", "DataSpec", "MeshSpec", "ModelSpec", "NodeSpec", "RuntimeSpec", "TrainerSpec"]
