"""The memory plan: GiB per device for every mesh, before anything starts.

Each strategy estimates its own mesh (`StrategySpec.estimate_memory`: weights, gradients, optimizer
state, activations, vLLM's share and the KV cache it leaves); this module sums the meshes that share
a device and checks the sum against `cluster.device_memory_gb`. Colocated meshes take turns: while one
works at its peak, the others hold only what they do not offload (`MeshMemory.resident`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from siirl_dag.models.lora import LoraSpec
from siirl_dag.models.shape import ModelShape
from siirl_dag.errors import Problem
from siirl_dag.placement.parallel_dims import ParallelDims
from siirl_dag.registry import STRATEGIES

GIB = 2**30


def gib(x: float) -> str:
    """GiB as people read them: small amounts in MiB."""
    return f"{x * 1024:.1f} MiB" if x < 0.1 else f"{x:.2f} GiB"


@dataclass(frozen=True)
class MeshWork:
    """What a mesh's engine holds and computes, for its strategy's estimate."""

    shape: ModelShape
    dtype: str  # the model's
    dims: ParallelDims
    options: dict[str, Any]  # the engine's options as written (the estimate fills defaults)
    trains: bool
    lora: LoraSpec | None
    seq_len: int  # longest prompt + response
    device: str  # cuda | cpu
    device_gb: float
    colocated: bool  # shares its devices with another mesh


@dataclass
class MeshMemory:
    """One mesh's GiB per device at its peak, by term; the estimate of its busiest rank."""

    terms: dict[str, float]
    resident: tuple[str, ...]  # the terms still held while a colocated mesh works
    hints: dict[str, str]  # term -> what would shrink it
    notes: list[str] = field(default_factory=list)  # what the numbers mean (vLLM's KV cache in tokens)
    problems: list[Problem] = field(default_factory=list)  # paths under the node: ("options", key)
    fixes: list[dict] = field(default_factory=list)  # option changes that shrink it, the least intrusive first

    @property
    def peak(self) -> float:
        return sum(self.terms.values())

    @property
    def held(self) -> float:
        return sum(self.terms[t] for t in self.resident)

    def describe(self) -> str:
        return ", ".join(f"{t} {gib(gb)}" for t, gb in sorted(self.terms.items(), key=lambda kv: -kv[1]))


@dataclass
class MemoryPlan:
    device_gb: float
    meshes: dict[str, MeshMemory]
    device_peaks: dict[int, tuple[float, str]]  # device -> (GiB at its fullest, the mesh working then)
    missing: list[str] = field(default_factory=list)  # meshes without an estimate (model not on disk)

    def to_json(self) -> dict:
        return {"device_memory_gb": round(self.device_gb, 2), "missing": self.missing,
                "meshes": {m: {"peak_gb": round(e.peak, 3), "resident_gb": round(e.held, 3),
                               "terms_gb": {t: round(gb, 3) for t, gb in e.terms.items()}, "notes": e.notes}
                           for m, e in self.meshes.items()},
                "devices": {str(d): {"peak_gb": round(gb, 3), "while": m} for d, (gb, m) in self.device_peaks.items()}}

    def lines(self) -> list[str]:
        out = [f"memory per device (estimate; a device holds {gib(self.device_gb)}):"]
        for name, est in self.meshes.items():
            out.append(f"  {name}: {gib(est.peak)} at its peak ({est.describe()}); holds {gib(est.held)} while "
                       f"idle" + "".join(f"; {n}" for n in est.notes))
        fullest = max(self.device_peaks.items(), key=lambda kv: kv[1][0], default=None)
        if fullest:
            device, (gb, mesh) = fullest
            out.append(f"  fullest device: {device}, {gib(gb)} while {mesh} works ({gb / self.device_gb:.0%})")
        out += [f"  {m}: no estimate (its model's config.json is not on disk)" for m in self.missing]
        return out


def plan_memory(pipe) -> tuple[MemoryPlan | None, list[Problem]]:
    """The plan of a placed pipeline, and a problem per mesh that cannot fit (at `meshes.<name>`)."""
    if pipe.plan is None:
        return None, []
    cluster, works, estimators, first, missing, problems = pipe.cluster, {}, {}, {}, [], []
    colocated = {d for m in pipe.plan.meshes.values() for d in m.devices
                 if sum(d in other.devices for other in pipe.plan.meshes.values()) > 1}
    for name, placed in pipe.plan.meshes.items():
        bound = [n for n in pipe.nodes.values() if n.mesh == name]
        if not bound or STRATEGIES[bound[0].strategy].memory_model is None:
            continue
        model = pipe.models[bound[0].model]
        shape = ModelShape.from_hf(model.hf_config())
        if shape is None:
            missing.append(name)
            continue
        options = {k: v for n in bound for k, v in n.options.items()}
        works[name] = MeshWork(shape, model.dtype, placed.dims, options, any(pipe.kinds[n.id].trains for n in bound),
                               model.lora, pipe.data.max_prompt_length + pipe.data.max_response_length,
                               cluster.device, cluster.memory_gb, any(d in colocated for d in placed.devices))
        estimators[name], first[name] = STRATEGIES[bound[0].strategy].estimate_memory, bound[0].id
    meshes = {name: estimators[name](work) for name, work in works.items()}
    for name, est in meshes.items():  # a strategy's own problems, under the mesh's first node
        problems += [Problem(pipe.node_path(first[name]) + p.path, p.message, p.severity) for p in est.problems]
    plan = MemoryPlan(cluster.memory_gb, meshes, _device_peaks(pipe.plan, meshes), missing)
    fit = _Fitter(pipe.plan, works, estimators, meshes, cluster.memory_gb)
    return plan, problems + _too_full(plan, pipe.plan, fit)


def _device_peaks(placement, meshes: dict[str, MeshMemory]) -> dict[int, tuple[float, str]]:
    """Per device, the fullest moment: one mesh at its peak while the others there hold what they keep."""
    peaks = {}
    for device in sorted({d for m in placement.meshes.values() for d in m.devices}):
        here = [m for m, placed in placement.meshes.items() if device in placed.devices and m in meshes]
        if here:
            peaks[device] = max(((meshes[m].peak + sum(meshes[o].held for o in here if o != m), m) for m in here))
    return peaks


@dataclass
class _Fitter:
    """Tries each mesh's `fixes` on a device that is too full; the first one that makes every device fit."""

    placement: Any
    works: dict[str, MeshWork]
    estimators: dict[str, Callable]
    meshes: dict[str, MeshMemory]
    limit: float

    def __call__(self, device: int) -> str:
        here = [m for m, placed in self.placement.meshes.items() if device in placed.devices and m in self.meshes]
        for mesh in sorted(here, key=lambda m: -self.meshes[m].peak):
            for change in self.meshes[mesh].fixes:
                work = self.works[mesh]
                est = self.estimators[mesh](replace(work, options={**work.options, **change}))
                peaks = _device_peaks(self.placement, {**self.meshes, mesh: est})
                worst = max(gb for gb, _ in peaks.values())
                if worst <= self.limit and not est.problems:
                    spelled = ", ".join(f"{k}: {json.dumps(v)}" for k, v in change.items())
                    return f"with {spelled} in the options of mesh '{mesh}' it would need {gib(worst)}"
        return ""


def _too_full(plan: MemoryPlan, placement, fit: _Fitter) -> list[Problem]:
    problems, reported = [], set()
    for device, (gb, mesh) in sorted(plan.device_peaks.items(), key=lambda kv: -kv[1][0]):
        if gb <= plan.device_gb or mesh in reported or plan.meshes[mesh].problems:  # (those say it already)
            continue
        reported.add(mesh)
        est = plan.meshes[mesh]
        others = {o: plan.meshes[o].held for o, placed in placement.meshes.items()
                  if o != mesh and o in plan.meshes and device in placed.devices and plan.meshes[o].held > 0}
        beside = "".join(f"; mesh '{o}' beside it holds {gib(held)}" for o, held in others.items())
        largest = max(est.terms, key=est.terms.get)
        if others and max(others.values()) > est.terms[largest]:  # the neighbour is the problem
            holder = max(others, key=others.get)
            term, hint = f"what mesh '{holder}' holds while idle", plan.meshes[holder].hints["held"]
        else:
            term, hint = largest, est.hints[largest]
        found = fit(device)
        problems.append(Problem(("meshes", mesh), (
            f"needs {gib(gb)} on device {device}, which holds {gib(plan.device_gb)} (cluster.device_memory_gb): "
            f"at its peak {est.describe()}{beside}; the largest term is {term}; expected a layout that fits: "
            f"{found or hint}" + (f" (or {hint})" if found else ""))))
    return problems
