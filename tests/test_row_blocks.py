"""The copy into row blocks (`weight_sync/row_blocks.cpp`, built on first use): against torch's own
transposing copy, on whole blocks and the parts of one a sliced weight cuts, from a slice of a
fused weight into a view at an offset, on one thread and two; torch's copy where the kernel does
not apply or cannot be built."""

from __future__ import annotations

import functools

import pytest
import torch

from siirl_dag.weight_sync import row_blocks
from siirl_dag.weight_sync.cores import borrowed


def blocked(weight: torch.Tensor, width: int) -> torch.Tensor:
    return weight.unflatten(0, (-1, width)).transpose(1, 2).contiguous()


def test_the_kernel_builds_here():
    assert row_blocks._kernel() is not None  # else every test below would only check torch's copy


# (rows, columns, rows per block): whole 16x16 tiles, columns and rows left over, a part of a block
@pytest.mark.parametrize("rows, cols, width", [(128, 64, 64), (96, 40, 48), (64, 17, 16), (30, 5, 30), (7, 3, 7)])
def test_small_copies_equal_torchs(rows, cols, width):
    src = torch.randn(rows, cols)
    packed = torch.full((rows // width, cols, width), float("nan"))
    row_blocks.copy_into(packed, src)
    torch.testing.assert_close(packed, blocked(src, width), rtol=0, atol=0)


@pytest.mark.parametrize("cores", [1, 2])
def test_a_large_copy_is_streamed_and_split_between_threads(cores):
    src = torch.randn(2048 + 64, 1040)[64:]  # a slice of a fused weight: its rows start further in
    assert src.numel() >= row_blocks._STREAMED_FROM >= row_blocks._THREADED_FROM
    packed = torch.full((2048 // 64, 1040, 64), float("nan"))
    with borrowed(cores):
        row_blocks.copy_into(packed, src)
    torch.testing.assert_close(packed, blocked(src, 64), rtol=0, atol=0)


def test_a_part_of_a_block_at_an_offset_leaves_the_rest_alone(monkeypatch):
    """As `pieces` cuts a weight whose rows start inside a block: rows 40..64 of a block of 64, at an
    offset no 64-byte line starts at. Streaming stores need one: the kernel falls back to ordinary
    ones (a streaming store there would crash the process)."""
    monkeypatch.setattr(row_blocks, "_STREAMED_FROM", 0)
    memory = torch.zeros(2, 32, 64)
    (_, n, size, stride, offset), = row_blocks.pieces(40, 24, 32, 32, 64)
    src = torch.randn(n, 32)
    row_blocks.copy_into(memory.view(-1).as_strided(size, stride, offset), src)
    assert torch.equal(memory[0, :, 40:], src.t()) and not memory[0, :, :40].any() and not memory[1].any()


def test_what_the_kernel_does_not_take_goes_through_torch():
    src = torch.randn(64, 32).t().contiguous().t()  # columns one apart: not unit-stride rows
    packed = torch.zeros(1, 32, 64)
    row_blocks.copy_into(packed, src)
    torch.testing.assert_close(packed, blocked(src, 64), rtol=0, atol=0)
    half = torch.zeros(1, 32, 64, dtype=torch.bfloat16)
    row_blocks.copy_into(half, src.bfloat16())
    assert torch.equal(half, blocked(src.bfloat16(), 64))
    with pytest.raises(ValueError, match="does not fit"):
        row_blocks.copy_into(packed, src[:32])


def test_without_a_compiler_the_copies_go_through_torch_with_one_warning(monkeypatch, capfd):
    from torch.utils import cpp_extension

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Ninja is required to load C++ extensions\nmore detail")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    monkeypatch.setattr(row_blocks, "_kernel", functools.cache(row_blocks._kernel.__wrapped__))  # not the built one
    src, packed = torch.randn(128, 16), torch.zeros(2, 16, 64)
    for _ in range(2):
        row_blocks.copy_into(packed, src)
    torch.testing.assert_close(packed, blocked(src, 64), rtol=0, atol=0)
    err = capfd.readouterr().err
    assert err.count("could not build row_blocks.cpp (Ninja is required to load C++ extensions)") == 1
