"""The node kinds of composed pipelines, as pure logic: templates, the judge's scores, reward_sum,
distillation's advantage; and their checks at the door."""

from __future__ import annotations

import textwrap

import pytest
import torch

from nodes import templates
from nodes.judge import _parser, _score
from pipeline_files import load, messages
from siirl_dag.kinds import resolve_kind
from siirl_dag.runtime.batch import Batch
from siirl_dag.runtime.context import NodeContext


class CharTokenizer:
    """Decodes ids as characters: enough for templates' row values."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


def test_a_template_renders_the_sample_fields_and_literal_braces():
    text = "Q: {prompt} A:{response} R: {ground_truth} {extra_info.a} \\boxed{{}}"
    assert templates.fields(text) == ["prompt", "response", "ground_truth", "extra_info.a"]
    assert templates.consumed(text) == ("raw_prompt", "responses", "response_mask", "ground_truth", "extra_info")
    batch = Batch({"responses": torch.tensor([[ord("4"), ord("2"), 0]]), "response_mask": torch.tensor([[1, 1, 0]])},
                  {"raw_prompt": [[{"role": "system", "content": "s"}, {"role": "user", "content": "6x7?"}]],
                   "ground_truth": ["42"], "extra_info": [{"a": 7}]})
    assert [templates.render(text, v) for v in templates.row_values(batch, CharTokenizer())] == \
        ["Q: 6x7? A:42 R: 42 7 \\boxed{}"]


@pytest.mark.parametrize("text, message", [
    ("{respons}", "unknown field '{respons}'"),
    ("{prompt.__class__}", "unknown field '{prompt.__class__}'"),
    ("{0}", "unknown field '{0}'"),
    ("a } b", "a lone '}' at character 2"),
    ("{prompt", "a lone '{' at character 0"),
    ("{extra_info.a.b}", "unknown field"),
])
def test_a_template_is_parsed_never_evaluated(text, message):
    with pytest.raises(ValueError, match="expected fields") as info:
        templates.parse(text)
    assert message in str(info.value)


@pytest.mark.parametrize("reply, score", [
    (" 1", 1.0), ("score: 0 of 1", 0.0), ("7.5", 7.5), ("no digits", None), ("", None),
    ("9" * 5000, None),  # a number too large for a float is no score, not an error
])
def test_the_judge_reads_the_score_from_its_reply(reply, score):
    parse = _parser({"score_pattern": r"(\d+(?:\.\d+)?)"})
    assert _score(parse, reply, {}) == score


def test_a_judge_parser_that_raises_gives_no_score():
    def broken(reply, fields):
        raise RuntimeError("boom")
    assert _score(broken, "1", {}) is None


def run_kind(name: str, params: dict, batch: Batch) -> tuple[dict, dict]:
    kind = resolve_kind(name)
    from siirl_dag.config.schema import validate

    validate(params, f"nodes/{kind.params_schema}.schema.json")  # fills defaults
    node = type("Node", (), {"id": name, "params": params, "options": {}})()
    ctx = NodeContext(node=node, batch=batch)
    return kind.fn(batch, ctx), ctx.metrics


def test_reward_sum_weighs_terms_token_by_token():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    rule = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    judge = torch.tensor([[0.0, 10.0, 0.0], [5.0, 0.0, 0.0]])
    out, metrics = run_kind("reward_sum", {"weights": {"rule": 1.0, "judge": 0.1}},
                            Batch({"rule": rule, "judge": judge, "response_mask": mask}))
    assert torch.allclose(out["token_level_rewards"], torch.tensor([[0.0, 2.0, 0.0], [0.5, 0.0, 0.0]]))
    assert metrics["reward_sum/total/mean"] == pytest.approx(1.25)


def test_distillation_advantage_is_the_negative_reverse_kl_per_token():
    mask = torch.tensor([[1, 1, 0]])
    old, teacher = torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-1.5, -1.0, 0.0]])
    out, metrics = run_kind("advantage", {"estimator": "none", "distill_coef": 2.0},
                            Batch({"old_logprobs": old, "teacher_logprobs": teacher, "response_mask": mask}, {"uid": ["a"]}))
    assert torch.allclose(out["advantages"], torch.tensor([[-1.0, 2.0, 0.0]]))
    assert metrics["distill/reverse_kl"] == pytest.approx((0.5 - 1.0) / 2)
    # added to a task advantage
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    batch = Batch({"old_logprobs": old.repeat(2, 1), "teacher_logprobs": teacher.repeat(2, 1),
                   "response_mask": mask.repeat(2, 1), "token_level_rewards": rewards}, {"uid": ["a", "a"]})
    task, _ = run_kind("advantage", {"estimator": "grpo"}, batch)
    both, _ = run_kind("advantage", {"estimator": "grpo", "distill_coef": 0.5}, batch)
    kl = (old - teacher) * mask
    assert torch.allclose(both["advantages"], task["advantages"] - 0.5 * kl.repeat(2, 1))


JUDGE = textwrap.dedent("""\
    name: j
    cluster: {nodes: 1, devices_per_node: 3, device: cpu}
    models:
      policy: {path: no/such/model, dtype: float32}
      judge: {path: no/such/judge, dtype: float32}
    data: {train_files: train.parquet, train_batch_size: 8}
    meshes: {gen: vllm:d1, judge: vllm:d1, train: megatron:d1}
    nodes:
      - {id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: actor_update, options: {n: 4}}
      - id: judge
        kind: judge
        deps: [rollout]
        mesh: judge
        model: judge
        params: {template: "{prompt}{response} R: {ground_truth} V:", score_pattern: "([01])"}
      - {id: advantage, kind: advantage, deps: [judge]}
      - {id: old, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {output: old_logprobs}}
      - {id: actor_update, kind: actor_update, deps: [advantage, old], mesh: train, model: policy, params: {mini_batch_size: 4}}
    trainer: {total_steps: 2}
    """)


def test_a_judge_pipeline_validates_and_the_judge_serves_the_policy(tmp_path):
    pipe = load(tmp_path, JUDGE)
    assert pipe.consumes("judge") == ("raw_prompt", "responses", "response_mask", "ground_truth")
    assert pipe.scorers == [("judge", "token_level_scores")] and pipe.policies == ("policy",)
    assert pipe.samples_per_prompt("judge") == 4


@pytest.mark.parametrize("override, message", [
    ("nodes.judge.params.score_pattern='(0)|(1)'", "the pattern has 2 groups; expected exactly one"),
    ("nodes.judge.params.score_pattern='([01'", "not a regular expression"),
    ("nodes.judge.params.score_parser=no_such_module:f", "cannot import module 'no_such_module'"),
    ("nodes.judge.params.template='{answer}'", "unknown field '{answer}'"),
    ("nodes.judge.options.n=2", "a judge replies once per sample, not 2 times; expected n: 1"),
    ("nodes.judge.options.load_format=dummy", "a judge loads its own weights"),
])
def test_a_judge_is_checked_at_the_door(tmp_path, override, message):
    assert message in messages(tmp_path, JUDGE, [override])


def test_a_judge_takes_no_weights(tmp_path):
    text = JUDGE.replace("    mesh: judge\n", "    mesh: judge\n    weights_from: actor_update\n")
    found = messages(tmp_path, text)
    assert "nodes[1].weights_from" in found and "expected a training node of model 'judge'" in found


def test_reward_sum_terms_must_be_bound(tmp_path):
    text = JUDGE.replace("  - {id: advantage, kind: advantage, deps: [judge]}",
                         "  - {id: total, kind: reward_sum, deps: [judge], params: {weights: {judge: 1.0}}}\n"
                         "  - {id: advantage, kind: advantage, deps: [total]}")
    found = messages(tmp_path, text)
    assert "'total' consumes 'judge' but no upstream node produces it; add a node that produces 'judge', or bind " \
           "it: inputs: {judge: NODE.KEY}" in found
    assert "'advantage' consumes 'token_level_rewards', produced by several upstream nodes (judge, total)" in found


def test_a_teacher_with_another_tokenizer_is_refused(tmp_path):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from make_tiny_model import make_tokenizer
    from transformers import Qwen2Tokenizer

    make_tokenizer().save_pretrained(tmp_path / "student")
    vocab = {tok: i for i, tok in enumerate(reversed(list(make_tokenizer().get_vocab())))}
    Qwen2Tokenizer(vocab=vocab, merges=[], eos_token="<eos>", pad_token="<pad>").save_pretrained(tmp_path / "teacher")
    text = textwrap.dedent(f"""\
        name: d
        cluster: {{nodes: 1, devices_per_node: 2, device: cpu}}
        models:
          student: {{path: no/such/model, tokenizer: {tmp_path / 'student'}, dtype: float32}}
          teacher: {{path: no/such/model, tokenizer: {tmp_path / 'teacher'}, dtype: float32}}
        data: {{train_files: train.parquet, train_batch_size: 8}}
        meshes: {{gen: vllm:d1, train: megatron:d1, teacher: {{alloc: "megatron:d1", colocate_with: train}}}}
        nodes:
          - {{id: rollout, kind: rollout, mesh: gen, model: student, weights_from: actor_update, options: {{n: 4}}}}
          - {{id: old, kind: logprob, deps: [rollout], mesh: train, model: student, params: {{output: old_logprobs}}}}
          - {{id: teacher, kind: logprob, deps: [rollout], mesh: teacher, model: teacher, params: {{output: teacher_logprobs}}}}
          - {{id: advantage, kind: advantage, deps: [old, teacher], params: {{estimator: none, distill_coef: 1.0}}}}
          - {{id: actor_update, kind: actor_update, deps: [advantage], mesh: train, model: student, params: {{mini_batch_size: 4}}}}
        trainer: {{total_steps: 2}}
        """)
    found = messages(tmp_path, text)
    assert "'teacher' computes on the token ids 'rollout' sampled with model 'student', but the tokenizers of " \
           "'student' and 'teacher' differ" in found
    assert ":11:" in found.split("'teacher' computes")[0].splitlines()[-1]  # at the teacher node's line
    same = text.replace(str(tmp_path / "teacher"), str(tmp_path / "student"))
    assert load(tmp_path, same).nodes["teacher"].params["output"] == "teacher_logprobs"


def test_distillation_alone_needs_a_coefficient(tmp_path):
    found = messages(tmp_path, JUDGE, ["nodes.advantage.params.estimator=none"])
    assert "estimator none and distill_coef 0 leave nothing to learn from" in found


def test_a_prompt_too_long_has_its_response_cut_to_fit():
    text, cut = templates.fitted("Q:{prompt} A:{response} F:", {"prompt": "1+1", "response": "abcdefgh"}, len, 14)
    assert (text, cut) == ("Q:1+1 A:abc F:", True)
    assert templates.fitted("Q:{prompt} A:{response} F:", {"prompt": "1+1", "response": "ab"}, len, 14) == \
        ("Q:1+1 A:ab F:", False)
    assert templates.fitted("Q:{prompt} A:{response} F:", {"prompt": "1+1" * 9, "response": "ab"}, len, 14) == (None, True)
