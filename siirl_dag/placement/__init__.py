"""Allocation strings -> components -> meshes -> ranks on (machine, device).

Read in this order: `parallel_dims` (one mesh's sizes, checked once), `allocation` (the string
language), `ranks` (megatron-core's rank grids),
`rules` (strategy options vs mesh), `layout` (devices for every mesh), `plan` (the result).
"""

from siirl_dag.placement.allocation import (
    Component,
    allocation_world_size,
    check_backend_supported,
    component_to_json,
    parse_allocation,
)
from siirl_dag.placement.layout import MeshRequest, place
from siirl_dag.placement.parallel_dims import ParallelDims
from siirl_dag.placement.plan import ClusterSpec, MeshPlan, Plan, RankSlot
from siirl_dag.placement.ranks import inference_coords, rank_coords, rank_groups

__all__ = [
    "ClusterSpec",
    "Component",
    "MeshPlan",
    "MeshRequest",
    "ParallelDims",
    "Plan",
    "RankSlot",
    "allocation_world_size",
    "check_backend_supported",
    "component_to_json",
    "inference_coords",
    "parse_allocation",
    "place",
    "rank_coords",
    "rank_groups",
]
