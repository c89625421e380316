"""Built-in node kinds. Importing this package registers them (one line per kind)."""

from nodes import actor_update, advantage, critic, filter_groups, logprob, reward, rollout  # noqa: F401
