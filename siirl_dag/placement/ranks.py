"""Megatron-core's rank layout, computed without torch.distributed.

megatron-core orders ranks `tp-cp-ep-dp-pp`, leftmost varying fastest, on two grids over the same
ranks (`parallel_state.initialize_model_parallel`):

- dense (attention) grid, ep = 1:     rank = tp_i + tp*(cp_i + cp*(dp_i + dp*pp_i)),  dp = W/(tp*pp*cp)
- expert (MoE) grid, cp = 1, tp->etp: rank = etp_i + etp*(ep_i + ep*(edp_i + edp*pp_i)), edp = W/(etp*ep*pp)

Knowing the groups before any process starts lets the planner keep TP groups inside a machine
and print where every rank lands; tests check them against megatron-core's own RankGenerator.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from siirl_dag.placement.parallel_dims import ParallelDims

# group name -> (grid, dimensions varying inside one group); grids are listed fastest first
DENSE = ("tp", "cp", "dp", "pp")
EXPERT = ("etp", "ep", "edp", "pp")
GROUPS = {
    "tp": (DENSE, ("tp",)),
    "cp": (DENSE, ("cp",)),
    "dp": (DENSE, ("dp",)),
    "pp": (DENSE, ("pp",)),
    "dp_cp": (DENSE, ("cp", "dp")),  # gradient reduction with context parallel
    "tp_cp": (DENSE, ("tp", "cp")),
    "mp": (DENSE, ("tp", "pp")),  # model parallel: one full copy of the model
    "ep": (EXPERT, ("ep",)),
    "etp": (EXPERT, ("etp",)),
    "edp": (EXPERT, ("edp",)),
    "etp_ep": (EXPERT, ("etp", "ep")),  # expert tensor-and-model parallel
}


def _groups(dims: ParallelDims, grid: Sequence[str], along: Sequence[str]) -> list[list[int]]:
    """Ranks grouped by the `along` dimensions, in megatron-core's group and member order."""
    sizes = [getattr(dims, n) for n in grid]
    ranks = np.arange(math.prod(sizes)).reshape(sizes[::-1])  # C order: axis 0 is the slowest (pp)
    axis = {n: len(grid) - 1 - i for i, n in enumerate(grid)}
    outer = [n for n in grid if n not in along][::-1]
    inner = [n for n in grid if n in along][::-1]
    perm = [axis[n] for n in outer + inner]
    size = math.prod(getattr(dims, n) for n in inner)
    return ranks.transpose(perm).reshape(-1, size).tolist()


def rank_groups(dims: ParallelDims) -> dict[str, list[list[int]]]:
    """Every group kind (keys of GROUPS) -> its rank lists, as megatron-core builds them."""
    return {name: _groups(dims, grid, along) for name, (grid, along) in GROUPS.items()}


def rank_coords(rank: int, dims: ParallelDims) -> dict[str, int]:
    """Index of `rank` along each dimension of both grids: tp, cp, dp, pp, etp, ep, edp."""
    if not 0 <= rank < dims.world_size:
        raise ValueError(f"rank {rank} is outside world size {dims.world_size}")
    out: dict[str, int] = {}
    for grid in (DENSE, EXPERT):
        r = rank
        for name in grid:
            r, out[name] = divmod(r, getattr(dims, name))
    return out


def inference_coords(rank: int, dims: ParallelDims) -> dict[str, int]:
    """vLLM/SGLang: instance dp owns t*p consecutive ranks, tp varying fastest inside it."""
    instance, local = divmod(rank, dims.tp * dims.pp)
    return {"dp": instance, "pp": local // dims.tp, "tp": local % dims.tp}
