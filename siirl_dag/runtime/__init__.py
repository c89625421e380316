"""Running a checked pipeline: worker groups per mesh, the DAG walked once per step."""

from siirl_dag.errors import PipelineError
from siirl_dag.runtime.batch import Batch
from siirl_dag.runtime.dispatch import Runtime
from siirl_dag.runtime.step import StepResult

__all__ = ["Batch", "PipelineError", "Runtime", "StepResult"]
