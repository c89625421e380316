"""Our rank groups against megatron-core's own RankGenerator, built as initialize_model_parallel does."""

import pytest

from siirl_dag.placement import ParallelDims, inference_coords, rank_coords, rank_groups

ORDER = "tp-cp-ep-dp-pp"  # initialize_model_parallel's default

# (world, tp, pp, cp, ep, etp); etp None = megatron-core's default (etp = tp)
SHAPES = [
    (1, 1, 1, 1, 1, None),
    (2, 2, 1, 1, 1, None),
    (2, 1, 2, 1, 1, None),
    (4, 1, 1, 2, 1, None),
    (8, 2, 2, 1, 1, None),  # the PEERS.md example
    (8, 2, 1, 2, 1, None),
    (8, 1, 1, 1, 4, 1),
    (8, 2, 1, 1, 2, 1),
    (8, 2, 2, 1, 2, 1),
    (8, 1, 2, 2, 2, 2),  # etp > tp
    (16, 2, 4, 2, 4, 1),  # seed 000: megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)
    (16, 4, 2, 1, 4, 1),  # megatron:d2p2t4e4 with AReaL's etp = 1
    (16, 4, 2, 1, 2, None),
    (16, 2, 2, 2, 1, None),
    (32, 2, 2, 2, 2, 4),  # seed 004: megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)
    (32, 4, 2, 2, 1, None),
    (32, 8, 1, 1, 4, 2),
    (32, 1, 4, 4, 8, 1),
    (64, 8, 4, 1, 8, 1),
    (64, 4, 2, 4, 4, 2),
    (64, 2, 8, 2, 2, 2),
    (96, 4, 3, 2, 8, 1),  # non power of two
    (128, 8, 4, 2, 8, 2),
    (128, 2, 2, 2, 16, 1),
    (192, 8, 6, 1, 4, 4),
    (256, 8, 8, 2, 8, 4),
    (256, 4, 4, 4, 16, 1),
    (384, 8, 4, 3, 12, 2),
    (512, 8, 8, 4, 16, 1),
    (512, 4, 8, 2, 8, 8),
    (768, 8, 12, 2, 32, 1),
    (1024, 8, 16, 2, 32, 1),
    (1024, 8, 8, 4, 16, 4),
    (1024, 4, 4, 8, 64, 2),
    (1024, 1, 1, 1, 1024, 1),
]

DENSE_TOKENS = {"tp": "tp", "cp": "cp", "dp": "dp", "pp": "pp", "dp_cp": "dp-cp", "tp_cp": "tp-cp", "mp": "tp-pp"}
EXPERT_TOKENS = {"ep": "ep", "etp": "tp", "edp": "dp", "etp_ep": "tp-ep"}


def megatron_groups(world, tp, pp, cp, ep, etp):
    """Mirror of megatron.core.parallel_state.initialize_model_parallel's two generators."""
    from megatron.core.parallel_state import RankGenerator  # here: megatron-core takes seconds to import

    etp = tp if etp is None else etp
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp * cp), pp=pp, cp=cp, order=ORDER, rank_offset=0)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=ORDER, rank_offset=0)
    assert dense.get_ranks("pp") == expert.get_ranks("pp")  # megatron-core asserts this too
    out = {k: dense.get_ranks(t) for k, t in DENSE_TOKENS.items()}
    out.update({k: expert.get_ranks(t) for k, t in EXPERT_TOKENS.items()})
    return out


def dims_of(world, tp, pp, cp, ep, etp) -> ParallelDims:
    return ParallelDims(dp=world // (tp * pp * cp), tp=tp, pp=pp, cp=cp, ep=ep, etp=etp)


def as_set(groups):
    return {tuple(sorted(g)) for g in groups}


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "W{}-tp{}-pp{}-cp{}-ep{}-etp{}".format(*s))
def test_groups_match_megatron_core(shape):
    ours, theirs = rank_groups(dims_of(*shape)), megatron_groups(*shape)
    assert set(ours) == set(theirs)
    for key in theirs:
        assert as_set(ours[key]) == as_set(theirs[key]), key
        assert ours[key] == theirs[key], key  # same group and member order, too


@pytest.mark.parametrize("shape", SHAPES[::3], ids=lambda s: "W{}-tp{}-pp{}-cp{}-ep{}-etp{}".format(*s))
def test_coords_are_positions_in_groups(shape):
    world, tp, pp, cp, ep, etp = shape
    dims = dims_of(*shape)
    groups = rank_groups(dims)
    dp = world // (tp * pp * cp)
    for rank in range(world):
        co = rank_coords(rank, dims)
        assert rank == co["tp"] + tp * (co["cp"] + cp * (co["dp"] + dp * co["pp"]))
        for key in ("tp", "cp", "dp", "pp", "ep", "etp", "edp"):
            (group,) = [g for g in groups[key] if rank in g]
            assert group.index(rank) == co[key], (rank, key)


def test_peers_example():
    g = rank_groups(ParallelDims(dp=2, tp=2, pp=2))
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]


def test_bad_shapes_are_refused_where_the_sizes_are_made():
    with pytest.raises(ValueError, match=r"expert data parallel = world 8 / \(p1 \* expert t2 \* e8\) is not a whole"):
        ParallelDims(dp=4, tp=2, ep=8, etp=2)
    with pytest.raises(ValueError, match="virtual pipeline \\(2\\) needs pipeline parallel > 1"):
        ParallelDims(dp=2, vpp=2)
    with pytest.raises(ValueError, match="positive integers, not tp=0"):
        ParallelDims(tp=0)
    with pytest.raises(ValueError, match="outside world size"):
        rank_coords(8, ParallelDims(dp=4, tp=2))


def test_inference_coords():
    # vllm:d2t2p2 -> instance 1 owns ranks 4..7; rank 6 is its stage 1, TP rank 0
    assert inference_coords(6, ParallelDims(dp=2, tp=2, pp=2)) == {"dp": 1, "pp": 1, "tp": 0}
    assert [inference_coords(r, ParallelDims(dp=2, tp=4))["dp"] for r in range(8)] == [0] * 4 + [1] * 4
