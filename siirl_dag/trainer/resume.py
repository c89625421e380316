"""Where a run starts from, checked whole before any process starts.

A resume reads a checkpoint folder this trainer wrote: its state file, one engine folder per
training node, the model it was trained from and the data loader's position. What is wrong there
is bad input, located in the pipeline file. A run also refuses a checkpoint folder that holds
checkpoints other than its own history: saving would overwrite or prune them.
"""

from __future__ import annotations

from pathlib import Path

from siirl_dag.config import schedule
from siirl_dag.errors import ConfigError, Problem
from siirl_dag.trainer import checkpoint, in_flight

# The data setting behind each loader state field a resume compares: a change there is a setting to
# put back, not a damaged checkpoint.
_LOADER_KEYS = {"seed": ("data", "seed"), "shuffle": ("data", "shuffle"), "num_rows": ("data", "train_files")}


class Resume:
    """`path`: the checkpoint the run resumes from (None: a fresh run); `state`: its trainer state;
    `step`: where the run starts; `in_flight`: the batches it had generated ahead (`in_flight.read`).
    Positions `loader` as the checkpoint left it."""

    def __init__(self, pipe, ckpt_dir: Path, trainers: list[str], models: dict[str, dict], loader):
        self.pipe, self.ckpt_dir, self.trainers, self.models, self.loader = pipe, ckpt_dir, trainers, models, loader
        self.in_flight: list = []
        self.path = self._path()
        self.state = self._checked(self.path) if self.path else None
        self.step = self.state["step"] if self.state else 0
        if not pipe.trainer.val_only:  # a validation-only run saves nothing
            self._refuse_others_checkpoints()

    @property
    def key(self) -> tuple:
        """The setting that chose the checkpoint a resume reads."""
        mode = self.pipe.trainer.resume_mode
        return ("trainer", "resume_from_path") if mode == "resume_path" else ("trainer", "resume_mode")

    def _path(self) -> Path | None:
        t = self.pipe.trainer
        if t.resume_mode == "resume_path":
            if not t.resume_from_path:
                raise self.pipe.error(self.key, "is required when trainer.resume_mode is resume_path; expected "
                                      "the path of a checkpoint folder (.../checkpoints/global_step_N)")
            return Path(t.resume_from_path)
        return checkpoint.latest(self.ckpt_dir) if t.resume_mode == "auto" else None

    def _checked(self, path: Path) -> dict:
        """The trainer state of the whole checkpoint, checked (engines load their side once started)."""
        state = checkpoint.load_state(path, self.key)
        problems = checkpoint.engine_problems(path, self.trainers, self.key)
        problems += self._model_problems(path, state) + self._loader_problems(path, state)
        problems += self._in_flight_problems(path, state)
        if problems:
            raise self.pipe.located(problems)
        return state

    def _model_problems(self, path: Path, state: dict) -> list[Problem]:
        """The models the checkpoint recorded (none before the record existed) against this pipeline's."""
        problems = []
        for node in self.trainers:
            then, now = state.get("models", {}).get(node, {}), self.models[node]
            # a checkpoint from before adapters were recorded holds the whole model
            changed = [f"{k} {then.get(k)!r} then, {now[k]!r} now" for k in now
                       if (k in then or k == "lora") and then.get(k) != now[k]]
            if changed:
                key = "lora" if all(c.startswith("lora ") for c in changed) else "path"
                problems.append(Problem(("models", self.pipe.nodes[node].model, key),
                                        f"node '{node}' was trained from another model in checkpoint {path} "
                                        f"({', '.join(changed)}); expected the model the checkpoint was written from, or a new "
                                        "trainer.experiment_name to start afresh"))
        return problems

    def _in_flight_problems(self, path: Path, state: dict) -> list[Problem]:
        """The batches generated ahead: readable whole, and no more than this run's schedule runs ahead."""
        batches, rt = state.get("in_flight", []), self.pipe.runtime
        try:
            self.in_flight = in_flight.read(path, batches)
        except ValueError as exc:
            return [Problem(self.key, f"batches generated ahead in checkpoint {path}: {exc}; {checkpoint.EXPECTED}",
                            file=str(path / in_flight.FOLDER))]
        if len(batches) > schedule.depth(rt):
            key = ("runtime", "staleness" if rt.schedule == "async" else "schedule")
            return [Problem(key, f"checkpoint {path} holds {len(batches)} batch(es) generated ahead and not trained yet, "
                                 f"more than schedule {rt.schedule} (runtime.staleness = {rt.staleness}) runs ahead; "
                                 f"expected runtime.schedule async with runtime.staleness >= {len(batches)}"
                                 f"{' (or one_step_off)' if len(batches) == 1 else ''}")]
        return []

    def _loader_problems(self, path: Path, state: dict) -> list[Problem]:
        try:
            self.loader.load_state_dict(state["loader"])
        except ConfigError as exc:
            return [self._loader_problem(path, p) for p in exc.problems]
        return []

    def _loader_problem(self, path: Path, p: Problem) -> Problem:
        """A changed data setting is located at its key; anything else is damage to the checkpoint."""
        field = p.path[0] if p.path else None
        if field in _LOADER_KEYS:
            return Problem(_LOADER_KEYS[field], f"checkpoint {path} cannot resume with this data: {p.message}")
        state_file = path / checkpoint.STATE_FILE
        return Problem(self.key, f"data loader state in {state_file}: {p.message}", file=str(state_file))

    def _refuse_others_checkpoints(self) -> None:
        """Saving overwrites a step's folder and prunes older ones: refuse a folder holding checkpoints
        that are not this run's own history (all of them for a fresh run, later steps for a resume)."""
        here = self.path is not None and self.path.resolve().parent == self.ckpt_dir.resolve()
        theirs = sorted(k for k in checkpoint.steps(self.ckpt_dir) if not here or k > self.step)
        if not theirs:
            return
        names = ", ".join(f"global_step_{k}" for k in theirs)
        ways = ["set a new trainer.experiment_name or trainer.default_local_dir", "remove them"]
        done = checkpoint.latest(self.ckpt_dir)
        if self.path is None and done:
            ways.insert(0, f"continue from {done.name} with trainer.resume_mode=auto")
        run = "this fresh run" if self.path is None else f"this run, resumed at step {self.step},"
        raise self.pipe.error(self.key, f"checkpoint folder {self.ckpt_dir} already holds {names}, which {run} "
                                        f"would overwrite or prune; expected a folder of its own: {', or '.join(ways)}")
