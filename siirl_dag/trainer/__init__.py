"""The training job around the runtime: data, steps, validation, checkpoints, logging."""
