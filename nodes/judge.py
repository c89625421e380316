"""judge: a frozen model grades each sample (a generative reward model, an LLM judge) on a vLLM
mesh of its own or colocated with another. Its prompt is a template over the sample's fields
(nodes/templates.py); its reply gives the score through a regular expression with one group or a
`module:function`. Writes token_level_scores as `reward` does, so it rewards alone or summed with
a rule reward (`reward_sum`). A reply without a score gets `default_score`, never an error."""

from __future__ import annotations

import math
import re

from nodes import templates
from siirl_dag.errors import Problem
from siirl_dag.refs import user_ref
from siirl_dag.registry import node_kind


def _consumes(params) -> tuple[str, ...]:
    needed = templates.consumed(params["template"])
    return needed + tuple(k for k in ("responses", "response_mask") if k not in needed)  # the scores' places


def _parser(params):
    """reply, fields -> float or None."""
    if params.get("score_parser"):
        return user_ref(params["score_parser"], "score parser", {})
    pattern = re.compile(params["score_pattern"])

    def by_pattern(reply: str, fields: dict):
        found = pattern.search(reply)
        return found.group(1) if found else None

    return by_pattern


def _score(parse, reply: str, fields: dict) -> float | None:
    """The parser's score as a finite float, or None (a parser that raises gives none too)."""
    try:
        value = float(parse(reply, fields))
    except Exception:  # noqa: BLE001 - a user's parser, a number too long or not a number: no score
        return None
    return value if math.isfinite(value) else None


def _checks(node, pipeline) -> list[Problem]:
    where, p = pipeline.node_path(node.id), node.params
    problems = []
    try:
        templates.parse(p["template"])
    except ValueError as exc:
        problems.append(Problem(where + ("params", "template"), str(exc)))
    if p.get("score_parser"):
        try:
            _parser(p)
        except LookupError as exc:
            problems.append(Problem(where + ("params", "score_parser"), f"{exc}; expected module:function(reply, fields)"))
    else:
        try:
            groups = re.compile(p["score_pattern"]).groups
            if groups != 1:
                problems.append(Problem(where + ("params", "score_pattern"), f"the pattern has {groups} groups; expected "
                                        "exactly one, around the score (e.g. 'score: (\\d+)')"))
        except re.error as exc:
            problems.append(Problem(where + ("params", "score_pattern"), f"not a regular expression ({exc}); expected "
                                    "one with one group around the score"))
    if node.weights_from:
        problems.append(Problem(where + ("weights_from",), "a judge is frozen and takes no weights; expected no weights_from"))
    if node.options["n"] != 1:
        problems.append(Problem(where + ("options", "n"), f"a judge replies once per sample, not {node.options['n']} "
                                "times; expected n: 1"))
    if node.options["load_format"] != "auto":
        problems.append(Problem(where + ("options", "load_format"), "a judge loads its own weights (no trainer sends "
                                "any); expected load_format: auto"))
    return problems


def _data_fields(node, pipeline, data) -> list[str]:
    return templates.missing_extra(node.params["template"], data)


@node_kind("judge", consumes=_consumes, produces=("token_level_scores", "token_level_rewards"), strategies=("vllm",),
           params_schema="judge", check=_checks, check_data=_data_fields)
def judge(batch, ctx):
    """One reply per sample; its score on the sample's last response token."""
    import torch

    from nodes.algos.token_rewards import place_scores

    p, engine = ctx.params, ctx.engine
    values = templates.row_values(batch, ctx.tokenizer)  # the samples' own tokenizer decodes them
    limit = engine.options["max_model_len"] or engine.llm.llm_engine.model_config.max_model_len
    reply_tokens = engine.options["max_tokens"] or ctx.data.max_response_length
    room = limit - reply_tokens
    built = templates.fitted_rows(p["template"], values, engine, room)
    prompts = [text for text, _ in built]
    fits = [i for i, text in enumerate(prompts) if text]
    judged = set(fits)
    replies = [""] * len(prompts)
    if fits:
        sampling = {"greedy": True} if p["greedy"] else {"seed": ctx.seed}
        out = engine.generate([prompts[i] for i in fits], sampling, room, reply_tokens)
        for i, ids, mask in zip(fits, out["responses"], out["response_mask"]):
            replies[i] = engine.tokenizer.decode(ids[mask.bool()].tolist(), skip_special_tokens=True)
    parse = _parser(p)
    scores = [_score(parse, reply, v) if i in judged else None for i, (reply, v) in enumerate(zip(replies, values))]
    failures = sum(1 for i, s in enumerate(scores) if s is None and i in judged)
    final = torch.tensor([p["default_score"] if s is None else s for s in scores], dtype=torch.float32)
    token_scores = place_scores(final, batch["response_mask"])
    ctx.metrics.update({"judge/score/mean": final.mean().item(), "judge/parse_failures": failures,
                        "judge/responses_cut": sum(cut for _, cut in built), "judge/overlong": len(prompts) - len(fits)})
    return {"token_level_scores": token_scores, "token_level_rewards": token_scores}
