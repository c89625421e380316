"""Placing meshes on a cluster: layouts, device lists, and every check that fails before start-up."""

import json

import pytest

from siirl_dag.errors import ConfigError
from siirl_dag.placement import ClusterSpec, MeshRequest, ParallelDims, parse_allocation, place, rank_coords

SP = {"sequence_parallel": True}
VPP2 = {"virtual_pipeline_model_parallel_size": 2}


def mesh(name, spec, **kw):
    return MeshRequest(name, parse_allocation(spec), path=("meshes", name), **kw)


def problems_of(cluster, requests):
    with pytest.raises(ConfigError) as err:
        place(cluster, requests)
    return err.value.problems


def one_problem(cluster, requests):
    (p,) = problems_of(cluster, requests)
    return p


@pytest.mark.parametrize("rollout", ["vllm:d4t4", "sglang:d4t4"])
def test_seed_000_disaggregated_on_4x8(rollout):
    plan = place(ClusterSpec(4, 8), [
        mesh("rollout", rollout),
        mesh("train", "megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)", options=SP,
             model_info={"num_layers": 48, "num_experts": 128}),
    ])
    roll, train = plan.meshes["rollout"], plan.meshes["train"]
    assert roll.devices == list(range(16)) and train.devices == list(range(16, 32))
    assert plan.devices_used == 32 and plan.warnings == []
    r5 = train.ranks[5]
    assert (r5.machine, r5.local_device, r5.device) == (2, 5, 21)
    assert r5.coords == rank_coords(5, ParallelDims(tp=2, pp=4, cp=2, ep=4, etp=1))
    assert roll.ranks[6].coords == {"dp": 1, "pp": 0, "tp": 2}
    assert train.dims.edp == 1 and roll.backend == rollout.split(":")[0]


def test_tp_groups_stay_inside_a_machine_first_fit():
    plan = place(ClusterSpec(2, 8), [mesh("a", "vllm:d3"), mesh("b", "vllm:d2t4"), mesh("c", "vllm:t2")])
    # a takes 0-2; b's first TP block fits in machine 0 (3-6), its second does not (one left) -> 8-11;
    # c goes back to the first machine with room: device 7 alone is too few -> 12, 13
    assert plan.meshes["a"].devices == [0, 1, 2]
    assert plan.meshes["b"].devices == [3, 4, 5, 6, 8, 9, 10, 11]
    assert plan.meshes["c"].devices == [12, 13]
    for m in plan.meshes.values():
        for start in range(0, len(m.ranks), m.dims.tp):
            assert len({r.machine for r in m.ranks[start:start + m.dims.tp]}) == 1


def test_expert_tp_blocks_also_stay_inside_a_machine():
    # attn t1 but ffn t4: blocks of lcm(1, 4) = 4 consecutive ranks
    plan = place(ClusterSpec(2, 8), [mesh("a", "vllm:d6"), mesh("b", "megatron:(attn:d4|ffn:t4)")])
    assert plan.meshes["b"].devices == [8, 9, 10, 11]


def test_fragmented_cluster_cannot_keep_tp_inside_machines():
    p = one_problem(ClusterSpec(2, 8), [mesh("a", "vllm:d6"), mesh("b", "vllm:d2t3"), mesh("c", "vllm:t4")])
    assert p.path == ("meshes", "c")
    assert "1 block(s) of 4 devices on one machine" in p.message and "[2, 2]" in p.message


def test_tp_larger_than_a_machine():
    p = one_problem(ClusterSpec(2, 8), [mesh("big", "megatron:t16")])
    assert "block(s) of 16 devices on one machine" in p.message and "allow_tp_across_machines" in p.message
    plan = place(ClusterSpec(2, 8), [mesh("big", "megatron:t16", allow_tp_across_machines=True)])
    assert plan.meshes["big"].devices == list(range(16))
    (w,) = plan.warnings
    assert w.severity == "warning" and w.path == ("meshes", "big") and "span machines" in w.message


def test_cluster_too_small_says_needed_and_available():
    p = one_problem(ClusterSpec(4, 8), [mesh("rollout", "vllm:d8t4"), mesh("train", "megatron:d2t4"),
                                        mesh("ref", "megatron:d2t4", colocate_with="train")])
    assert "needs 40 devices (rollout: 32, train: 8" in p.message
    assert "the cluster has 32 (4 machine(s) x 8 cuda device(s) = 32)" in p.message


def test_colocated_meshes_share_devices():
    plan = place(ClusterSpec(2, 4), [
        mesh("rollout", "vllm:d2t2"),
        mesh("actor", "megatron:d2t2", options=SP),
        mesh("ref", "megatron:t2p2", colocate_with="actor"),
        mesh("critic", "vllm:d4", colocate_with="ref"),  # chains resolve to the anchor
    ])
    assert plan.meshes["actor"].devices == plan.meshes["ref"].devices == plan.meshes["critic"].devices == [4, 5, 6, 7]
    assert plan.meshes["ref"].colocated_with == "actor" and plan.meshes["critic"].colocated_with == "actor"
    assert plan.meshes["actor"].colocated_with is None
    assert plan.devices_used == 8
    table = plan.table()
    assert "actor:3 ref:3 critic:3" in table and "on the devices of actor" in table


@pytest.mark.parametrize("requests, fragment", [
    ([mesh("a", "megatron:d4"), mesh("b", "megatron:d2", colocate_with="a")],
     "colocated meshes need equal world sizes"),
    ([mesh("a", "megatron:d4", colocate_with="zz")], "'zz' is not a mesh (meshes: a)"),
    ([mesh("a", "vllm:d2", colocate_with="b"), mesh("b", "vllm:d2", colocate_with="a")], "forms a cycle: a -> b -> a"),
    ([mesh("a", "vllm:d2"), mesh("a", "vllm:d2")], "mesh name 'a' is used twice"),
    ([MeshRequest("x", parse_allocation("vllm[r]:d2+megatron[t]:d2"))], "needs exactly one component, got 2"),
])
def test_mesh_set_errors(requests, fragment):
    assert any(fragment in p.message for p in problems_of(ClusterSpec(1, 8), requests))


def test_explicit_devices_are_honoured():
    plan = place(ClusterSpec(2, 8), [
        mesh("rollout", "vllm:d4", devices=[15, 14, 13, 12]),
        mesh("train", "megatron:d4t2", devices=[8, 9, 10, 11, 4, 5, 6, 7]),
        mesh("ref", "megatron:d4t2", colocate_with="train", devices=[4, 5, 6, 7, 8, 9, 10, 11]),
        mesh("reward", "vllm:d4"),  # first fit around the reserved devices
    ])
    assert plan.meshes["rollout"].ranks[0].device == 15
    assert [r.machine for r in plan.meshes["train"].ranks] == [1, 1, 1, 1, 0, 0, 0, 0]
    assert plan.meshes["ref"].ranks[0].device == 4
    assert plan.meshes["reward"].devices == [0, 1, 2, 3]


@pytest.mark.parametrize("devices, fragment", [
    ([0, 1, 2, 16], "devices [16] do not exist"),
    ([0, 1, 1, 2], "devices [1] are listed more than once"),
    ([0, 1, 2], "3 devices listed, the allocation 'megatron:d4' needs 4"),
    ([0, 1, 2, "3"], "device indices must be integers"),
])
def test_explicit_device_errors(devices, fragment):
    p = one_problem(ClusterSpec(2, 8), [mesh("train", "megatron:d4", devices=devices)])
    assert p.path == ("meshes", "train", "devices") and fragment in p.message


def test_explicit_devices_overlap_other_mesh():
    p = one_problem(ClusterSpec(1, 8), [mesh("a", "vllm:d4", devices=[0, 1, 2, 3]),
                                        mesh("b", "megatron:d4", devices=[3, 4, 5, 6])])
    assert "devices [3] are already used by mesh(es) a" in p.message and "colocate_with" in p.message
    p = one_problem(ClusterSpec(1, 8), [mesh("a", "vllm:d4"),
                                        mesh("b", "megatron:d4", colocate_with="a", devices=[3, 4, 5, 6])])
    assert "colocated with 'a' but lists other devices" in p.message


def test_explicit_tp_group_across_machines():
    spec, devices = "megatron:d2t4", [6, 7, 8, 9, 0, 1, 2, 3]
    p = one_problem(ClusterSpec(2, 8), [mesh("t", spec, devices=devices)])
    assert "1 tensor-parallel group(s) span machines, e.g. ranks [0, 1, 2, 3] on devices [6, 7, 8, 9]" in p.message
    plan = place(ClusterSpec(2, 8), [mesh("t", spec, devices=devices, allow_tp_across_machines=True)])
    assert [w.severity for w in plan.warnings] == ["warning"]


@pytest.mark.parametrize("spec, options, key", [
    ("megatron:d2t2", {"tensor_model_parallel_size": 4}, "tensor_model_parallel_size"),
    ("megatron:d2p2", {"pipeline_model_parallel_size": 1}, "pipeline_model_parallel_size"),
    ("megatron:d2c2", {"context_parallel_size": 1}, "context_parallel_size"),
    ("megatron:d4e2", {"expert_model_parallel_size": 4}, "expert_model_parallel_size"),
    ("megatron:d4e2", {"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size"),  # plain + e: etp 1
    ("megatron:(attn:d2t2|ffn:t1)", {"expert_tensor_parallel_size": 2}, "expert_tensor_parallel_size"),
    ("vllm:d2t2", {"tensor_parallel_size": 1}, "tensor_parallel_size"),
    ("vllm:d2t2", {"pipeline_parallel_size": 4}, "pipeline_parallel_size"),
])
def test_options_contradicting_the_string(spec, options, key):
    options = {"sequence_parallel": "t2" in spec, **options}
    p = one_problem(ClusterSpec(1, 8), [mesh("m", spec, options=options)])
    assert p.path == ("meshes", "m", "options", key)
    assert f"{key}={options[key]} contradicts the mesh allocation {spec!r}" in p.message


def test_a_vllm_mesh_with_pipeline_stages_is_refused_at_the_door():
    p = one_problem(ClusterSpec(1, 8), [mesh("m", "vllm:d2p2")])
    assert p.path == ("meshes", "m") and "p2: a vLLM rollout mesh has only d and t" in p.message


def test_options_agreeing_with_the_string_and_options_path():
    opts = {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2, "expert_model_parallel_size": 2,
            "expert_tensor_parallel_size": 1, "context_parallel_size": None, "sequence_parallel": True}
    place(ClusterSpec(1, 8), [mesh("m", "megatron:d2t2p2e2", options=opts)])
    p = one_problem(ClusterSpec(1, 8), [mesh("m", "megatron:d2t2", options_path=("nodes", 3, "megatron"),
                                             options={"tensor_model_parallel_size": 1})])
    assert p.path == ("nodes", 3, "megatron", "tensor_model_parallel_size")


@pytest.mark.parametrize("spec, options, model_info, fragment", [
    ("megatron:d4", VPP2, None, "virtual pipeline (2) needs pipeline parallel > 1"),
    ("megatron:d2p2", VPP2, {"num_layers": 6}, "6 layers do not split evenly over p2 x vpp2"),
    ("megatron:d2p4", {}, {"num_layers": 6}, "6 layers do not split evenly over p4 x vpp1"),
    ("megatron:d4", {"sequence_parallel": True}, None, "sequence_parallel needs tensor parallel > 1"),
    ("megatron:d2t2e2", {}, None, "MoE model with tensor parallel t2 needs sequence_parallel: true"),
    ("megatron:d2t2", {}, {"num_experts": 8}, "MoE model with tensor parallel t2 needs sequence_parallel"),
    ("megatron:d2t2", {"num_moe_experts": 8}, None, "MoE model with tensor parallel t2 needs sequence_parallel"),
    ("megatron:d4e4", {}, {"num_experts": 6}, "6 experts do not split evenly over e4"),
    ("megatron:d4e4", {}, {"num_experts": 0}, "e4 (expert parallel) needs an MoE model"),
    ("megatron:(attn:d2t1|ffn:d1t2)", {}, {"num_experts": 4}, "expert tensor parallel t2 differs from the attention's t1"),
])
def test_megatron_rules(spec, options, model_info, fragment):
    p = one_problem(ClusterSpec(1, 8), [mesh("m", spec, options=options, model_info=model_info)])
    assert fragment in p.message


def test_valid_megatron_setups_pass():
    """Every rule above satisfied at once: placed, each mesh on its own devices, with no warning."""
    plan = place(ClusterSpec(1, 10), [
        mesh("a", "megatron:d1p2t2e2", options={"virtual_pipeline_model_parallel_size": 2, **SP},
             model_info={"num_layers": 8, "num_experts": 4}),
        mesh("b", "megatron:d4", options={"virtual_pipeline_model_parallel_size": 1}, model_info={"num_layers": 3}),
        mesh("c", "megatron:(attn:d1t2|ffn:d1t1e2)", options=SP, model_info={"num_experts": 4}),
    ])
    assert {name: m.devices for name, m in plan.meshes.items()} == {"a": [0, 1, 2, 3], "b": [4, 5, 6, 7], "c": [8, 9]}
    assert plan.devices_used == 10 and plan.warnings == []


def test_cpu_refuses_context_parallel_and_grouped_gemm():
    reqs = [mesh("cp", "megatron:d2c2"), mesh("moe", "megatron:d2e2", options={"moe_grouped_gemm": True})]
    cp, gg = problems_of(ClusterSpec(1, 8, "cpu"), reqs)
    assert cp.path == ("meshes", "cp") and "context parallel (c2) needs CUDA (TransformerEngine" in cp.message
    assert "use a cuda cluster or set c1" in cp.message
    assert gg.path == ("meshes", "moe", "options", "moe_grouped_gemm")
    assert "needs CUDA (grouped_gemm" in gg.message and "moe_grouped_gemm: false" in gg.message
    place(ClusterSpec(1, 8, "cuda"), reqs)


def test_all_problems_at_once():
    problems = problems_of(ClusterSpec(1, 4, "cpu"), [
        mesh("a", "megatron:d2c2", options={"tensor_model_parallel_size": 2}),
        mesh("b", "vllm:d4", colocate_with="nope"),
        mesh("c", "megatron:d8"),
    ])
    text = "\n".join(str(p) for p in problems)
    for fragment in ["'nope' is not a mesh", "the pipeline needs 16 devices", "tensor_model_parallel_size=2",
                     "context parallel (c2) needs CUDA"]:
        assert fragment in text


def test_json_and_table():
    plan = place(ClusterSpec(2, 4), [mesh("rollout", "vllm:t2"), mesh("train", "megatron:d2t2", options=SP)])
    js = json.loads(json.dumps(plan.to_json()))
    assert js["devices_used"] == 6 and js["cluster"] == {"nodes": 2, "devices_per_node": 4, "device": "cuda"}
    train = js["meshes"][1]
    assert train["name"] == "train" and train["sizes"]["tp"] == 2 and train["devices"] == [2, 3, 4, 5]
    assert train["ranks"][2] == {"rank": 2, "machine": 1, "local_device": 0, "device": 4,
                                 "coords": {"tp": 0, "cp": 0, "dp": 1, "pp": 0, "etp": 0, "ep": 0, "edp": 1}}
    rows = plan.table().splitlines()
    machine0 = next(r for r in rows if r.strip().startswith("0 |"))
    machine1 = next(r for r in rows if r.strip().startswith("1 |"))
    assert machine0.split("|")[1].split() == ["rollout:0", "rollout:1", "train:0", "train:1"]
    assert machine1.split("|")[1].split() == ["train:2", "train:3", ".", "."]
