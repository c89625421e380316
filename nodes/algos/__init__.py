"""Algorithm functions (pure torch): rewards, advantages, losses, metrics. Node kinds call these."""
