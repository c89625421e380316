"""Built-in node kinds. Importing this package registers them (one line per kind)."""

from nodes import (actor_update, advantage, agent_rollout, critic, filter_groups, judge, logprob, reward,  # noqa: F401
                   reward_sum, rollout)
