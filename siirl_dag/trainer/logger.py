"""Metrics to the console (with a progress bar: step, score, ETA) and to the experiment trackers
`trainer.logger` names (trainer/trackers: TensorBoard, MLflow, W&B), under the names they were given.

A tracker that fails, at the start or mid-run (a server gone, a full disk), is reported once and left
out; the run and the other loggers go on. Each tracker's run id is kept in the run's output folder
(trackers/RECORD_FILE), so a run resumed from a checkpoint continues the same tracker run.
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from siirl_dag.console import terminal
from siirl_dag.trainer import trackers
from siirl_dag.trainer.trackers import RunInfo, Tracker

_CONSOLE_KEYS = ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean",
                 "timing_s/step", "perf/throughput")


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines() or [""]
    return f"{type(exc).__name__}: {lines[-1][:300]}"


def _say(line: str) -> None:
    print(line, file=terminal(), flush=True)


class MetricsLogger:
    def __init__(self, backends: tuple[str, ...], tensorboard_dir: str, total_steps: int, start_step: int = 0,
                 run: RunInfo | None = None, report=_say, shown: tuple[str, ...] = ()):
        """`shown`: the node kinds' metrics the console's line shows beside the trainer's."""
        self.console, self.report, self.shown = "console" in backends, report, _CONSOLE_KEYS + tuple(shown)
        self.run = run or RunInfo(project="default", experiment="default", out_dir=Path(tensorboard_dir).parent,
                                  tensorboard_dir=tensorboard_dir, start_step=start_step)
        self.trackers: dict[str, Tracker] = {}
        self.failed: dict[str, str] = {}  # tracker -> what failed, reported once
        records = trackers.read_records(self.run.out_dir)
        for name in backends:
            if name in trackers.TRACKERS:
                self._start(name, records.get(name, {}) if isinstance(records.get(name), dict) else {})
        kept = {name: r for name, t in self.trackers.items() if (r := t.record())}
        if kept:
            self._guard("writing its run id", lambda: trackers.write_records(self.run.out_dir, {**records, **kept}),
                        name="trackers.json")
        self.bar = tqdm(total=total_steps, initial=start_step, desc="train", unit="step", file=terminal(),
                        dynamic_ncols=True, disable=not self.console)

    def _start(self, name: str, previous: dict) -> None:
        run = RunInfo(**{**self.run.__dict__, "previous": previous})
        self._guard("starting", lambda: self.trackers.__setitem__(name, trackers.tracker_class(name)(run)), name=name)

    def _guard(self, what: str, call, name: str) -> bool:
        """Run one tracker's call; a failure is reported once and the tracker is left out from then on."""
        try:
            call()
            return True
        except Exception as exc:  # noqa: BLE001 - any tracker failure: a server gone, a full disk, a library bug
            self.trackers.pop(name, None)
            if name not in self.failed:
                self.failed[name] = _one_line(exc)
                others = ", ".join(["console"] * self.console + list(self.trackers)) or "none"
                self.report(f"[logger] {name} failed {what} ({self.failed[name]}); the run goes on without it "
                            f"(logging to: {others})")
            return False

    def log(self, step: int, metrics: dict, advance: bool = True, generations: list[dict] | None = None) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        for name, tracker in list(self.trackers.items()):
            if self._guard(f"at step {step}", lambda: tracker.log(step, numbers), name) and generations:
                self._guard(f"at step {step}", lambda: tracker.log_generations(step, generations), name)
        if advance:
            self.bar.update(1)
            scores = [v for k, v in numbers.items() if k.endswith("critic/score/mean")]
            if scores:
                self.bar.set_postfix(score="/".join(f"{v:.3f}" for v in scores))
        if self.console:
            # verl's names, each under every policy's prefix when several train (`<policy>/actor/pg_loss`)
            shown = {k: v for k, v in numbers.items() if k.endswith(self.shown) or "val-core/" in k}
            self.bar.write(f"step {step}: " + "  ".join(f"{k}={v:.4g}" for k, v in shown.items()), file=terminal())

    def close(self) -> None:
        self.bar.close()
        for name, tracker in list(self.trackers.items()):
            self._guard("closing", tracker.close, name)
        self.trackers.clear()
