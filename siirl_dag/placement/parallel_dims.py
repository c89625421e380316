"""One mesh's parallel sizes: the one description that placement, the plan and both strategies read.

Made once, when the allocation string is parsed (and the node's virtual pipeline size added), and
checked here, in `__post_init__`; everything after trusts it. Megatron-core's two grids over the
same ranks: dense, world = dp * tp * pp * cp; expert, edp = world / (pp * etp * ep).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelDims:
    dp: int = 1  # data parallel (of the dense grid)
    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline stages
    cp: int = 1  # context parallel
    ep: int = 1  # expert parallel: splits the experts over the existing ranks, adds none
    etp: int | None = None  # expert tensor parallel; None: tp (megatron-core's default)
    vpp: int = 1  # virtual pipeline chunks per stage (a node option, not in the allocation string)

    def __post_init__(self) -> None:
        if self.etp is None:
            object.__setattr__(self, "etp", self.tp)
        small = [f"{k}={v}" for k in ("dp", "tp", "pp", "cp", "ep", "etp", "vpp") if (v := getattr(self, k)) < 1]
        if small:
            raise ValueError(f"parallel sizes must be positive integers, not {', '.join(small)}")
        if self.world_size % (self.pp * self.etp * self.ep):
            raise ValueError(f"expert data parallel = world {self.world_size} / (p{self.pp} * expert t{self.etp} * "
                             f"e{self.ep}) is not a whole number; choose e (or expert t) dividing world / p")
        if self.vpp > 1 and self.pp == 1:
            raise ValueError(f"virtual pipeline ({self.vpp}) needs pipeline parallel > 1, the mesh has p1")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def edp(self) -> int:
        return self.world_size // (self.pp * self.etp * self.ep)

    def to_json(self) -> dict[str, int]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp, "ep": self.ep, "etp": self.etp,
                "edp": self.edp, "vpp": self.vpp, "world_size": self.world_size}

    def describe(self) -> str:
        return f"d{self.dp} t{self.tp} p{self.pp} c{self.cp} e{self.ep} etp{self.etp} edp{self.edp}"
