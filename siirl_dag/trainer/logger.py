"""Metrics to the console and TensorBoard, with a progress bar (step, score, ETA)."""

from __future__ import annotations

from tqdm import tqdm

from siirl_dag.console import terminal

_CONSOLE_KEYS = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean",
                 "timing_s/step", "perf/throughput")


class MetricsLogger:
    def __init__(self, backends: tuple[str, ...], tensorboard_dir: str, total_steps: int, start_step: int = 0):
        self.console = "console" in backends
        self.writer = None
        if "tensorboard" in backends:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(tensorboard_dir)
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=terminal(),
                        dynamic_ncols=True, disable=not self.console)

    def log(self, step: int, metrics: dict, advance: bool = True) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        if self.writer:
            for key, value in numbers.items():
                self.writer.add_scalar(key, value, step)
            self.writer.flush()
        if advance:
            self.bar.update(1)
            scores = [v for k, v in numbers.items() if k.endswith("critic/score/mean")]
            if scores:
                self.bar.set_postfix(score="/".join(f"{v:.3f}" for v in scores))
        if self.console:
            # verl's names, each under every policy's prefix when several train (`<policy>/actor/pg_loss`)
            shown = {k: v for k, v in numbers.items() if k.endswith(_CONSOLE_KEYS) or "val-core/" in k}
            self.bar.write(f"step {step}: " + "  ".join(f"{k}={v:.4g}" for k, v in shown.items()), file=terminal())

    def close(self) -> None:
        self.bar.close()
        if self.writer:
            self.writer.close()
