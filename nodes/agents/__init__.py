"""The user's own agents in an agent_rollout: an OpenAI-compatible endpoint served from the rollout's
engine (server.py, service.py, openai_api.py), token-faithful episodes (episode.py), the agents run
per episode (runners.py), and the rollout that ties them together (rollout.py, rows.py)."""

FAILED, TIMEOUTS = "agent/failed", "agent/timeouts"  # episodes lost (rows.metrics): on the console's line of each step too
