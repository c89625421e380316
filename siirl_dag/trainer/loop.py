"""The training job: data -> DAG step -> weight sync -> logging, validation and checkpoints.

Generic over algorithms: the DAG (nodes/ + the YAML) decides what a step computes; this loop only
feeds prompts, counts steps and keeps the run resumable.
"""

from __future__ import annotations

import time
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

from siirl_dag.data import PromptDataset, PromptLoader
from siirl_dag.errors import ConfigError, PipelineError, Problem
from siirl_dag.trainer import checkpoint, in_flight, schedules, timings, trackers, trajectories
from siirl_dag.trainer.logger import MetricsLogger
from siirl_dag.trainer.resume import Resume

if TYPE_CHECKING:  # the runtime (torch, Ray) loads at `fit`: the checks at construction need neither
    from siirl_dag.runtime import Batch


def _source(rows: list[dict], epoch_tag: str = "") -> Batch:
    """Data-loader rows -> the batch every step starts from (keys: dataflow.SOURCE_KEYS)."""
    from siirl_dag.runtime import Batch

    return Batch(meta={"raw_prompt": [r["raw_prompt"] for r in rows], "uid": [f"{epoch_tag}{r['index']}" for r in rows],
                       "data_source": [r["data_source"] for r in rows], "ground_truth": [r["ground_truth"] for r in rows],
                       "extra_info": [r["extra_info"] for r in rows]})


def _last_line(exc: BaseException) -> str:
    """An engine error in one line: torch's CheckpointException carries each rank's traceback."""
    cause = getattr(exc, "cause", None) or exc  # Ray wraps the engine's exception
    lines = str(cause).strip().splitlines() or [""]
    return f"{type(cause).__name__}: {lines[-1]}"


def _union_length(spans) -> float:
    """Seconds during which at least one node was running."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        total += max(0.0, b - max(a, end))
        end = max(end, b)
    return total


class Trainer:
    def __init__(self, pipe, address: str | None = None, progress=print):
        self.pipe, self.address, self.progress = pipe, address, progress
        t, d = pipe.trainer, pipe.data
        self.project, self.experiment = t.project_name or pipe.name, t.experiment_name or "default"
        self.out_dir = pipe.out_dir
        self.ckpt_dir = Path(t.default_local_dir or self.out_dir / "checkpoints")
        self.tb_dir = t.tensorboard_dir or str(self.out_dir / "tensorboard")
        self.log_dir = Path(t.log_dir or self.out_dir / "logs")  # each run logs into a folder of its own there
        # bad data is bad input: checked here, before any process starts, located in the pipeline file
        try:
            self.train_data = PromptDataset(list(d.train_files), d.prompt_key, config_path=("data", "train_files"))
            self.val_data = PromptDataset(list(d.val_files), d.prompt_key, config_path=("data", "val_files")) if d.val_files else None
        except ConfigError as exc:
            raise pipe.located(exc.problems) from None
        if d.filter_overlong_prompts:
            self._drop_overlong_prompts()
        problems = self._node_data_problems()
        if problems:
            raise pipe.located(problems)
        try:
            self.loader = PromptLoader(self.train_data, d.train_batch_size, seed=d.seed, shuffle=d.shuffle)
        except ConfigError as exc:
            raise pipe.error(("data", "train_batch_size"), exc.problems[0].message) from None
        self.total_steps = t.total_steps or t.total_epochs * len(self.loader)
        self.trainers = [n for n in pipe.nodes if pipe.kinds[n].trains]
        self.mesh_devices = {m: set(p.devices) for m, p in pipe.plan.meshes.items()}
        self.models = {n: checkpoint.model_identity(pipe.models[m].hf_config(), pipe.models[m].lora)
                       for n in self.trainers for m in [pipe.nodes[n].model]}
        # a bad checkpoint, or one this run would overwrite, is bad input: refused before any process starts
        self.resume = Resume(pipe, self.ckpt_dir, self.trainers, self.models, self.loader)
        self.step = self.resume.step  # steps trained; the next is self.step + 1 (runtime.step numbers them)
        self.schedule: schedules.Schedule | None = None  # runtime.schedule's, from `fit`
        self.generations: list[dict] = []  # the last validation's samples for the trackers (trainer.log_val_generations)

    def _drop_overlong_prompts(self) -> None:
        """data.filter_overlong_prompts: leave out the prompts longer than data.max_prompt_length as
        a node that generates from them counts their tokens, saying how many; none left is an error."""
        limit = self.pipe.data.max_prompt_length
        for key, data in (("train_files", self.train_data), ("val_files", self.val_data)):
            for node in self.pipe.nodes.values():
                measure = self.pipe.kinds[node.id].prompt_lengths
                if not (measure and data):
                    continue
                try:
                    over = {row["index"] for row, n in zip(data.rows, measure(node, self.pipe, data)) if n > limit}
                except ConfigError as exc:  # what it needs is bad itself (a tokenizer that does not load)
                    raise self.pipe.located(exc.problems) from None
                if over:
                    self.progress(f"[data] data.{key}: left out {len(over)} of {len(data)} prompts longer than "
                                  f"data.max_prompt_length = {limit} tokens (as node '{node.id}' counts them)")
                    data.drop(over)
                if not len(data):
                    raise self.pipe.error(("data", key), f"every prompt is longer than data.max_prompt_length = {limit} "
                                                         f"tokens (as node '{node.id}' counts them); expected some "
                                                         "shorter: raise data.max_prompt_length")

    def _node_data_problems(self) -> list[Problem]:
        """What the node kinds find wrong with the prompts (a data_source no scorer grades, say)."""
        problems = []
        for node in self.pipe.nodes.values():
            check = self.pipe.kinds[node.id].check_data
            for key, data in (("train_files", self.train_data), ("val_files", self.val_data)):
                if not (check and data):
                    continue
                try:
                    problems += [Problem(("data", key), f"node '{node.id}': {message}")
                                 for message in check(node, self.pipe, data)]
                except ConfigError as exc:  # what the check needs is bad itself (a tokenizer that does not load)
                    problems += [p for p in exc.problems if p not in problems]
        return problems

    @property
    def finished(self) -> bool:
        """The checkpoint the run resumes from is at its last step: nothing to train (a validation-only
        run validates it all the same)."""
        return bool(self.resume.path) and self.step >= self.total_steps and not self.pipe.trainer.val_only

    # -- the run --------------------------------------------------------------------------------
    def fit(self, log_dir: Path | None = None) -> dict:
        """Train to trainer.total_steps (trainer.val_only: validate once instead); `log_dir`: the folder
        every process of the run logs to (None: as is)."""
        if self.finished:
            self.progress(f"[trainer] {self.resume.path} is at step {self.step} of {self.total_steps}: nothing to train. "
                          "Raise trainer.total_steps to continue, or start afresh with a new trainer.experiment_name.")
            return {"steps": {}}
        from siirl_dag.runtime import Runtime

        restore = self._restore_engines if self.resume.path else None
        with Runtime(self.pipe, self.address, self.progress, on_built=restore, log_dir=log_dir) as rt:
            self.rt = rt
            self.schedule = schedules.make(self.pipe, rt, self.step, self.total_steps,
                                           in_flight.generated(self.resume.in_flight))
            run = trackers.RunInfo(self.project, self.experiment, self.out_dir, self.tb_dir, self.pipe.file,
                                   trackers.resolved(self.pipe), self.step, resumed=self.resume.path is not None)
            last = self.step if self.pipe.trainer.val_only else self.total_steps
            log = MetricsLogger(self.pipe.trainer.logger, self.tb_dir, last, self.step, run, self.progress, self._shown())
            history: dict = {"steps": {}}
            try:
                t = self.pipe.trainer
                if t.val_only:  # the weights as given, or as the checkpoint left them (restored at the start)
                    history["val_only"] = self.validate()
                    log.log(self.step, history["val_only"], advance=False, generations=self._generations())
                    return history
                if self.val_data and t.val_before_train and self.step == 0:
                    history["val_before"] = self.validate()
                    log.log(0, history["val_before"], advance=False, generations=self._generations())
                while self.step < self.total_steps:
                    metrics = self.train_step()
                    self.step += 1
                    last = self.step == self.total_steps
                    validating = self.val_data and ((t.test_freq > 0 and self.step % t.test_freq == 0) or last)
                    saving = (t.save_freq > 0 and self.step % t.save_freq == 0) or last
                    if validating or saving:  # the rollouts on the trainer's latest weights
                        metrics.update(self.schedule.drain(self._next_source))
                    if validating:
                        metrics.update(self.validate())
                        history["val_last"] = {k: v for k, v in metrics.items() if "val-core/" in k}
                    if saving:
                        self.progress(f"[trainer] step {self.step}: saving a checkpoint ...")
                        began, wall = time.perf_counter(), time.time()
                        saved = self.save()
                        metrics["timing_s/save_checkpoint"] = time.perf_counter() - began
                        if rt.trace is not None:
                            rt.trace.driver("save checkpoint", wall, step=self.step, folder=str(saved))
                        self.progress(f"[trainer] step {self.step}: saved {saved} in {metrics['timing_s/save_checkpoint']:.1f} s")
                    log.log(self.step, metrics, generations=self._generations())
                    history["steps"][self.step] = metrics
                if t.export_hf and self.trainers:
                    self.export_hf(saved)  # the last step is always saved
                timings.write(self.out_dir, self.pipe, history["steps"])  # for `plan`'s time per mesh
            finally:
                log.close()
                if rt.trace is not None:  # beside the run's logs (with --verbose: in its output folder)
                    written = rt.trace.write((log_dir or self.out_dir) / "trace.json")
                    self.progress(f"[trainer] timeline of the run: {written} (Perfetto, chrome://tracing)")
            return history

    def _next_source(self, step: int) -> Batch:
        """The prompts of the next batch of the loader, for `step` (the trace says which)."""
        tag, began = f"e{self.loader.state_dict()['epoch']}-", time.time()
        source = _source(self.loader.next_batch(), tag)
        if self.rt.trace is not None:
            self.rt.trace.driver("load data", began, step=step, prompts=source.num_rows)
        return source

    def train_step(self) -> dict:
        """One step of the schedule, with the step's timing, idle time and throughput."""
        t0 = time.perf_counter()
        epoch = self.loader.state_dict()["epoch"]
        outcome = self.schedule.step(self._next_source)
        result, metrics = outcome.result, outcome.metrics
        metrics.update(result.metrics)
        end = time.perf_counter()
        elapsed = metrics["timing_s/step"] = end - t0
        # this step's share of each node run (of work run ahead too), by mesh
        spans = [(self.pipe.nodes[s.node].mesh, (max(s.start, t0), min(s.end, end))) for s in outcome.spans]
        devices = self.mesh_devices
        for mesh in self.pipe.meshes:  # its devices waiting, for the other side (what one_step_off and async overlap)
            on_devices = [span for m, span in spans if m and devices[m] & devices[mesh]]
            metrics[f"timing_s/idle/{mesh}"] = max(elapsed - _union_length(on_devices), 0.0)
        busy = _union_length(span for _, span in spans)
        metrics["timing_s/engine_overhead"] = max(elapsed - busy - metrics.get("timing_s/sync_weights", 0.0), 0.0)
        tokens = max((int(o.tokens.sum()) for o in result.outputs.values()), default=0)
        metrics["perf/throughput"] = tokens / elapsed / self.pipe.cluster.total
        metrics["training/epoch"] = epoch
        return metrics

    def _shown(self) -> tuple[str, ...]:
        """The node kinds' metrics the console's line shows (registry `shown`: episodes lost, say)."""
        return tuple(dict.fromkeys(key for kind in self.pipe.kinds.values() for key in kind.shown))

    def validate(self) -> dict:
        """Rollouts over the validation set (one per prompt, at the rollout's val_temperature); each scorer's
        (dataflow.scorers) mean score per data source, under its policy's prefix when several train; and the
        node kinds' shown metrics of those rollouts, summed over its batches, as val-aux/KEY (a validation's
        lost episodes score 0: this says how many there were)."""
        pipe, scorers = self.pipe, self.pipe.scorers
        if not scorers:
            return {}
        import networkx as nx

        wanted, began = set().union(*({s} | nx.ancestors(pipe.graph, s) for s, _ in scorers)), time.time()
        size = pipe.data.val_batch_size or len(self.val_data)
        per_source, to_log, to_show = defaultdict(list), pipe.trainer.log_trajectories, pipe.trainer.log_val_generations
        aux, shown = defaultdict(float), self._shown()
        self.generations = []
        for start in range(0, len(self.val_data), size):
            rows = [self.val_data[i] for i in range(start, min(start + size, len(self.val_data)))]
            result = self.rt.run_step(_source(rows, "val-"), self.step, validating=True, nodes=wanted)
            for key, value in result.metrics.items():
                if key.endswith(shown):
                    aux[f"val-aux/{key}"] += value
            for i, (node, key) in enumerate(scorers):
                scored = result.outputs[node]
                samples = (to_log or to_show) and i == 0  # the first scorer's trajectories and samples
                keys = ["data_source", *(trajectories.KEYS if samples else ())]
                batch = self.rt.gather(scored, [key]).merge(self.rt.collect(result, keys, rows=scored.rows))
                for src, score in zip(batch["data_source"], batch[key].sum(dim=-1).tolist()):
                    per_source[pipe.metric_prefix(node), src].append(score)
                if samples:
                    lines = trajectories.lines(batch, key, self._response_tokenizer(), self.step, max(to_log, to_show))
                    if to_log:
                        trajectories.append(self.out_dir / "trajectories.jsonl", lines[:to_log])
                        to_log -= len(lines[:to_log])
                    self.generations += [trajectories.generation(line) for line in lines[:to_show]]
                    to_show -= len(lines[:to_show])
        if self.rt.trace is not None:
            self.rt.trace.driver("validation", began, step=self.step, prompts=len(self.val_data))
        return {**{f"{prefix}val-core/{src}/acc": sum(v) / len(v) for (prefix, src), v in per_source.items()}, **aux}

    def _generations(self) -> list[dict]:
        """The samples of the validation just run, handed to the trackers once."""
        taken, self.generations = self.generations, []
        return taken

    def _response_tokenizer(self):
        """The tokenizer of the model that writes `responses` (ModelSpec loads it once per process)."""
        writer = next(n for n in self.pipe.nodes.values() if "responses" in self.pipe.produces(n.id))
        return self.pipe.models[writer.model].load_tokenizer()

    # -- checkpoints ----------------------------------------------------------------------------
    def save(self) -> Path:
        from siirl_dag.runtime.worker import RankWorker

        state = {"step": self.step, "loader": self.loader.state_dict(), "versions": self.rt.versions.trainer,
                 "synced": self.rt.versions.held, "models": self.models, "in_flight": []}

        def write_engines(folder: Path) -> None:
            queue = self.schedule.in_flight() if self.schedule else []
            if queue:
                state["in_flight"] = in_flight.save(folder, queue, self.rt.backend.fetch)
            for node in self.trainers:
                self.rt.engine_call(node, RankWorker.save_checkpoint, str((folder / node).resolve()))
                if self.pipe.models[self.pipe.nodes[node].model].lora:  # the adapters, as vLLM and peft load them
                    self.rt.engine_call(node, RankWorker.save_adapters, str((folder / f"{node}.lora").resolve()))

        return checkpoint.save(self.ckpt_dir, self.step, state, write_engines, self.pipe.trainer.max_ckpt_to_keep)

    def _restore_engines(self, rt) -> None:
        """The engines' side of a resume, run by Runtime.start before its weight sync (which then brings
        the rollouts to the checkpoint's versions); what only the engines can see (a truncated shard)
        fails as one line."""
        from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

        from siirl_dag.runtime.worker import RankWorker

        path = self.resume.path
        for node in self.trainers:
            folder = (path / node).resolve()
            try:
                rt.engine_call(node, RankWorker.load_checkpoint, str(folder))
            except (Exception, CheckpointException) as exc:  # noqa: BLE001 - a checkpoint the engine cannot load
                raise PipelineError(f"resuming from {path}: node '{node}' could not load {folder} ({_last_line(exc)}); "
                                    "expected an intact checkpoint of this model: remove it (auto resumes from the "
                                    "newest complete one) or name another with trainer.resume_from_path") from None
        rt.versions.trainer.update(self.resume.state["versions"])
        self.progress(f"[trainer] resumed from {path} at step {self.step}")

    def export_hf(self, checkpoint_folder: Path) -> None:
        """Into the final step's checkpoint folder (as verl does), as <node>.hf beside the node's engine
        checkpoint (no node id has a dot): the folder is this run's alone, so two runs never export
        over each other, and the export sits beside the state it came from."""
        from siirl_dag.runtime.worker import RankWorker

        for node in self.trainers:
            folder = (checkpoint_folder / f"{node}.hf").resolve()
            self.rt.engine_call(node, RankWorker.save_hf, str(folder))
            self.progress(f"[trainer] exported {node} as Hugging Face safetensors to {folder}")
