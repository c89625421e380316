"""`import --from PEER SOURCE`: a peer's configuration as a pipeline, and what did not carry over.

Each peer is one module with `read(path) -> Source` (the file as dotted keys with lines) and
`convert(Source) -> Draft` (the pipeline's parts); adding a peer is a file and a line here.
"""

from __future__ import annotations

from importlib import import_module
from pathlib import Path

from siirl_dag.errors import ConfigError, Problem
from siirl_dag.importers.source import Imported

PEERS = {"siirl": "siirl_dag.importers.verl", "verl": "siirl_dag.importers.verl",
         "roll": "siirl_dag.importers.roll", "areal": "siirl_dag.importers.areal", "slime": "siirl_dag.importers.slime",
         "openrlhf": "siirl_dag.importers.openrlhf", "nemo-rl": "siirl_dag.importers.nemo_rl"}


def import_config(peer: str, path: str | Path) -> Imported:
    """Read `path` as `peer` writes it; raises ConfigError (FILE:LINE) for what cannot be converted."""
    if not Path(path).is_file():
        raise ConfigError(Problem((), f"no such file; expected {peer}'s run script or YAML configuration", file=str(path)))
    module = import_module(PEERS[peer])
    source = module.read(path)
    draft = module.convert(source)
    return Imported(source, peer, draft.document(), source.not_carried(), source.remarks)
