"""vLLM's CPU workarounds that need no engine (the engine-level ones run in test_vllm_strategy)."""

import os

import torch

from siirl_dag.strategies.vllm import cpu_compat
from siirl_dag.weight_sync.cores import borrowed


def test_a_sync_borrows_the_cores_it_is_given_then_gives_them_back():
    before = torch.get_num_threads()
    with borrowed(64):  # never more than the process may run on
        assert torch.get_num_threads() == min(64, len(os.sched_getaffinity(0)))
    assert torch.get_num_threads() == before
    with borrowed(None):
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
    assert not hasattr(packed, "row_blocks"), "48 rows: oneDNN pads them, so vLLM's own packing"


def test_packed_fp32_weights_are_row_blocks_that_a_sync_writes_like_a_plain_weight():
    """cpu_packed_weights (the default): oneDNN's packed layout, in a parameter of ours, so an update
    rearranges the plain weight into it, or a sync writes it directly, instead of re-packing."""
    from vllm.model_executor.layers import utils
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    from siirl_dag.weight_sync import row_blocks

    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.randn(256, 32), requires_grad=False)
    embedding = VocabParallelEmbedding.__new__(VocabParallelEmbedding)  # its __init__ wants a TP group
    torch.nn.Module.__init__(embedding)
    embedding.weight = torch.nn.Parameter(torch.randn(256, 32), requires_grad=False)
    head = torch.nn.Module()  # an LM head tied to the embedding: vLLM shares the weight, not the module
    head.weight = embedding.weight
    with cpu_compat.linear_packing(True):
        utils.dispatch_cpu_unquantized_gemm(module, remove_weight=True)
        utils.dispatch_cpu_unquantized_gemm(embedding, remove_weight=True)
        utils.dispatch_cpu_unquantized_gemm(head, remove_weight=True)
    assert head.row_blocks is embedding.row_blocks, "one weight, one packed copy: a write reaches both layers"
    block = module.row_blocks.shape[2]
    assert cpu_compat.blocked_weights(module) == [(module.weight, module.row_blocks, block, False)]
    assert cpu_compat.blocked_weights(embedding) == [(embedding.weight, embedding.row_blocks, block, True)], \
        "the LM head computes from row blocks too, and its lookup reads the plain weight"
    x = torch.randn(5, 32)
    compiled = torch.compile(lambda x: module.cpu_linear(x, module.weight, None) + 1)
    for update in range(3):
        if update == 1:  # a load: new plain weights, then the finish rearranges them
            module.weight.data.copy_(torch.randn(256, 32))
            cpu_compat._repack([module])
        new = module.weight.data
        if update == 2:  # a sync wrote the blocks (moved into other memory, as a shared segment does)
            new = torch.randn(256, 32)
            module.row_blocks.data = torch.empty_like(module.row_blocks)
            row_blocks.copy_into(module.row_blocks, new)
            cpu_compat._repack([module], blocks_written=True)
        torch.testing.assert_close(module.cpu_linear(x, module.weight, None), torch.nn.functional.linear(x, new))
        torch.testing.assert_close(compiled(x), torch.nn.functional.linear(x, new) + 1)


def test_the_cpu_moe_kernels_fp32_layout_is_learnt_as_row_blocks():
    """A weight sync writes MoE experts in the kernel's own layout (`weight_sync.direct`), as learnt here."""
    from vllm import _custom_ops

    experts = torch.randn(3, 64, 32)
    block = cpu_compat._prepacked_block(64, 32, "vec")  # the portable ISA (vLLM picks amx where there is one)
    assert block is not None
    assert torch.equal(_custom_ops.cpu_prepack_moe_weight(experts, "vec").view(3, 64 // block, 32, block),
                       experts.view(3, 64 // block, block, 32).transpose(2, 3))
