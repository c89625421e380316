"""The schedules (trainer/schedules) on the local backend with the test kinds: no engines, no Ray.
Weight syncs are stood in for (the echo engine holds a version number), so what is checked is the
order of the jobs, the staleness bound, and dynamic sampling under every schedule."""

from __future__ import annotations

import itertools
import textwrap
from dataclasses import replace

import pytest
import torch

import runtime_kinds
from runtime_kinds import EVENTS
from siirl_dag.config import load_pipeline
from siirl_dag.registry import STRATEGIES
from siirl_dag.runtime import Batch, PipelineError, Runtime
from siirl_dag.weight_sync.syncs import WeightSyncs
from siirl_dag.trainer import schedules
from siirl_dag.trainer.schedules.generation import Generated

HEAD = """\
name: sched
cluster: {nodes: 1, devices_per_node: 2, device: cpu}
models: {m: {path: unused}}
data: {train_files: unused.parquet, train_batch_size: 4}
meshes: {gen: "megatron:d1", train: "megatron:d1"}
"""
PLAIN = """
nodes:
  - {id: gen, kind: t_rollout, mesh: gen, model: m, weights_from: update}
  - {id: update, kind: t_update, deps: [gen], mesh: train, model: m}
"""
FILTERED = """
nodes:
  - {id: gen, kind: t_rollout, mesh: gen, model: m, weights_from: update, params: {n: 2}}
  - {id: keep, kind: t_keep, deps: [gen], params: {max_gen_batches: 3}}
  - {id: update, kind: t_update, deps: [keep], mesh: train, model: m}
"""


def _hold(worker, engine_key: str, version: int) -> None:
    """On a rank (the local backend calls it as a worker method): the echo engine takes `version`."""
    worker.engines[engine_key].hold(version)


def _sync(self, step: int = 0, landed: frozenset = frozenset()):
    """WeightSyncs.start's stand-in: each rollout's engine told the version it now holds; the wait returned."""
    metrics, versions = {}, self.rt.versions
    for dst, have in versions.held.items():
        version = versions.trainer[versions.source[dst]] + (versions.source[dst] in landed)
        if have < version:
            self.rt.engine_call(dst, _hold, version)
            versions.held[dst] = version
            EVENTS.append(("sync", step, version))
            metrics["timing_s/sync_weights"] = 0.0
    return lambda: metrics


@pytest.fixture(autouse=True)
def stand_ins(monkeypatch):
    monkeypatch.setitem(STRATEGIES, "megatron", replace(STRATEGIES["megatron"], engine="runtime_kinds:EchoEngine"))
    monkeypatch.setattr(Runtime, "init_group", lambda self, workers: None)  # one process: no process group
    monkeypatch.setattr(WeightSyncs, "start", _sync)
    EVENTS.clear()
    assert runtime_kinds.t_rollout


def pipeline(tmp_path, body, *overrides):
    f = tmp_path / "p.yaml"
    f.write_text(HEAD + textwrap.dedent(body))
    return load_pipeline(f, ["runtime.backend=local", *overrides])


def prompts():
    """next_source: each call the next train_batch_size prompts, numbered on."""
    drawn = itertools.count()

    def next_source(step: int) -> Batch:
        ids = [next(drawn) for _ in range(4)]
        return Batch(meta={"raw_prompt": [f"prompt {i}" for i in ids], "uid": [str(i) for i in ids]})

    return next_source


def train(pipe, steps: int, in_flight=(), versions=None) -> list:
    """`steps` steps of the pipeline's schedule; their outcomes."""
    with Runtime(pipe, progress=lambda *_: None) as rt:
        rt.versions.trainer.update(versions or {})
        schedule, next_source = schedules.make(pipe, rt, 0, steps, list(in_flight)), prompts()
        return [schedule.step(next_source) for _ in range(steps)]


def test_sync_generates_trains_then_syncs(tmp_path):
    outcomes = train(pipeline(tmp_path, PLAIN), 2)
    assert EVENTS == [("sync", 0, 0), ("gen", 1, 0), ("update", 1), ("sync", 1, 1),
                      ("gen", 2, 1), ("update", 2), ("sync", 2, 2)]
    assert [{(s.node, s.step) for s in o.spans} for o in outcomes] == [{("gen", 1), ("update", 1)},
                                                                      {("gen", 2), ("update", 2)}]


def test_one_step_off_generates_the_next_batch_while_one_trains(tmp_path):
    outcomes = train(pipeline(tmp_path, PLAIN, "runtime.schedule=one_step_off"), 4)
    # each step ends with the sync and the next batch's generation started (the local backend runs
    # calls in the order they are made): it runs beside the next update
    assert EVENTS == [("sync", 0, 0), ("gen", 1, 0),
                      ("update", 1), ("gen", 2, 0), ("sync", 1, 1),  # batch 2 generated beside step 1
                      ("gen", 3, 1), ("update", 2), ("sync", 2, 2),
                      ("gen", 4, 2), ("update", 3), ("sync", 3, 3),
                      ("update", 4), ("sync", 4, 4)]  # nothing left to generate
    assert [o.metrics["async/staleness/max"] for o in outcomes] == [0, 1, 1, 1]
    # a step's spans: its own training, and the generation of the batch after it (typed, not keyed)
    assert {(s.node, s.step) for s in outcomes[1].spans} == {("update", 2), ("gen", 3)}


def test_a_step_counts_the_nodes_that_ended_in_a_generation_still_running(tmp_path):
    """The generation's rollout ends during step 1 and its second node in step 2: step 1's spans hold the
    rollout's run (a job's result hands its spans over only when the job ends, a step later)."""
    two_rounds = PLAIN + "  - {id: look, kind: t_join, deps: [gen], params: {keys: [x]}}\n"
    outcomes = train(pipeline(tmp_path, two_rounds, "runtime.schedule=one_step_off"), 3)
    assert ("gen", 2) in {(s.node, s.step) for s in outcomes[0].spans}


def test_async_with_staleness_zero_keeps_the_sync_order(tmp_path):
    train(pipeline(tmp_path, PLAIN), 3)
    sync = list(EVENTS)
    EVENTS.clear()
    outcomes = train(pipeline(tmp_path, PLAIN, "runtime.schedule=async", "runtime.staleness=0"), 3)
    assert EVENTS == sync and all(o.metrics["async/staleness/max"] == 0 for o in outcomes)


def test_a_batch_older_than_the_bound_is_refused(tmp_path):
    """A batch generated with weights 2 versions behind the trainer's, under staleness 1: never trained."""
    pipe = pipeline(tmp_path, PLAIN, "runtime.schedule=one_step_off", "runtime.staleness=1")
    with Runtime(pipe, progress=lambda *_: None) as rt:
        old = Generated(1, rt.run_step(prompts()(1), 1, nodes={"gen"}))
        rt.versions.trainer["update"] = 2
        schedule = schedules.make(pipe, rt, 0, 2, [old])
        with pytest.raises(PipelineError, match=r"step 1: samples 2 weight versions old exceed runtime.staleness = 1"):
            schedule.step(prompts())
    assert ("update", 1) not in EVENTS


@pytest.mark.parametrize("schedule", ["sync", "one_step_off", "async"])
def test_dynamic_sampling_fills_each_step_under_every_schedule(tmp_path, schedule):
    """Half the prompts are kept: two rounds of 4 fill a step of 4 prompts (8 rows)."""
    pipe = pipeline(tmp_path, FILTERED, f"runtime.schedule={schedule}", "runtime.staleness=2")
    outcomes = train(pipe, 3)
    for step, o in enumerate(outcomes, start=1):
        m = {**o.metrics, **o.result.metrics}
        assert (m["dynamic_sampling/rounds"], m["dynamic_sampling/kept_groups"], m["dynamic_sampling/kept_ratio"]) == (2, 4, 0.5)
        assert m["update/rows"] == 8 and all(int(u) % 2 == 0 for u in m["update/uids"])
        rounds = [e for e in EVENTS if e[:2] == ("gen", step)]
        assert len(rounds) == 2, EVENTS
        assert max(s.part for s in o.spans if s.node == "gen" and s.step == step) == 2
    assert sorted(int(u) for o in outcomes for u in o.result.metrics["update/uids"]) == list(range(0, 24, 2))
    if schedule != "sync":  # the rounds of batch 2 ran beside step 1's update
        assert EVENTS.index(("update", 1)) < EVENTS.index(next(e for e in EVENTS if e[:2] == ("gen", 2)))
        assert outcomes[1].metrics["async/staleness/max"] == 1


@pytest.mark.parametrize("schedule", ["sync", "one_step_off"])
def test_dynamic_sampling_that_cannot_fill_a_step_stops(tmp_path, schedule):
    pipe = pipeline(tmp_path, FILTERED.replace("max_gen_batches: 3", "max_gen_batches: 3, none: true"),
                    f"runtime.schedule={schedule}")
    with pytest.raises(PipelineError, match="step 1: dynamic sampling kept 0 of the 4 prompts a step needs after 3 "
                                            "generation rounds"):
        train(pipe, 1)


def test_dynamic_sampling_with_partial_rollouts_filters_whole_samples(tmp_path):
    """Each round: the rollout's two segments (new weights may come between them), then the filter."""
    pipe = pipeline(tmp_path, FILTERED, "runtime.schedule=one_step_off", "runtime.partial_rollout=true",
                    "runtime.partial_rollout_tokens=1")
    outcomes = train(pipe, 2)
    assert [e for e in EVENTS if e[0] != "sync" and e[1] == 1] == [("gen", 1, 0), ("resume", 1, 0), ("keep", 1)] * 2 + \
        [("update", 1)]
    assert [o.metrics["async/partial/segments"] for o in outcomes] == [6, 6]  # 2 rounds x (2 segments + the filter)
    assert all((o.result.metrics["update/rows"], o.metrics["dynamic_sampling/rounds"]) == (8, 2) for o in outcomes)


def test_a_batch_saved_in_flight_comes_back_with_its_samples_versions(tmp_path):
    """The staleness check reads each output's version counts (no rows reach the driver); a batch a
    checkpoint kept in flight is read back with the counts its ranks made."""
    from siirl_dag.runtime.step import NodeOutput, StepResult
    from siirl_dag.trainer import in_flight
    from siirl_dag.trainer.schedules.generation import Generated

    batch = Batch({"weights_version": torch.tensor([3, 3, 2, 3]),
                   "token_weights_version": torch.tensor([[3, 3], [3, 4], [2, 2], [3, 0]])})
    out = NodeOutput.held(batch, lambda wire: wire)
    assert out.versions == [(2, 2, 1), (3, 3, 2), (3, 4, 1)]
    in_flight.save(tmp_path, [Generated(5, StepResult(outputs={"rollout": out}))], lambda ref: ref)
    (back,) = in_flight.generated(in_flight.read(tmp_path, [5]))
    assert back.result.outputs["rollout"].versions == out.versions
