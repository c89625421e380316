"""The memory plan against reality: each Megatron rank's weights, gradients and optimizer state, read
from its tensors after a training step, are within 25% of the plan's estimate (the demo's model on one
rank; TP2 x PP2 on four; DP2 with the distributed optimizer, which shards the state)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dist_utils import dims, make_batch, make_tiny_hf, run_ranks
from siirl_dag.models.shape import ModelShape
from siirl_dag.placement.memory import MeshWork
from siirl_dag.strategies.base import RankContext
from siirl_dag.strategies.megatron.memory import estimate
from test_megatron_engine import OPTS, _shard, pg_loss

TERMS = ("weights", "gradients", "optimizer")


def _measure(rank, world, path, sizes, opts):
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    eng = MegatronEngine(RankContext(rank, dims(world, sizes)), {"path": path}, {**OPTS, **opts})
    eng.train(_shard(make_batch(8), eng.dp_rank, eng.dp_size), pg_loss, mini_batch_size=8, micro_batch_size=2)
    return eng.memory_gib()


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return make_tiny_hf(str(tmp_path_factory.mktemp("memory") / "dense"), "qwen2", num_hidden_layers=4)


@pytest.mark.parametrize("case", ["demo-1-rank", "tp2-pp2", "dp2-distopt"])
def test_estimate_is_within_25_percent_of_each_rank(case, tiny_model_dir, four_layers):
    path, world, sizes, opts = {
        "demo-1-rank": (tiny_model_dir, 1, {}, {}),
        "tp2-pp2": (four_layers, 4, {"tp": 2, "pp": 2}, {"sequence_parallel": True}),
        "dp2-distopt": (four_layers, 2, {}, {"use_distributed_optimizer": True}),
    }[case]
    shape = ModelShape.from_hf(json.loads((Path(path) / "config.json").read_text()))
    work = MeshWork(shape, "float32", dims(world, sizes), opts, True, None, 11, "cpu", 16.0, False)
    planned = estimate(work).terms
    ranks = run_ranks(_measure, world, path, sizes, opts)
    for rank, got in enumerate(ranks):
        for term in TERMS:
            # the bar is 25%; these tensors are counted exactly, so a drift of 5% is already a bug
            assert got[term] == pytest.approx(planned[term], rel=0.05), (case, rank, term, got[term], planned[term])
