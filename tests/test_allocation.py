"""Allocation strings: every grammar rule, the sizes they imply, and the errors they raise."""

import pytest

from siirl_dag.errors import ConfigError
from siirl_dag.placement import (
    Component,
    allocation_world_size,
    check_backend_supported,
    component_to_json,
    parse_allocation,
)


def sizes(c: Component) -> tuple:
    d = c.dims
    return (d.dp, d.tp, d.pp, d.cp, d.ep, d.etp, d.edp, d.world_size)


@pytest.mark.parametrize(
    "spec, expected",  # (dp, tp, pp, cp, ep, etp, edp, world)
    [
        ("fsdp:d8", (8, 1, 1, 1, 1, 1, 8, 8)),
        ("vllm:d2t4", (2, 4, 1, 1, 1, 4, 2, 8)),
        ("sglang:d4t2p2", (4, 2, 2, 1, 1, 2, 4, 16)),
        ("megatron:d2p2t4", (2, 4, 2, 1, 1, 4, 2, 16)),
        # e adds no devices; plain string with e: etp = 1 (AReaL), edp = 16 / (2*1*4)
        ("megatron:d2p2t4e4", (2, 4, 2, 1, 4, 1, 2, 16)),
        ("megatron:d2t4p2c2", (2, 4, 2, 2, 1, 4, 4, 32)),  # without e: etp = t, edp = dp*cp
        ("archon:t2e2d2", (2, 2, 1, 1, 2, 1, 2, 4)),  # any order
        ("fsdp:c2d2t2", (2, 2, 1, 2, 1, 2, 4, 8)),
        # MoE folding (seed 000 and 004 examples): ffn t is etp, ffn d is edp
        ("megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)", (1, 2, 4, 2, 4, 1, 1, 16)),
        ("megatron:(attn:d4p2t2c2|ffn:d2p2t4e2)", (4, 2, 2, 2, 2, 4, 2, 32)),
        ("megatron:(attn:d4p2t2|ffn:t1e4)", (4, 2, 2, 1, 4, 1, 2, 16)),  # ffn p inherited, d derived
        ("megatron:(attn:d2t2|ffn:t1)", (2, 2, 1, 1, 1, 1, 4, 4)),  # expert TP off, no EP
        ("megatron:attn:d4p2t2c2|ffn:d2p2t4e2", (4, 2, 2, 2, 2, 4, 2, 32)),  # parentheses optional
        ("megatron[actor]:(attn:d1p4t2c2|ffn:p4e4)", (1, 2, 4, 2, 4, 1, 1, 16)),
        ("  megatron [ actor ] : ( attn : d1 p4 t2 c2 | ffn : d1 p4 t1 e4 )  ", (1, 2, 4, 2, 4, 1, 1, 16)),
    ],
)
def test_sizes(spec, expected):
    (c,) = parse_allocation(spec)
    assert sizes(c) == expected


def test_seed_000_layout_two_components():
    inf, train = parse_allocation("sglang:d4t4+megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)")
    assert (inf.backend, inf.dims.world_size, train.backend, train.dims.world_size) == ("sglang", 16, "megatron", 16)
    assert allocation_world_size([inf, train]) == 32
    assert inf.colocated_with is None and train.colocated_with is None


def test_colocation_binds_tighter_than_plus():
    r, a, c = parse_allocation("sglang[r]:d2 + fsdp[a]:d4 | fsdp[c]:d2t2")
    assert (r.name, a.name, c.name) == ("r", "a", "c")
    assert (r.colocated_with, a.colocated_with, c.colocated_with) == (None, None, "a")
    assert allocation_world_size([r, a, c]) == 2 + 4  # the colocated member counts once
    x, y, z = parse_allocation("megatron[x]:d4|vllm[y]:d2t2|megatron[z]:t4")
    assert (y.colocated_with, z.colocated_with) == ("x", "x")
    assert allocation_world_size([x, y, z]) == 4


def test_component_json_keys_and_frozen():
    (c,) = parse_allocation("megatron[actor]:d2p2t4e4")
    js = component_to_json(c)
    assert set(js) == {"backend", "name", "dp", "tp", "pp", "cp", "ep", "etp", "edp", "world_size", "colocated_with"}
    assert js == {"backend": "megatron", "name": "actor", "dp": 2, "tp": 4, "pp": 2, "cp": 1, "ep": 4, "etp": 1,
                  "edp": 2, "world_size": 16, "colocated_with": None}
    with pytest.raises(AttributeError):
        c.dims.tp = 8


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("d4t2", "a backend is required"),
        ("[actor]:d4", "a backend is required"),
        ("megatron(attn:d2|ffn:e2)", "missing ':'"),
        ("tpu:d4", "unknown backend 'tpu'"),
        ("fsdp:d2e2", "component 'fsdp:d2e2': e is not allowed for backend fsdp (allowed: d, t, c)"),
        ("fsdp:d2p2", "p is not allowed for backend fsdp"),
        ("vllm:d2c2", "c is not allowed for backend vllm (allowed: d, t, p)"),
        ("sglang:d2e2", "e is not allowed for backend sglang"),
        ("megatron:d2x2", "unknown dimension 'x'"),
        ("megatron:D2", "unknown dimension 'D'"),
        ("megatron:d0t2", "d0: sizes must be positive"),
        ("megatron:d2t2d4", "dimension d given twice"),
        ("megatron:", "no dimensions"),
        ("megatron:d2t", "cannot read dimensions"),
        ("megatron:d2,t2", "cannot read dimensions"),
        ("megatron:d3e2", "expert data parallel = world 3 / (p1 * expert t1 * e2) is not a whole number"),
        ("megatron[1st]:d2", "bad name '1st'"),
        ("vllm:d2++megatron:d2", "empty component"),
        ("vllm:d2|", "empty component"),
        ("", "empty allocation string"),
        # folding
        ("fsdp:(attn:d2|ffn:e2)", "folding (attn:/ffn:) is not allowed for backend fsdp"),
        ("megatron:(attn:d1p4t2c2|ffn:d1p2t1e4)", "p must be equal in attn and ffn (attn p4, ffn p2)"),
        ("megatron:(attn:d1p4t2|ffn:d2p4t1e4)",
         "attn and ffn must cover the same devices (attn d*t*p*c = 8, ffn d*t*p*e = 32)"),
        ("megatron:(attn:d2t3|ffn:e4)", "expert data parallel = world 6 / (p1 * expert t1 * e4) is not a whole number"),
        ("megatron:(attn:d1t2e2|ffn:e2)", "e is not allowed in attn: (allowed: d, t, p, c)"),
        ("megatron:(attn:d2|ffn:c2e2)", "c is not allowed in ffn: (allowed: d, t, p, e)"),
        ("megatron:(attn:d2|attn:d2)", "section attn: given twice"),
        ("megatron:(attn:d2)", "needs both attn:<dims> and ffn:<dims>"),
        ("megatron:(attn:d2|ffn:e2", "unbalanced parentheses"),
        ("vllm:d\u0663", "cannot read dimensions"),  # an Arabic-Indic 3 is not a size
        ("vllm:d\uff12", "cannot read dimensions"),  # nor a full-width 2
        ("megatron:(attn:d2|mlp:e2)", "expected attn:<dims>|ffn:<dims>, got 'mlp:e2'"),
        # names and colocation
        ("vllm[x]:d2+megatron[x]:d2", "name 'x' is used twice"),
        ("vllm[a]:d2+megatron:d2+megatron[c]:d2", "component 'megatron:d2': needs a name"),
        ("vllm:d2|megatron[a]:d2", "component 'vllm:d2': needs a name"),
        ("vllm[a]:d2|megatron:d2", "component 'megatron:d2': needs a name"),
        ("vllm[a]:d2|megatron[b]:d4", "colocated components need equal world sizes ('a' has 2, 'b' has 4)"),
    ],
)
def test_errors(spec, fragment):
    with pytest.raises(ConfigError) as err:
        parse_allocation(spec, path=("meshes", "m", "allocation"))
    text = str(err.value)
    assert fragment in text
    assert text.startswith("meshes.m.allocation: ")
    assert all(p.path == ("meshes", "m", "allocation") for p in err.value.problems)
    assert isinstance(err.value, ValueError)


def test_error_names_spec_component_and_rule():
    with pytest.raises(ConfigError) as err:
        parse_allocation("megatron[x]:d2t2c2e2|fsdp[y]:d4e2")
    assert err.value.problems[0].message == (
        "'megatron[x]:d2t2c2e2|fsdp[y]:d4e2': component 'fsdp[y]:d4e2': e is not allowed for backend fsdp "
        "(allowed: d, t, c)")


def test_all_problems_are_reported_at_once():
    with pytest.raises(ConfigError) as err:
        parse_allocation("tpu:d2+fsdp:d2e2+vllm:d2c2")
    assert len(err.value.problems) == 3


def test_check_backend_supported():
    vllm, megatron, fsdp = parse_allocation("vllm[r]:d2+megatron[a]:d2+fsdp[c]:d2")
    check_backend_supported(vllm)
    check_backend_supported(megatron)
    expected = r"backend 'fsdp' has no strategy in this engine \(available: megatron, vllm\)"
    with pytest.raises(ConfigError, match=expected) as err:
        check_backend_supported(fsdp, path=("meshes", "critic"))
    assert err.value.problems[0].path == ("meshes", "critic")
    check_backend_supported(fsdp, available=("fsdp",))
