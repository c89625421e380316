"""reward: rule-based scores per sample (by data source), placed on the last response token."""

from siirl_dag.registry import node_kind

_BASE = ("responses", "response_mask", "data_source", "ground_truth")


def _consumes(params):
    return _BASE + (("old_logprobs", "ref_logprobs") if params.get("kl_coef", 0) > 0 else ())


@node_kind("reward", consumes=_consumes, produces=("token_level_scores", "token_level_rewards"),
           params_schema="reward")
def reward(batch, ctx):
    """Score decoded responses; optional KL-in-reward penalty gives token_level_rewards."""
    from nodes.algos import scorers

    p = ctx.params
    scorer = scorers.resolve_scorer(p["scorer"]) if p["scorer"] != "auto" else scorers.score
    texts = ctx.tokenizer.batch_decode(batch["responses"] * batch["response_mask"], skip_special_tokens=True)
    extra = batch.get("extra_info") or [None] * len(texts)
    scores = [float(scorer(src, text, gt, info, mode=p["mode"], format_score=p["format_score"]))
              for src, text, gt, info in zip(batch["data_source"], texts, batch["ground_truth"], extra)]
    import torch

    token_scores = scorers.place_scores(torch.tensor(scores, dtype=torch.float32), batch["response_mask"])
    rewards = token_scores
    if p["kl_coef"] > 0:
        rewards, kl = scorers.apply_kl_penalty(token_scores, batch["old_logprobs"], batch["ref_logprobs"],
                                               batch["response_mask"], p["kl_coef"], p["kl_estimator"])
        ctx.metrics["actor/reward_kl_penalty"] = float(kl)
    return {"token_level_scores": token_scores, "token_level_rewards": rewards}
