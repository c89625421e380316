"""vLLM's CPU workarounds that need no engine (the engine-level ones run in test_vllm_strategy)."""

import os

import torch

from siirl_dag.strategies.vllm import cpu_compat


def test_a_load_finishes_with_the_cores_it_is_given_then_gives_them_back():
    before = torch.get_num_threads()
    with cpu_compat._threads(64):  # never more than the process may run on
        assert torch.get_num_threads() == min(64, len(os.sched_getaffinity(0)))
    assert torch.get_num_threads() == before
    with cpu_compat._threads(None):
        assert torch.get_num_threads() == before
