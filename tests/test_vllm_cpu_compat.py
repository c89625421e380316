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


def test_plain_fp32_weights_run_onednn_and_an_update_is_a_write_into_them():
    """cpu_packed_weights false: no packed copy to renew, and not torch's linear (MKL; slow on AMD)."""
    from vllm.model_executor.layers import utils

    def layer(dtype=torch.float32):
        module = torch.nn.Module()
        module.weight = torch.nn.Parameter(torch.randn(48, 32, dtype=dtype), requires_grad=False)
        return module

    x = torch.randn(5, 32)
    with cpu_compat.linear_packing(False):
        plain, bf16 = layer(), layer(torch.bfloat16)
        utils.dispatch_cpu_unquantized_gemm(plain, remove_weight=True)
        utils.dispatch_cpu_unquantized_gemm(bf16, remove_weight=True)
    assert plain.cpu_linear is cpu_compat._linear_on_plain and not cpu_compat._packed(plain)
    assert bf16.cpu_linear is not cpu_compat._linear_on_plain, "oneDNN's plain path is fp32 only here"
    plain.weight.data.mul_(-2)  # what a weight update does: a write into the parameter
    torch.testing.assert_close(plain.cpu_linear(x, plain.weight, None), torch.nn.functional.linear(x, plain.weight))
    compiled = torch.compile(lambda x, w: plain.cpu_linear(x, w, None) + 1)  # vLLM compiles its model unless eager
    torch.testing.assert_close(compiled(x, plain.weight), torch.nn.functional.linear(x, plain.weight) + 1)

    with cpu_compat.linear_packing(True):
        packed = layer()
        utils.dispatch_cpu_unquantized_gemm(packed, remove_weight=True)
    assert cpu_compat._packed(packed) and packed.weight.numel() > 0, "packed, and the plain weight kept for updates"
