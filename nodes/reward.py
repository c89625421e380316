"""reward: rule-based scores per sample (by data source), placed on the last response token.

Rows of a user's agent (agent_rollout with agent, agent_command or env) carry the agent's own reward
(`agent_reward`, read when an upstream node holds it): a row takes it where the agent gave one; else
the scorer scores the episode's final answer, its last row, and every row of the episode takes that
score (an agent that rewrote its history has several rows, segments of one episode). `scorer: agent`
takes the agents' rewards only (a row without one scores 0, counted in reward/unscored)."""

from collections import Counter

from nodes.algos import scorers
from siirl_dag.errors import Problem
from siirl_dag.registry import node_kind

_BASE = ("responses", "response_mask", "prompt_mask", "data_source", "ground_truth")  # prompt_mask: metrics


def _consumes(params):
    return _BASE + (("old_logprobs", "ref_logprobs") if params.get("kl_coef", 0) > 0 else ())


def _custom_scorer(node, pipeline) -> list[Problem]:
    """A custom scorer must import now, not at the first step's reward."""
    if node.params["scorer"] == "agent":
        if "agent_reward" in pipeline.reads[node.id]:
            return []
        return [Problem(pipeline.node_path(node.id) + ("params", "scorer"), "scorer 'agent' takes the rewards an "
                        "agent returns, but no upstream node holds them; expected an agent_rollout with agent, "
                        "agent_command or env upstream, or scorer: auto")]
    if node.params["scorer"] == "auto":
        return []
    try:
        scorers.resolve_scorer(node.params["scorer"])
    except ValueError as exc:
        return [Problem(pipeline.node_path(node.id) + ("params", "scorer"), f"{exc}; expected an importable "
                        "function(data_source, solution_str, ground_truth, extra_info)")]
    return []


def _checks(node, pipeline) -> list[Problem]:
    return _custom_scorer(node, pipeline) + _buffer_fits(node, pipeline)


def _buffer_fits(node, pipeline) -> list[Problem]:
    """The overlong buffer lies inside the responses' length limit."""
    buffer, limit = node.params["overlong_buffer_len"], pipeline.data.max_response_length
    if buffer < limit:
        return []
    return [Problem(pipeline.node_path(node.id) + ("params", "overlong_buffer_len"), f"{buffer} tokens do not fit "
                    f"inside data.max_response_length = {limit}; expected 0 (off) to {limit - 1}")]


def _gradable(node, pipeline, data) -> list[str]:
    """With the built-in scorers, every data_source of the prompts needs one."""
    if node.params["scorer"] != "auto":
        return []
    unknown = Counter(r["data_source"] for r in data.rows if r["data_source"] not in scorers.SCORERS)
    return [f"{n} prompt(s) have data_source {source!r}, which no built-in scorer grades; expected one of "
            f"{', '.join(scorers.SCORERS)}, or a scorer of your own in params.scorer (module:function)"
            for source, n in sorted(unknown.items())]


@node_kind("reward", consumes=_consumes, produces=("token_level_scores", "token_level_rewards"),
           params_schema="reward", check=_checks, check_data=_gradable, reads_if_held=("agent_reward", "episode"))
def reward(batch, ctx):
    """Score decoded responses; DAPO's overlong penalty and a KL-in-reward penalty, when on, turn
    scores into rewards."""
    import torch

    from nodes.algos.metrics import batch_metrics
    from nodes.algos.token_rewards import apply_kl_penalty, overlong_penalty, place_scores

    p = ctx.params
    scores = _scores(batch, ctx, p)
    token_scores = place_scores(torch.tensor(scores, dtype=torch.float32), batch["response_mask"])
    rewards = token_scores
    if p["overlong_buffer_len"]:  # on the rewards: the scores stay the task's accuracy
        penalty = overlong_penalty(batch["response_mask"], ctx.data.max_response_length, p["overlong_buffer_len"],
                                   p["overlong_penalty_factor"])
        rewards = token_scores + place_scores(penalty, batch["response_mask"])
        ctx.metrics["reward/overlong_penalty"] = penalty.mean().item()
    if p["kl_coef"] > 0:
        rewards, kl = apply_kl_penalty(rewards, batch["old_logprobs"], batch["ref_logprobs"],
                                       batch["response_mask"], p["kl_coef"], p["kl_estimator"])
        ctx.metrics["critic/kl"] = kl
    out = {"token_level_scores": token_scores, "token_level_rewards": rewards}
    ctx.metrics.update(batch_metrics({**out, "response_mask": batch["response_mask"], "prompt_mask": batch["prompt_mask"]}))
    return out


def _scores(batch, ctx, p) -> list[float]:
    """Each row's score: the agent's where it gave one, else its episode's final answer scored (every row
    its own episode without agents)."""
    rows = batch["responses"].shape[0]
    agent = batch["agent_reward"].tolist() if "agent_reward" in batch else [float("nan")] * rows
    episodes = batch["episode"] if "episode" in batch else range(rows)
    final = {e: i for i, e in enumerate(episodes)}  # an episode's last row holds its final answer
    wanted = sorted({final[e] for e, given in zip(episodes, agent) if given != given})  # NaN: the agent gave none
    if p["scorer"] == "agent":
        ctx.metrics["reward/unscored"] = float(len(wanted))
        scored = dict.fromkeys(wanted, 0.0)
    else:
        scored = dict(zip(wanted, _scored_texts(batch, ctx, p, wanted)))
    if "agent_reward" in batch:
        ctx.metrics["reward/from_agent"] = sum(given == given for given in agent) / max(rows, 1)
    return [given if given == given else scored[final[e]] for e, given in zip(episodes, agent)]


def _scored_texts(batch, ctx, p, rows: list[int]) -> list[float]:
    scorer = scorers.score if p["scorer"] == "auto" else scorers.resolve_scorer(p["scorer"])
    responses, masks = batch["responses"].tolist(), batch["response_mask"].tolist()  # lists: no tensor op per row
    texts = ctx.tokenizer.batch_decode([[t for t, m in zip(responses[i], masks[i]) if m] for i in rows],
                                       skip_special_tokens=True)
    extra = batch.get("extra_info") or [None] * len(responses)
    kwargs = {"method": p["method"], "format_score": p["format_score"]} if p["scorer"] == "auto" else {}
    return [float(scorer(batch["data_source"][i], text, batch["ground_truth"][i], extra[i], **kwargs))
            for i, text in zip(rows, texts)]
