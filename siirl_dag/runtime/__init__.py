"""Running a checked pipeline: worker groups per mesh, the DAG walked once per step.

Its names load on first use: the reaper (`python -m siirl_dag.runtime.reaper`), which every run starts
beside its Ray, imports this package and must not pay for torch."""

import importlib

__all__ = ["Batch", "PipelineError", "Runtime", "StepResult"]
_HOME = {"Batch": "siirl_dag.runtime.batch", "PipelineError": "siirl_dag.errors", "Runtime": "siirl_dag.runtime.dispatch",
         "StepResult": "siirl_dag.runtime.step"}


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(_HOME[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
