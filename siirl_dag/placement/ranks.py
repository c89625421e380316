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

from siirl_dag.errors import ConfigError

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


def grid_sizes(world: int, tp: int, pp: int, cp: int = 1, ep: int = 1, etp: int | None = None) -> dict[str, int]:
    """All sizes of both grids; etp defaults to tp (megatron-core's default)."""
    etp = tp if etp is None else etp
    for label, size in (("tp*pp*cp", tp * pp * cp), ("etp*ep*pp", etp * ep * pp)):
        if size < 1 or world % size:
            raise ConfigError(f"world size {world} is not divisible by {label} = {size}")
    return {"tp": tp, "cp": cp, "dp": world // (tp * pp * cp), "pp": pp,
            "etp": etp, "ep": ep, "edp": world // (etp * ep * pp)}


def _groups(sizes: dict[str, int], grid: Sequence[str], along: Sequence[str]) -> list[list[int]]:
    """Ranks grouped by the `along` dimensions, in megatron-core's group and member order."""
    dims = [sizes[n] for n in grid]
    ranks = np.arange(math.prod(dims)).reshape(dims[::-1])  # C order: axis 0 is the slowest (pp)
    axis = {n: len(grid) - 1 - i for i, n in enumerate(grid)}
    outer = [n for n in grid if n not in along][::-1]
    inner = [n for n in grid if n in along][::-1]
    perm = [axis[n] for n in outer + inner]
    size = math.prod(sizes[n] for n in inner)
    return ranks.transpose(perm).reshape(-1, size).tolist()


def rank_groups(
    world: int, tp: int, pp: int, cp: int = 1, ep: int = 1, etp: int | None = None
) -> dict[str, list[list[int]]]:
    """Every group kind (keys of GROUPS) -> its rank lists, as megatron-core builds them."""
    sizes = grid_sizes(world, tp, pp, cp, ep, etp)
    return {name: _groups(sizes, grid, along) for name, (grid, along) in GROUPS.items()}


def rank_coords(
    rank: int, world: int, tp: int, pp: int, cp: int = 1, ep: int = 1, etp: int | None = None
) -> dict[str, int]:
    """Index of `rank` along each dimension of both grids: tp, cp, dp, pp, etp, ep, edp."""
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside world size {world}")
    sizes = grid_sizes(world, tp, pp, cp, ep, etp)
    out: dict[str, int] = {}
    for grid in (DENSE, EXPERT):
        r = rank
        for name in grid:
            r, out[name] = divmod(r, sizes[name])
    return out


def inference_coords(rank: int, tp: int, pp: int) -> dict[str, int]:
    """vLLM/SGLang: instance dp owns t*p consecutive ranks, tp varying fastest inside it."""
    instance, local = divmod(rank, tp * pp)
    return {"dp": instance, "pp": local // tp, "tp": local % tp}
