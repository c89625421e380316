"""Finished episodes as training rows, and the rollout's agent/* metrics.

Training: each segment of an episode whose agent finished is a row, with the episode's reward; a lost
episode (failed, timed out) gives none, and a prompt left without rows is dropped from the step, as
DAPO's filter drops a group (agent/groups_dropped). Validation: one row per episode, the segment of its
latest turn (its final answer; EpisodeRecord.rows() puts it last), or for a lost one an empty response,
which scores as a wrong answer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from nodes.agents import FAILED, REFUSED, TIMEOUTS
from nodes.agents.rollout import Finished
from siirl_dag.strategies.samples import Sample


@dataclass
class Rows:
    prompts: list[list[int]] = field(default_factory=list)  # each row's prompt ids
    samples: list[Sample] = field(default_factory=list)  # each row's response (Sample.prompt_index: its row)
    index: list[int] = field(default_factory=list)  # the input row (prompt) each answers
    rewards: list[float] = field(default_factory=list)  # the agent's reward, NaN where it gave none
    episodes: list[str] = field(default_factory=list)  # "<uid>#<k>": the rows of one episode share it


def rows_of(finished: Finished, uids: list, n: int, validating: bool, empty_prompt: Any, eos: int) -> Rows:
    """`empty_prompt(i)`: prompt ids of input row i (for a lost episode's row in validation)."""
    out = Rows()
    for episode, outcome in zip(finished.episodes, finished.outcomes):
        i = episode.prompt_index
        segments = [(s.prompt_ids, s.ids, s.logprobs, s.finish_reason, s.mask) for s in episode.rows()] \
            if outcome.status == "ok" else []
        if validating:
            segments = segments[-1:] or [(empty_prompt(i), [eos], [0.0], "abort", [0])]
        for prompt, ids, logprobs, reason, mask in segments:
            out.samples.append(Sample(len(out.prompts), list(ids), list(logprobs), reason, list(mask)))
            out.prompts.append(list(prompt))
            out.index.append(i)
            out.rewards.append(math.nan if outcome.reward is None else outcome.reward)
            out.episodes.append(f"{uids[i]}#{episode.index % n}")
    return out


def lost_everything(finished: Finished) -> str:
    """The message of a rollout none of whose episodes gave a row."""
    counts = {s: sum(o.status == s for o in finished.outcomes) for s in ("failed", "timeout")}
    first = next((o.error for o in finished.outcomes if o.error), "every agent returned without a turn of the model's")
    refused = [e for e in finished.episodes if e.refused]
    told = (f"; {sum(e.refused for e in refused)} of their calls were refused, the first: {refused[0].first_refusal}"
            if refused else "")
    return (f"every episode of this rollout was lost ({counts['failed']} failed, {counts['timeout']} timed out, "
            f"{len(finished.outcomes) - sum(counts.values())} returned without a turn of the model's); the first: "
            f"{first}{told}")


def metrics(finished: Finished, rows: Rows, prompts: int, validating: bool) -> dict[str, float]:
    episodes, outcomes = finished.episodes, finished.outcomes
    count = max(len(episodes), 1)
    kept = [e for e, o in zip(episodes, outcomes) if o.status == "ok"]
    seconds = [s for e in episodes for s in e.endpoint_seconds]
    given = [o.reward for o in outcomes if o.status == "ok" and o.reward is not None]
    out = {"agent/turns/mean": sum(e.turns for e in episodes) / count,
           "agent/turns/max": float(max((e.turns for e in episodes), default=0)),
           "agent/segments/mean": sum(len(e.rows()) for e in kept) / max(len(kept), 1),
           "agent/tool_calls/mean": sum(e.tool_calls for e in episodes) / count,
           FAILED: float(sum(o.status != "ok" for o in outcomes)),
           TIMEOUTS: float(sum(o.status == "timeout" for o in outcomes)),
           "agent/prefix_breaks": float(sum(e.prefix_breaks for e in episodes)),
           "agent/calls_past_limits": float(sum(e.past_limits for e in episodes)),
           REFUSED: float(sum(e.refused for e in episodes)),
           "agent/endpoint_s/mean": sum(seconds) / len(seconds) if seconds else 0.0,
           "agent/sampling_overridden": float(sum(e.sampling_overridden for e in episodes)),
           "agent/in_flight/max": float(finished.peak_in_flight)}
    if given:
        out["agent/reward/mean"] = sum(given) / len(given)
    if not validating:
        out["agent/groups_dropped"] = float(prompts - len(set(rows.index)))
    numeric = {}
    for o in outcomes:
        for key, value in o.info.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                numeric.setdefault(key, []).append(float(value))
    out.update({f"agent/info/{key}/mean": sum(v) / len(v) for key, v in numeric.items()})
    return out
