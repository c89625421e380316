"""Built-in node kinds. Importing this package registers them (one line per kind)."""

from nodes import actor_update, advantage, critic, logprob, reward, rollout  # noqa: F401
