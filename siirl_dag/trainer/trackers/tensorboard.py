"""TensorBoard: scalars under the metrics' own names, the pipeline YAML as text, validation samples as a
markdown table of text (its TEXT tab)."""

from __future__ import annotations

from pathlib import Path

from siirl_dag.trainer.trackers import GENERATION_COLUMNS, RunInfo, Tracker


def _cell(value) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", "<br>")


def markdown_table(rows: list[dict], columns=GENERATION_COLUMNS) -> str:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c, "")) for c in columns) + " |" for row in rows]
    return "\n".join(lines)


class TensorBoard(Tracker):
    def __init__(self, run: RunInfo):
        super().__init__(run)
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(run.tensorboard_dir)
        if run.pipeline_file and Path(run.pipeline_file).is_file():
            text = Path(run.pipeline_file).read_text(encoding="utf-8", errors="replace")
            self.writer.add_text("config/pipeline", "    " + text.replace("\n", "\n    "), run.start_step)
            self.writer.flush()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_generations(self, step: int, rows: list[dict]) -> None:
        self.writer.add_text("val/generations", markdown_table(rows), step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()
