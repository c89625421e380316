"""Global loss normalization on real megatron-core ranks: the actor objective of every aggregation
mode gives the same loss and gradient norm however a mini batch is split, into micro batches of 1 or
one of 8, over one rank or two data-parallel ranks, with responses of uneven lengths."""

from __future__ import annotations

import pytest
import torch

from dist_utils import dims, make_batch, make_tiny_hf, run_ranks
from siirl_dag.strategies.base import RankContext

MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def _losses(rank, world, path):
    """(loss, grad_norm) of one step of the actor objective per mode and micro batch size, at a vanishing lr so
    every step sees the same weights."""
    from nodes.algos.losses import ppo_actor_loss
    from siirl_dag.strategies.megatron.engine import MegatronEngine

    eng = MegatronEngine(RankContext(rank, dims(world, {})), {"path": path}, {"lr": 1e-30, "weight_decay": 0.0, "clip_grad": 0.0})
    batch = make_batch(8, resp_len=7)
    batch["noise"] = 0.3 * torch.randn(batch["responses"].shape, generator=torch.Generator().manual_seed(1))
    n = len(batch["uid"]) // eng.dp_size
    batch = {k: v[eng.dp_rank * n:(eng.dp_rank + 1) * n] for k, v in batch.items()}
    batch["old_logprobs"] = eng.compute_logprobs(batch, micro_batch_size=4)["logprobs"] + batch.pop("noise")
    out = {}
    for mode in MODES:
        def loss_fn(logprobs, entropy, mb, totals, mode=mode):
            return ppo_actor_loss(logprobs, mb["old_logprobs"], mb["advantages"], mb["response_mask"], entropy,
                                  loss_agg_mode=mode, entropy_coeff=0.01, totals=totals)

        for micro in (1, n):
            m = eng.train(batch, loss_fn, mini_batch_size=8, micro_batch_size=micro)
            out[mode, micro == 1] = (m["loss"], m["grad_norm"])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    path = make_tiny_hf(str(tmp_path_factory.mktemp("norm") / "m"), "qwen2")
    return run_ranks(_losses, 1, path)[0], run_ranks(_losses, 2, path)


def test_uneven_lengths_are_in_the_batch():
    lengths = make_batch(8, resp_len=7)["response_mask"].sum(-1)
    assert len(set(lengths.tolist())) > 2


@pytest.mark.engines
@pytest.mark.parametrize("mode", MODES)
def test_micro_batches_of_one_give_the_whole_batch_loss(results, mode):
    one, _ = results
    whole, single = one[mode, False], one[mode, True]
    assert whole[1] > 0
    assert single == pytest.approx(whole, rel=1e-6, abs=1e-7)


@pytest.mark.engines
@pytest.mark.parametrize("mode", MODES)
def test_two_data_parallel_ranks_give_one_rank_loss(results, mode):
    one, two = results
    for rank in two:
        for single in (False, True):
            assert rank[mode, single] == pytest.approx(one[mode, False], rel=1e-6, abs=1e-7), (mode, single)
