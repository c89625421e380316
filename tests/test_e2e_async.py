"""runtime.schedule one_step_off and async through the real stack: the rollout generates ahead while
a step trains, samples are never more than runtime.staleness versions old, and a run stopped at a
checkpoint with batches in flight and resumed gives the same metrics as one that was not. (That async
with staleness 0 is the sync schedule is in test_e2e, beside the sync run it compares with.)"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import test_e2e
from siirl_dag.main import main
from siirl_dag.visualize import timeline
from test_e2e import COMPARED, QUICK, SEPARATE, launch, parsed

ONE_STEP_OFF = ("runtime.schedule=one_step_off", "runtime.staleness=1", *QUICK)
ASYNC_2 = ("runtime.schedule=async", "runtime.staleness=2", *QUICK)


def trace_spans(path) -> list[dict]:
    """--trace's spans, each with its track (the mesh, or the driver) as `track`."""
    trace = json.loads(path.read_text())["traceEvents"]
    tracks = {e["pid"]: e["args"]["name"] for e in trace if e["name"] == "process_name"}
    return [dict(e, track=tracks[e["pid"]]) for e in trace if e["ph"] == "X"]


def between(span, first, second) -> bool:
    """`span` began after the sync `first` began and ended before the sync `second` began: it ran on one
    weight version, in the window the schedule gives both sides between two syncs (whether two spans of
    one window overlap in time is the two sides' speeds, not the schedule's)."""
    return first["ts"] <= span["ts"] and span["ts"] + span["dur"] <= second["ts"]


def trace_file(res) -> Path:
    """The trace a run with --trace wrote, as it names it."""
    (line,) = [x for x in res.stderr.splitlines() if x.startswith("[trainer] timeline of the run: ")]
    return Path(line.split(": ", 1)[1].split(" (")[0])


def check_trace(path, total):
    """--trace of a run of `total` steps: a track per mesh (a colocated mesh on its host's), a thread per
    rank, a span per node execution (the rollout of the step ahead in the update's window), and the
    driver's sync, save, validation and data loading."""
    spans = trace_spans(path)
    assert {s["track"] for s in spans} == {"gen", "train", "__compute__", "driver"}
    by = lambda name: [s for s in spans if s["name"] == name]  # noqa: E731
    assert len(by("actor_update")) == total and {s["args"]["step"] for s in by("actor_update")} == set(range(1, total + 1))
    assert {s["tid"] for s in by("actor_update")} == {"rank 0"} and by("actor_update")[0]["track"] == "train"
    syncs = by("sync actor_update -> rollout")
    assert len(syncs) == total + 1 and all(s["args"]["bytes"] > 0 for s in syncs)  # at start, after each step
    assert len(by("save checkpoint")) == 1 and len(by("load data")) == total and by("validation")
    # the next step's rollout ran in step 2's window, beside its work on the training mesh: after the
    # sync of step 1's weights, done before the sync of step 2's
    ahead = next(s for s in by("rollout") if s["args"]["step"] == 3 and not s["args"]["validating"])
    training = [s for s in spans if s["track"] == "train" and s["args"]["step"] == 2]
    after = {s["args"]["step"]: s for s in syncs}
    assert training and all(between(s, after[1], after[2]) for s in [ahead, *training])


BESIDE_ROLLOUT = '  gen: "vllm:d1"\n  train: "megatron:d1"\n  ref: {alloc: "megatron:d1", colocate_with: gen}'


def test_one_step_off_through_ray_with_the_reference_beside_the_rollout(tmp_path, tiny_model_dir, demo_data,
                                                                          monkeypatch):
    """one_step_off on Ray, in the demo's balance: the frozen reference on the rollout's device runs ahead
    with it, and the update's own forward gives the old log-probs (one mini batch), so no node waits for a
    separate pass. Every later step trains on samples one version old, a sync follows each update, and
    --trace and the timeline it draws show the next step's work in this step's window. (One run carries
    both: each run costs the engines' start-up.)"""
    text = test_e2e.PIPELINE.replace(
        "  - {{id: old_logprob, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {{output: old_logprobs}}}}\n",
        "").replace("deps: [advantage, old_logprob, ref_logprob]", "deps: [advantage, ref_logprob]").replace(
        "params: {{mini_batch_size: 4,", "params: {{mini_batch_size: 8, old_logprobs: update, rollout_is: token,")
    assert text.count("old_logprobs: update") == 1 and "old_logprob," not in text
    monkeypatch.setattr(test_e2e, "PIPELINE", text)
    res = launch(tmp_path, tiny_model_dir, demo_data, BESIDE_ROLLOUT, 2, "ray", "trainer.total_steps=5", "--trace",
                 *ONE_STEP_OFF)
    steps = parsed(res)["steps"]
    # the first step generates its own samples; every later one trains on samples of the previous weights
    assert [steps[s]["async/staleness/max"] for s in ("1", "2", "3", "4", "5")] == [0, 1, 1, 1, 1]
    for s in ("2", "3", "4", "5"):  # the old policy is the update's own: ratios of 1 before its one optimizer step
        assert steps[s]["actor/ppo_kl"] == pytest.approx(0, abs=1e-6) and steps[s]["actor/pg_clipfrac"] == 0
        assert steps[s]["rollout_corr/kl"] != 0 and steps[s]["actor/grad_norm"] > 0  # samples one version back
    for s in ("2", "3"):  # how long the rollout's mesh waits in a step is the two sides' speeds; a part of the step
        assert 0 <= steps[s]["timing_s/idle/gen"] <= steps[s]["timing_s/step"]
    # a sync after every update; one whose rollout ends after the update lands at the next step's start
    assert sum(steps[s].get("timing_s/sync_weights", 0) > 0 for s in steps) >= 4
    trace = trace_file(res)
    check_trace(trace, 5)
    # drawn: every step's critical path runs through the update and ends with the weight sync
    assert main(["visualize", str(trace.parent), "--view", "timeline", "-o", str(tmp_path / "timeline.svg")]) == 0
    drawn = timeline.load(trace).steps
    assert set(drawn) == {1, 2, 3, 4, 5}
    for info in drawn.values():
        names = [s.name for s in info.critical]
        assert "actor_update" in names and names[-1] == "sync actor_update -> rollout", names
    spans = trace_spans(trace)
    refs = {e["args"]["step"]: e for e in spans if e["name"] == "ref_logprob" and not e["args"]["validating"]}
    updates = {e["args"]["step"]: e for e in spans if e["name"] == "actor_update"}
    syncs = {e["args"]["step"]: e for e in spans if e["name"] == "sync actor_update -> rollout"}
    # on the generating side: the next batch's reference in the same window as this step's update, between
    # the syncs of the step before's weights and of this step's, not after the update's (as a trainer's would be)
    for step in (1, 2, 3, 4):
        assert between(refs[step + 1], syncs[step - 1], syncs[step]), refs[step + 1]
        assert between(updates[step], syncs[step - 1], syncs[step]), updates[step]


def test_async_runs_two_batches_ahead_through_ray(tmp_path, tiny_model_dir, demo_data):
    # the generating side (rollout and reference) on a device of its own, and an update of 4 epochs, which
    # usually outlasts a rollout: batch 3 then starts on the first weights too, two versions behind
    res = launch(tmp_path, tiny_model_dir, demo_data, BESIDE_ROLLOUT, 2, "ray", "trainer.total_steps=5", "--trace",
                 "nodes.actor_update.params.epochs=4", *ASYNC_2)
    steps = parsed(res)["steps"]
    spans = trace_spans(trace_file(res))
    syncs = sorted((e for e in spans if e["name"] == "sync actor_update -> rollout"), key=lambda e: e["ts"])
    rollouts = {e["args"]["step"]: e for e in spans if e["name"] == "rollout" and not e["args"]["validating"]}
    for b, rollout in rollouts.items():
        # the weights batch b was generated on: those of the last sync started before its rollout (syncs
        # wait for both sides to be between batches); step b trains from version b - 1
        version = max(e["args"]["version"] for e in syncs if e["ts"] < rollout["ts"])
        assert steps[str(b)]["async/staleness/max"] == b - 1 - version <= 2, (b, version)
    # batch 2 starts on the first weights as step 1 starts training, whatever the two sides' speeds
    assert [steps[s]["async/staleness/max"] for s in ("1", "2")] == [0, 1]
    # batches waiting when a step took its own: how many depends on the two sides' speeds, never past the bound
    assert all(0 <= steps[s]["async/queued"] <= 2 for s in steps)
    assert all(steps[s]["actor/grad_norm"] > 0 for s in steps)


def test_partial_rollouts_take_new_weights_between_segments(tmp_path, tiny_model_dir, demo_data):
    """Segments of 2 tokens: the update of the step before ends while a batch is half generated, so
    its samples carry tokens of two weight versions, the older one counted for the bound."""
    steps = parsed(launch(tmp_path, tiny_model_dir, demo_data, SEPARATE, 2, "local", "trainer.total_steps=3", *ONE_STEP_OFF,
                          "runtime.partial_rollout=true", "runtime.partial_rollout_tokens=2"))["steps"]
    assert all(steps[s]["async/partial/segments"] >= 2 for s in steps)
    assert steps["1"]["async/partial/mixed"] == 0 and steps["3"]["async/partial/mixed"] > 0
    assert [steps[s]["async/staleness/max"] for s in ("1", "2", "3")] == [0, 1, 1]


def test_async_resume_with_batches_in_flight_is_exact(tmp_path, tiny_model_dir, demo_data):
    straight_dir, resumed_dir = tmp_path / "straight", tmp_path / "resumed"
    four = ("trainer.total_steps=4", "trainer.save_freq=2", *ASYNC_2)
    straight = parsed(launch(straight_dir, tiny_model_dir, demo_data, SEPARATE, 2, "local", *four))
    saved = straight_dir / "ckpt" / "global_step_2"
    assert json.loads((saved / "trainer_state.json").read_text())["in_flight"] == [3, 4]
    shutil.copytree(straight_dir / "ckpt", resumed_dir / "ckpt")
    shutil.rmtree(resumed_dir / "ckpt" / "global_step_4")
    # bad input, refused before any process starts: a schedule that runs less far ahead, a damaged batch
    res = launch(resumed_dir, tiny_model_dir, demo_data, SEPARATE, 2, "local", *four, "runtime.staleness=1")
    said = res.stdout + res.stderr  # --json: the errors are the document
    assert res.returncode == 2 and "Traceback" not in said
    assert "runtime.staleness" in said and "holds 2 batch(es) generated ahead" in said
    damaged = resumed_dir / "ckpt" / "global_step_2" / "in_flight" / "4.safetensors"
    kept = damaged.read_bytes()
    damaged.write_bytes(kept[:100])
    res = launch(resumed_dir, tiny_model_dir, demo_data, SEPARATE, 2, "local", *four)
    said = res.stdout + res.stderr
    assert res.returncode == 2 and "Traceback" not in said and "4.safetensors is unreadable" in said
    damaged.write_bytes(kept)
    resumed = parsed(launch(resumed_dir, tiny_model_dir, demo_data, SEPARATE, 2, "local", *four))
    assert set(resumed["steps"]) == {"3", "4"}
    for step in ("3", "4"):
        for key in (*COMPARED, "async/staleness/max"):
            assert resumed["steps"][step][key] == pytest.approx(straight["steps"][step][key], abs=1e-6), (step, key)
