"""Bindings (`inputs: {KEY: NODE.KEY}`), rows across branches, and names when several policies train."""

from __future__ import annotations

import json
import textwrap

import pytest

from pipeline_files import errors, line_of, load, messages
from siirl_dag.runtime.batch import Batch

BRANCH = """\
  - {{id: rollout{s}, kind: rollout, mesh: gen{s}, model: policy{s}, weights_from: update{s}, options: {{n: {n}}}}}
  - {{id: reward{s}, kind: reward, deps: [rollout{s}]}}
  - {{id: advantage{s}, kind: advantage, deps: [reward{s}]}}
  - {{id: old{s}, kind: logprob, deps: [rollout{s}], mesh: train{s}, model: policy{s}, params: {{output: old_logprobs}}}}
  - {{id: update{s}, kind: actor_update, deps: [advantage{s}, old{s}], mesh: train{s}, model: policy{s}, params: {{mini_batch_size: 4}}}}
"""


def two_branches(extra: str = "", n_b: int = 4, trainer: str = "{total_steps: 2}") -> str:
    """Two GRPO branches, each policy on meshes of its own, plus `extra` node lines."""
    return textwrap.dedent("""\
        name: two
        cluster: {nodes: 1, devices_per_node: 4, device: cpu}
        models:
          policy: {path: no/such/model, dtype: float32}
          policy_b: {path: no/such/model, dtype: float32}
        data: {train_files: train.parquet, train_batch_size: 8}
        meshes: {gen: vllm:d1, train: megatron:d1, gen_b: vllm:d1, train_b: megatron:d1}
        nodes:
        """) + BRANCH.format(s="", n=4) + BRANCH.format(s="_b", n=n_b) + extra + f"trainer: {trainer}\n"


def test_two_policies_prefix_every_node_metric_with_the_policy_it_serves(tmp_path):
    pipe = load(tmp_path, two_branches())
    assert pipe.policies == ("policy", "policy_b")
    assert {n: pipe.metric_prefix(n) for n in pipe.nodes} == {
        "rollout": "policy/", "reward": "policy/", "advantage": "policy/", "old": "policy/", "update": "policy/",
        "rollout_b": "policy_b/", "reward_b": "policy_b/", "advantage_b": "policy_b/", "old_b": "policy_b/",
        "update_b": "policy_b/"}
    # one validation score per policy: each branch's reward
    assert sorted(pipe.scorers) == [("reward", "token_level_scores"), ("reward_b", "token_level_scores")]


def test_one_policy_keeps_verl_names(tmp_path):
    text = two_branches().split("  - {id: rollout_b")[0] + "trainer: {total_steps: 2}\n"
    pipe = load(tmp_path, text.replace("  policy_b: {path: no/such/model, dtype: float32}\n", ""))
    assert pipe.policies == ("policy",)
    assert {pipe.metric_prefix(n) for n in pipe.nodes} == {""}


def test_an_unbound_key_with_two_producers_is_refused_with_the_binding_that_fixes_it(tmp_path):
    text = two_branches("  - {id: both, kind: reward, deps: [rollout, rollout_b]}\n")
    found = errors(tmp_path, text)
    assert found, "expected an error"
    msg = str(found[0])
    assert msg.startswith(f"{tmp_path / 'p.yaml'}:{line_of(text, 'id: both')}:")
    assert "'both' consumes 'responses', produced by several upstream nodes (rollout, rollout_b)" in msg
    assert "inputs: {responses: rollout_b.responses}" in msg


def test_bindings_resolve_the_ambiguity_and_imply_the_dependency(tmp_path):
    bound = ("  - {id: both, kind: reward, inputs: {responses: rollout_b.responses, response_mask: rollout_b.response_mask,"
             " prompt_mask: rollout_b.prompt_mask}, deps: [rollout]}\n")
    pipe = load(tmp_path, two_branches(bound), ["trainer.val_score_key=[reward.token_level_scores, both.token_level_scores]"])
    assert pipe.graph.has_edge("rollout_b", "both") and pipe.graph.has_edge("rollout", "both")
    assert pipe.nodes["both"].deps == ("rollout", "rollout_b")  # what the scheduler waits for
    assert pipe.nodes["both"].inputs["responses"] == ("rollout_b", "responses")
    from siirl_dag.dataflow import producer
    from siirl_dag.visualize.diagram import edge_keys

    assert producer(pipe, "both", "responses") == ("rollout_b", "responses")
    assert "responses ← rollout_b.responses" in edge_keys(pipe, "rollout_b", "both")
    assert not any(k.startswith("responses") for k in edge_keys(pipe, "rollout", "both"))
    # the node reading policy_b's samples, and training neither, serves policy_b
    assert pipe.metric_prefix("both") == "policy_b/"


@pytest.mark.parametrize("value, message", [
    ("rollout_b", "'rollout_b' is not a binding; expected NODE.KEY"),
    ("rollout_c.responses", "unknown node 'rollout_c' in 'rollout_c.responses'; did you mean 'rollout_b'?"),
    ("rollout_b.respnses", "'rollout_b' does not produce 'respnses'; did you mean 'responses'?"),
    ("both.responses", "binds node 'both' to its own output"),
])
def test_a_bad_binding_is_named_at_its_line(tmp_path, value, message):
    text = two_branches(f"  - id: both\n    kind: reward\n    deps: [rollout]\n    inputs:\n      responses: {value}\n")
    found = errors(tmp_path, text)
    where = f"{tmp_path / 'p.yaml'}:{line_of(text, 'responses: ' + value)}:"
    assert any(str(p).startswith(where) and message in str(p) for p in found), [str(p) for p in found]


def test_binding_a_key_the_node_does_not_consume_gets_did_you_mean(tmp_path):
    text = two_branches("  - {id: both, kind: reward, deps: [rollout], inputs: {respnses: rollout_b.responses}}\n")
    msg = "\n".join(map(str, errors(tmp_path, text)))
    assert "'both' does not consume 'respnses'; did you mean 'responses'?" in msg
    assert "expected one of the keys kind 'reward' consumes: responses, response_mask" in msg


def test_a_binding_that_closes_a_loop_is_a_named_cycle(tmp_path):
    text = two_branches().replace("{id: advantage, kind: advantage, deps: [reward]}",
                                  "{id: advantage, kind: advantage, deps: [reward], inputs: {uid: update_b.uid}}")
    text = text.replace("{id: reward_b, kind: reward, deps: [rollout_b]}", "{id: reward_b, kind: reward, deps: [rollout_b, update]}")
    found = [str(p) for p in errors(tmp_path, text)]
    cycle = next(p for p in found if "dependency cycle" in p)
    for node in ("advantage", "update", "reward_b", "update_b"):
        assert node in cycle
    assert "'advantage' binds update_b.uid" in cycle


def test_rows_that_do_not_align_across_branches_are_refused(tmp_path):
    """policy_b samples 2 per prompt, policy 4: a node reading both cannot pair their rows."""
    bound = ("  - {id: both, kind: reward, inputs: {responses: rollout_b.responses, response_mask: rollout_b.response_mask,"
             " prompt_mask: rollout.prompt_mask}, deps: [rollout]}\n")
    msg = "\n".join(map(str, errors(tmp_path, two_branches(bound, n_b=2))))
    assert "'both' reads rows that do not align" in msg
    assert "'responses' from 'rollout_b' (2)" in msg and "'prompt_mask' from 'rollout' (4)" in msg


def test_a_rollout_answering_another_rollout_sees_its_rows(tmp_path):
    """Rows per prompt follow the row space: the second rollout (n=1) keeps the first's 4 per prompt."""
    pipe = load(tmp_path, two_branches())
    assert pipe.samples_per_prompt("update") == 4 and pipe.samples_per_prompt("update_b") == 4
    assert pipe.samples_per_prompt("rollout") == 1


def test_validation_scores_one_per_policy_or_a_named_one(tmp_path):
    text = two_branches("  - {id: extra, kind: reward, deps: [rollout]}\n")
    msg = "\n".join(map(str, errors(tmp_path, text)))
    assert "validation would score for policy 'policy' with each of reward.token_level_scores, " \
           "extra.token_level_scores; expected one: name it, e.g. val_score_key: reward.token_level_scores" in msg
    pipe = load(tmp_path, text, ["trainer.val_score_key=[extra.token_level_scores, reward_b.token_level_scores]"])
    assert pipe.scorers == [("extra", "token_level_scores"), ("reward_b", "token_level_scores")]
    msg = "\n".join(map(str, errors(tmp_path, text, ["trainer.val_score_key=rewrd.token_level_scores"])))
    assert "unknown node 'rewrd' in 'rewrd.token_level_scores'; did you mean 'reward'?" in msg


def test_plan_prints_bindings_and_policies(tmp_path, capsys):
    from siirl_dag.main import main

    bound = "  - {id: both, kind: reward, inputs: {responses: rollout_b.responses}, deps: [rollout_b]}\n"
    f = tmp_path / "p.yaml"
    f.write_text(two_branches(bound, trainer="{total_steps: 2, val_score_key: [reward.token_level_scores, reward_b.token_level_scores]}"))
    assert main(["plan", str(f)]) == 0
    out = capsys.readouterr().out
    assert "reads responses <- rollout_b.responses; metrics under 'policy_b/'" in out
    assert main(["plan", str(f), "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["policies"] == ["policy", "policy_b"]
    assert plan["nodes"]["both"]["inputs"] == {"responses": "rollout_b.responses"}


def test_batch_renamed_takes_a_key_under_two_names():
    import torch

    batch = Batch({"token_level_rewards": torch.ones(2, 3)}, {"uid": ["a", "b"]})
    out = batch.renamed([("token_level_rewards", "rule"), ("token_level_rewards", "token_level_rewards"), ("uid", "uid")])
    assert sorted(out) == ["rule", "token_level_rewards", "uid"] and out["rule"].shape == (2, 3)


def test_a_rank_assembles_bound_keys_under_the_names_it_reads():
    import torch

    from siirl_dag.runtime.worker import _assemble

    solver = Batch({"responses": torch.tensor([[1, 2], [3, 4]])}).to_wire()
    reviewer = Batch({"responses": torch.tensor([[5, 6], [7, 8]])}).to_wire()
    batch = _assemble([([("responses", "solver_answer")], [(0, 1, 2)]), ([("responses", "responses")], [(1, 1, 2)])],
                      (solver, reviewer))
    assert batch["solver_answer"].tolist() == [[3, 4]] and batch["responses"].tolist() == [[7, 8]]


def test_a_metric_two_nodes_write_is_never_lost():
    from types import SimpleNamespace

    from siirl_dag.runtime.dispatch import Runtime
    from siirl_dag.runtime.step import StepResult

    said = []
    rt = SimpleNamespace(pipe=SimpleNamespace(metric_prefix=lambda n: "solver/" if n != "other" else "reviewer/"),
                         said=set(), progress=said.append)
    result = StepResult()
    Runtime._add_metrics(rt, result, "reward", {"critic/score/mean": 0.5, "response_length/mean": 7.0})
    Runtime._add_metrics(rt, result, "advantage", {"response_length/mean": 7.0, "critic/advantages/mean": 0.0})
    Runtime._add_metrics(rt, result, "judge", {"critic/score/mean": 0.9})
    Runtime._add_metrics(rt, result, "judge", {"critic/score/mean": 0.8})  # a second segment: its own again
    Runtime._add_metrics(rt, result, "other", {"critic/score/mean": 0.1})
    assert result.metrics == {"solver/critic/score/mean": 0.5, "solver/response_length/mean": 7.0,
                              "solver/critic/advantages/mean": 0.0, "solver/judge/critic/score/mean": 0.8,
                              "reviewer/critic/score/mean": 0.1}
    assert said == ["[metrics] 'solver/critic/score/mean' is written by 'reward' and 'judge'; 'judge's is logged as "
                    "'solver/judge/critic/score/mean'"]


def test_from_a_node_reads_every_key_it_holds_there_and_depends_on_it(tmp_path):
    pipe = load(tmp_path, two_branches("  - {id: both, kind: reward, deps: [rollout], from: rollout_b}\n"),
                ["trainer.val_score_key=[reward.token_level_scores, both.token_level_scores]"])
    from siirl_dag.dataflow import producer, read_via_from
    from siirl_dag.visualize.diagram import edge_keys

    assert pipe.nodes["both"].deps == ("rollout", "rollout_b") and pipe.graph.has_edge("rollout_b", "both")
    assert {k: producer(pipe, "both", k)[0] for k in pipe.consumes("both")} == dict.fromkeys(pipe.consumes("both"), "rollout_b")
    assert pipe.reads["both"]["uid"] == ("rollout_b", "uid")  # the loader's keys too, in rollout_b's rows
    assert read_via_from(pipe, "both") == {"rollout_b": list(pipe.consumes("both"))}
    assert edge_keys(pipe, "rollout_b", "both")[0] == "from: responses" and not edge_keys(pipe, "rollout", "both")
    assert pipe.metric_prefix("both") == "policy_b/"


def test_inputs_win_over_from_and_earlier_from_entries_win_over_later(tmp_path):
    from siirl_dag.dataflow import producer

    extra = ("  - {id: both, kind: reward, from: [rollout_b, rollout], inputs: {responses: rollout.responses}}\n"
             "  - {id: first, kind: reward, from: [rollout, rollout_b]}\n")
    pipe = load(tmp_path, two_branches(extra), ["trainer.val_score_key=[reward.token_level_scores, reward_b.token_level_scores]"])
    assert producer(pipe, "both", "responses") == ("rollout", "responses")
    assert producer(pipe, "both", "response_mask") == ("rollout_b", "response_mask")
    assert producer(pipe, "first", "response_mask") == ("rollout", "response_mask")


def test_two_producers_and_no_binding_offer_the_from_line_too(tmp_path):
    msg = messages(tmp_path, two_branches("  - {id: both, kind: reward, deps: [rollout, rollout_b]}\n"))
    assert "say which with `from: rollout_b` (every key it reads that rollout_b holds) or " \
           "`inputs: {responses: rollout_b.responses}`" in msg


@pytest.mark.parametrize("value, needle, message", [
    ("rollout_c", "from: rollout_c", "unknown node 'rollout_c' in from; did you mean 'rollout_b'?"),
    ("both", "from: both", "node 'both' reads from itself"),
    ("reward_b", "from: reward_b", "'reward_b' produces none of the keys 'both' reads (responses, response_mask"),
    ("[rollout, reward_b]", "- reward_b", "'reward_b' produces none of the keys 'both' reads"),
])
def test_a_bad_from_is_named_at_its_line(tmp_path, value, needle, message):
    written = value if not value.startswith("[") else "\n" + "".join(f"      - {v}\n" for v in value[1:-1].split(", "))
    text = two_branches(f"  - id: both\n    kind: reward\n    deps: [rollout, rollout_b]\n    from: {written.rstrip()}\n")
    found = errors(tmp_path, text)
    where = f"{tmp_path / 'p.yaml'}:{line_of(text, needle)}:"
    assert any(str(p).startswith(where) and message in str(p) for p in found), [str(p) for p in found]


def test_a_from_that_produces_nothing_read_suggests_one_that_does(tmp_path):
    msg = messages(tmp_path, two_branches("  - {id: both, kind: reward, deps: [rollout_b], from: reward_b}\n"))
    assert "did you mean from: rollout_b?" in msg


def test_a_from_that_closes_a_loop_is_a_named_cycle_at_its_line(tmp_path):
    text = two_branches().replace("{id: rollout_b, kind: rollout,", "{id: rollout_b, kind: rollout, from: update_b,")
    cycle = next(str(p) for p in errors(tmp_path, text) if "dependency cycle" in str(p))
    assert cycle.startswith(f"{tmp_path / 'p.yaml'}:{line_of(text, 'from: update_b')}:")
    assert "'rollout_b' reads from update_b" in cycle and "not deps, inputs or from" in cycle


def test_plan_prints_what_a_node_reads_through_from(tmp_path, capsys):
    from siirl_dag.main import main

    f = tmp_path / "p.yaml"
    f.write_text(two_branches("  - {id: both, kind: reward, from: rollout_b, inputs: {response_mask: rollout_b.response_mask}}\n",
                              trainer="{total_steps: 2, val_score_key: [reward.token_level_scores, reward_b.token_level_scores]}"))
    assert main(["plan", str(f)]) == 0
    assert "reads from rollout_b: responses, prompt_mask, data_source, ground_truth; " \
           "reads response_mask <- rollout_b.response_mask" in capsys.readouterr().out
    assert main(["plan", str(f), "--json"]) == 0
    read = json.loads(capsys.readouterr().out)["nodes"]["both"]["from"]["rollout_b"]
    assert "responses" in read and "response_mask" not in read


def test_from_a_node_before_the_filter_where_another_holds_the_key_is_refused(tmp_path):
    """The filter hands its kept rows on as one batch: past it, a key has one producer before it."""
    text = textwrap.dedent("""\
        name: two
        cluster: {nodes: 1, devices_per_node: 3, device: cpu}
        models: {policy: {path: no/such/model, dtype: float32}, reviewer: {path: no/such/model, dtype: float32}}
        data: {train_files: train.parquet, train_batch_size: 8}
        meshes: {gen: vllm:d1, gen_b: vllm:d1, train: megatron:d1}
        nodes:
          - {id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: update, options: {n: 4}}
          - {id: review, kind: rollout, from: rollout, mesh: gen_b, model: reviewer, options: {n: 1},
             params: {prompt_template: "{prompt}{response} F:"}}
          - {id: reward, kind: reward, from: review}
          - {id: filter, kind: filter_groups, deps: [reward], params: {metric: token_level_scores}}
          - {id: advantage, kind: advantage, deps: [filter],
             from: rollout}
          - {id: update, kind: actor_update, from: [advantage, rollout], mesh: train, model: policy,
             params: {mini_batch_size: 8, old_logprobs: update}}
        trainer: {total_steps: 2}
        """)
    found = [str(p) for p in errors(tmp_path, text)]
    assert any(p.startswith(f"{tmp_path / 'p.yaml'}:{line_of(text, 'from: rollout}')}:") and
               "'rollout' runs before 'filter'" in p and "'response_mask' of 'rollout' and of review" in p for p in found), found
