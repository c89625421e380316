"""The runtime with pure-Python test kinds on real Ray: order, overlap, fan-out, resharding,
colocation, failures, retry, teardown, and local == Ray."""

from __future__ import annotations

import contextlib
import os
import textwrap
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch

import runtime_kinds  # noqa: F401 - registers the t_* kinds
from siirl_dag.config import load_pipeline
from siirl_dag.registry import STRATEGIES
from siirl_dag.runtime import Batch, PipelineError, Runtime
from siirl_dag.runtime.worker import RankWorker

HEAD = """\
name: rt
cluster: {nodes: 1, devices_per_node: 6, device: cpu}
models: {m: {path: unused}}
data: {train_files: unused.parquet, train_batch_size: 4}
runtime: {backend: ray, cpus_per_rank: 0.25}
"""


@pytest.fixture(scope="module")
def ray_session():
    from siirl_dag.runtime.backends import init_ray, stop_ray

    init_ray(num_cpus=4)
    yield
    stop_ray()


@pytest.fixture(autouse=True)
def echo_engine(monkeypatch):
    monkeypatch.setitem(STRATEGIES, "megatron", replace(STRATEGIES["megatron"], engine="runtime_kinds:EchoEngine"))


def pipeline(tmp_path, body, *overrides):
    f = tmp_path / "p.yaml"
    f.write_text(HEAD + textwrap.dedent(body))
    return load_pipeline(f, list(overrides))


def prompts(k):
    return Batch(meta={"raw_prompt": [f"prompt {i}" for i in range(k)], "uid": [str(i) for i in range(k)]})


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_concurrent_branches_fan_out_and_order(tmp_path, monkeypatch):
    """Branches on disjoint meshes overlap; a wait with nothing finished says what is still running."""
    from siirl_dag.runtime import scheduler

    monkeypatch.setattr(scheduler, "HEARTBEAT_S", 0.3)
    said = []
    pipe = pipeline(tmp_path, """
        meshes: {a: "megatron:d1", b: "megatron:d2", c: "megatron:d1"}
        nodes:
          - {id: gen, kind: t_expand, mesh: a, model: m, params: {n: 2}}
          - {id: left, kind: t_scale, deps: [gen], mesh: b, model: m, params: {sleep: 1.0, out: y}}
          - {id: right, kind: t_scale, deps: [gen], mesh: c, model: m, params: {sleep: 1.0, factor: 3, out: z}}
          - {id: join, kind: t_join, deps: [left, right, gen], params: {keys: [x, y, z]}}
        """)
    with Runtime(pipe, progress=said.append) as rt:
        res = rt.run_step(prompts(4), step=0)
        s = rt.gather(res.outputs["join"], ["s"])["s"]
    beats = [line for line in said if line.startswith("[runtime] still running: ")]
    assert any("'left' (0.0 min)" in line and "'right' (0.0 min)" in line for line in beats), said
    x = torch.tensor([100.0 * i + j for i in range(4) for j in range(2)])
    assert torch.equal(s, x + 2 * x + 3 * x)  # fan-out: gen's x read by left, right and join
    (l0, l1), (r0, r1) = res.metrics["span/left"], res.metrics["span/right"]
    assert max(l0, r0) < min(l1, r1), "independent branches on disjoint meshes must overlap"
    assert res.span("gen").end <= min(res.span("left").start, res.span("right").start)
    assert res.span("join").start >= max(res.span("left").end, res.span("right").end)


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_resharding_between_dp_sizes_with_uneven_rows(tmp_path):
    pipe = pipeline(tmp_path, """
        meshes: {a: "megatron:d1", b: "megatron:d2", c: "megatron:d3"}
        nodes:
          - {id: gen, kind: t_expand, mesh: a, model: m}
          - {id: two, kind: t_scale, deps: [gen], mesh: b, model: m, params: {out: y}}
          - {id: three, kind: t_scale, deps: [gen], mesh: c, model: m, params: {factor: 5, out: z}}
          - {id: join, kind: t_join, deps: [two, three, gen], params: {keys: [y, z]}}
        """)
    with Runtime(pipe) as rt:
        res = rt.run_step(prompts(7), step=0)
        s = rt.gather(res.outputs["join"], ["s"])["s"]
    x = torch.tensor([100.0 * i for i in range(7)])
    assert torch.equal(s, 7 * x), "rows must keep their global order through dp 1 -> 2/3 -> 1"
    assert sorted(res.metrics[f"rows/three/dp{d}"] for d in range(3) if f"rows/three/dp{d}" in res.metrics)
    assert len(res.outputs["two"].shards) == 2 and len(res.outputs["three"].shards) == 3
    assert sum(s.stop - s.start for s in res.outputs["three"].shards) == 7


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_colocated_meshes_share_processes(tmp_path):
    pipe = pipeline(tmp_path, """
        meshes: {a: "megatron:d1", b: {alloc: "megatron:d1", colocate_with: a}, c: "megatron:d1"}
        nodes:
          - {id: gen, kind: t_expand, mesh: a, model: m}
          - {id: same, kind: t_scale, deps: [gen], mesh: b, model: m}
          - {id: other, kind: t_scale, deps: [gen], mesh: c, model: m, params: {out: z}}
        """)
    with Runtime(pipe) as rt:
        res = rt.run_step(prompts(2), step=0)
    assert res.metrics["pid/gen"] == res.metrics["pid/same"] != res.metrics["pid/other"]


@pytest.mark.parametrize("body, overrides, workers", [
    ("[{id: gen, kind: t_expand, mesh: a, model: m}, {id: f, kind: t_fail, deps: [gen]},"
     " {id: j, kind: t_join, deps: [f], params: {keys: [z]}}]", [], 1),
    ("[{id: gen, kind: t_expand, mesh: a, model: m}, {id: f, kind: t_fail, deps: [gen]},"
     " {id: j, kind: t_join, deps: [gen], params: {keys: [x]}}]", [], 2),
    ("[{id: gen, kind: t_expand, mesh: a, model: m, weights_from: update}, {id: f, kind: t_fail, deps: [gen]},"
     " {id: update, kind: t_update, deps: [f], mesh: b, model: m}]", ["runtime.schedule=one_step_off"], 2),
], ids=["chain", "branches", "overlapped-batches"])
def test_a_second_compute_worker_only_where_two_compute_nodes_can_run_at_once(tmp_path, body, overrides, workers):
    meshes = '{a: "megatron:d1", b: "megatron:d1"}' if "mesh: b" in body else '{a: "megatron:d1"}'
    pipe = pipeline(tmp_path, f"meshes: {meshes}\nnodes: {body}\n", *overrides)
    assert Runtime(pipe)._compute_workers() == workers


def _alive(pids):
    alive = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):  # gone, also between being listed and looked at
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
    return alive


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_failing_node_names_node_rank_host_and_tears_down(tmp_path):
    pipe = pipeline(tmp_path, """
        meshes: {a: "megatron:d2"}
        nodes:
          - {id: gen, kind: t_expand, mesh: a, model: m}
          - {id: bad, kind: t_fail, deps: [gen]}
        """)
    rt = Runtime(pipe, progress=lambda *_: None, log_dir=tmp_path / "logs")
    rt.start()
    pids = [rt.backend.get(rt.backend.call(w, RankWorker.pid)) for ws in rt.workers.values() for w in ws]
    with pytest.raises(PipelineError) as info:
        rt.run_step(prompts(2), step=3)
    rt.shutdown()
    msg = str(info.value)
    assert "step 3: node 'bad' failed on rank 0 (host " in msg and "ValueError: boom" in msg and "Traceback" in msg
    # each rank process logged to a file of its own; the failing one's last lines come with its error
    logs = sorted(p.name for p in (tmp_path / "logs").iterdir())
    assert [name.rsplit("-", 1)[0] for name in logs] == ["a-rank0", "a-rank1", "compute-rank0"]  # one compute node, one worker
    assert "the last lines of its log (" in msg and msg.rstrip().endswith("t_fail: about to fail")
    import time

    deadline = time.time() + 10
    while _alive(pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not _alive(pids), "every worker process must be gone after shutdown"


def _descendants(pid: int, keep) -> list[int]:
    """The pids of the processes under `pid` that `keep` takes: a run's own, not those of another test
    that may run beside this one (pytest-xdist)."""
    found = []
    for p in psutil.Process(pid).children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):  # ended while listed
            if keep(p):
                found.append(p.pid)
    return found


def _rank_workers() -> set[int]:
    """This process's Ray actors (its raylet starts them)."""
    return set(_descendants(os.getpid(), lambda p: (p.cmdline() or [""])[0].startswith("ray::RankWorker")))


def test_a_failure_a_node_tells_whole_comes_without_the_engines_traceback(tmp_path):
    """NodeFailure (a rollout that lost every episode to the user's agent): its message, no traceback."""
    pipe = pipeline(tmp_path, """
        meshes: {a: "megatron:d1"}
        nodes:
          - {id: gen, kind: t_expand, mesh: a, model: m}
          - {id: bad, kind: t_fail, deps: [gen], params: {told: true}}
        """, "runtime.backend=local")
    with Runtime(pipe, progress=lambda *_: None) as rt, pytest.raises(PipelineError) as info:
        rt.run_step(prompts(2), step=1)
    msg = str(info.value)
    assert msg.startswith("step 1: node 'bad' failed on rank 0 (host ")
    assert msg.endswith("every episode was lost; the first: the agent raised") and "Traceback" not in msg


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_a_start_that_fails_leaves_no_workers(tmp_path, monkeypatch):
    import time

    monkeypatch.setitem(STRATEGIES, "megatron", replace(STRATEGIES["megatron"], engine="runtime_kinds:BrokenEngine"))
    pipe = pipeline(tmp_path, """
        meshes: {a: "megatron:d2"}
        nodes: [{id: gen, kind: t_expand, mesh: a, model: m}]
        """)
    before, rt = _rank_workers(), Runtime(pipe, progress=lambda *_: None)  # (held: its actors outlive the with)
    with pytest.raises(PipelineError, match="(?s)building the engines failed.*no such model"):
        with rt:
            pass
    deadline = time.time() + 10
    while _rank_workers() - before and time.time() < deadline:
        time.sleep(0.2)
    assert not _rank_workers() - before, "the workers of a failed start must be gone"


def test_a_ray_that_never_starts_ends_the_process_with_a_message():
    """ray.init waiting forever (as it does when Ray's processes die while they start) ends the process
    after RAY_START_S with one line saying so, rather than hanging the run."""
    import subprocess
    import sys

    code = ("import time, ray\nfrom siirl_dag.runtime import backends\nbackends.RAY_START_S = 1\n"
            "ray.init = lambda **kwargs: time.sleep(60)\nbackends.init_ray(num_cpus=1)\nprint('returned')\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 1 and "returned" not in res.stdout, res
    assert "[runtime] Ray did not start within 1 s" in res.stderr, res.stderr


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_rollouts_get_their_trainers_weights_at_start_and_a_failed_sync_names_the_pair(tmp_path):
    """The echo engine can neither export nor load weights: the start-up sync fails, as one
    PipelineError naming the pair and whichever end failed first."""
    pipe = pipeline(tmp_path, """
        meshes: {a: "megatron:d1", b: "megatron:d1"}
        nodes:
          - {id: gen, kind: t_expand, mesh: a, model: m, weights_from: update}
          - {id: update, kind: t_update, deps: [gen], mesh: b, model: m}
        """)
    with pytest.raises(PipelineError, match="(?s)weight sync 'update' -> 'gen' \\(version 0, path shared_memory\\) failed: .*(export_hf_weights|load_weights)"):
        with Runtime(pipe, progress=lambda *_: None):
            pass


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_undeclared_output_is_an_error(tmp_path):
    pipe = pipeline(tmp_path, """
        meshes: {a: "megatron:d1"}
        nodes:
          - {id: gen, kind: t_expand, mesh: a, model: m}
          - {id: liar, kind: t_liar, deps: [gen]}
        """)
    with Runtime(pipe) as rt, pytest.raises(PipelineError, match=r"did not return declared key\(s\) \['z'\] and returned undeclared key\(s\) \['w'\]"):
        rt.run_step(prompts(2), step=0)


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("retries, b", [(0, "d1"), (1, "d1"), (0, "d2"), (1, "d2")],
                         ids=["0", "1", "0-leaders", "1-leaders"])
def test_retry_restarts_a_dead_actor(tmp_path, retries, b):
    """On d2, mesh b's ranks are called through leaders (runtime.fan_out 1): a rank's death reaches the
    driver through its leader, and the restarted group gets leaders of its own."""
    marker = tmp_path / "marker"
    pipe = pipeline(tmp_path, f"""
        meshes: {{a: "megatron:d1", b: "megatron:{b}"}}
        nodes:
          - {{id: gen, kind: t_expand, mesh: a, model: m}}
          - {{id: flaky, kind: t_flaky, deps: [gen], mesh: b, model: m, retry_limit: {retries}, params: {{marker: "{marker}"}}}}
        """, "runtime.fan_out=1")
    with Runtime(pipe) as rt:
        if retries:
            res = rt.run_step(prompts(3), step=0)
            assert torch.equal(rt.gather(res.outputs["flaky"], ["z"])["z"], torch.tensor([1.0, 101.0, 201.0]))
            assert len(rt.backend.fan.leaders) == (4 if b == "d2" else 0)  # the dead group's two, the new one's two
        else:
            with pytest.raises(PipelineError, match="node 'flaky' failed"):
                rt.run_step(prompts(3), step=0)


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_a_batch_whose_process_dies_is_retried_while_another_batch_trains(tmp_path):
    """async: the generating side dies mid-batch while the training side works on an earlier batch;
    the retry rebuilds its mesh and re-runs it, and the update in flight is kept."""
    from siirl_dag.runtime.scheduler import Scheduler
    from siirl_dag.runtime.step import Job

    pipe = pipeline(tmp_path, f"""
        meshes: {{a: "megatron:d1", b: "megatron:d1"}}
        nodes:
          - {{id: gen, kind: t_expand, mesh: a, model: m}}
          - {{id: flaky, kind: t_flaky, deps: [gen], mesh: a, model: m, retry_limit: 1,
              params: {{marker: "{tmp_path / 'marker'}"}}}}
          - {{id: update, kind: t_update, deps: [gen], mesh: b, model: m}}
        """)
    with Runtime(pipe) as rt:
        first = rt.run_step(prompts(2), step=0, nodes={"gen"})
        jobs = Scheduler(rt)
        training = jobs.submit(Job(None, 1, {"update"}, first))
        generating = jobs.submit(Job(prompts(3), 2, {"gen", "flaky"}))
        done = {}
        while not jobs.idle():
            done.update(jobs.wait())
        assert torch.equal(rt.gather(done[generating].outputs["flaky"], ["z"])["z"], torch.tensor([1.0, 101.0, 201.0]))
        assert "update" in done[training].outputs and rt.versions.trainer["update"] == 1 and rt.recovery.attempts == {"flaky": 1}


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_a_dead_trainer_is_not_restarted_from_the_initial_weights(tmp_path):
    """After an update the trainer's state lives only in its process: a restart must not hide its loss."""
    pipe = pipeline(tmp_path, f"""
        meshes: {{a: "megatron:d1", b: "megatron:d1"}}
        nodes:
          - {{id: gen, kind: t_expand, mesh: a, model: m}}
          - {{id: update, kind: t_update, deps: [gen], mesh: b, model: m}}
          - {{id: flaky, kind: t_flaky, deps: [update], mesh: b, model: m, retry_limit: 1,
              params: {{marker: "{tmp_path / 'marker'}"}}}}
        """)
    with Runtime(pipe) as rt, pytest.raises(PipelineError, match=r"training state of 'update' \(1 update\).*resume_mode=auto"):
        rt.run_step(prompts(3), step=0)


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_local_and_ray_give_identical_results(tmp_path):
    body = """
        meshes: {a: "megatron:d1", b: "megatron:d1"}
        nodes:
          - {id: gen, kind: t_expand, mesh: a, model: m, params: {n: 3}}
          - {id: noisy, kind: t_scale, deps: [gen], mesh: b, model: m, params: {noise: true}}
          - {id: join, kind: t_join, deps: [noisy, gen], params: {keys: [x, y]}}
        """
    results = []
    for backend in ("local", "ray"):
        with Runtime(pipeline(tmp_path, body, f"runtime.backend={backend}")) as rt:
            res = [rt.run_step(prompts(4), step=s) for s in range(2)]
            results.append([rt.gather(r.outputs["join"], ["s"])["s"] for r in res])
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])
    assert not torch.equal(results[0][0], results[0][1]), "steps draw different noise"


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_ranks_called_through_leaders_give_what_direct_calls_give(tmp_path):
    """runtime.fan_out 1: every mesh of two ranks or more is called through leaders, one per rank, as a
    mesh of more than 64 is by default; the rows, their order and the noise drawn per rank are the same."""
    body = """
        meshes: {a: "megatron:d2", b: "megatron:d3", c: "megatron:d1"}
        nodes:
          - {id: gen, kind: t_expand, mesh: a, model: m, params: {n: 3}}
          - {id: noisy, kind: t_scale, deps: [gen], mesh: b, model: m, params: {noise: true}}
          - {id: other, kind: t_scale, deps: [gen], mesh: c, model: m, params: {factor: 5, out: z}}
          - {id: join, kind: t_join, deps: [noisy, other, gen], params: {keys: [x, y, z]}}
        """
    results, leaders = [], []
    for fan_out in (0, 1):
        with Runtime(pipeline(tmp_path, body, f"runtime.fan_out={fan_out}")) as rt:
            res = [rt.run_step(prompts(7), step=s) for s in range(2)]
            results.append([rt.gather(r.outputs["join"], ["s"])["s"] for r in res])
            leaders.append(len(rt.backend.fan.leaders))
            pids = {rt.backend.get(rt.backend.call(w, RankWorker.pid)) for w in rt.workers["b"]}
    assert leaders == [0, 5] and len(pids) == 3  # a's two ranks and b's three; c's one rank is called directly
    assert all(torch.equal(direct, fanned) for direct, fanned in zip(*results))
    assert not torch.equal(results[1][0], results[1][1]), "steps draw different noise"


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_shards_a_round_returns_reach_ranks_and_a_lost_one_fails_its_round_alone():
    """A leader's shards travel as `Held` entries of one list: a leader hands its ranks what they stand
    for, a direct reader brings them itself; a round reading a list that failed fails, the next runs."""
    import ray

    from siirl_dag.runtime.fan_out import FanOut, Held, RankLeader, hold, values

    @ray.remote(num_cpus=0)
    class Rank:
        def run(self, *shards):
            return shards

    @ray.remote(num_cpus=0)
    def lost():
        raise ValueError("the list's owner is gone")

    ranks = [Rank.remote() for _ in range(2)]
    leader = ray.remote(RankLeader).options(num_cpus=0).remote(ranks)
    fan = FanOut(2, lambda *_: leader, lambda lead, number, calls: lead.call.remote(number, calls),
                 lambda refs, timeout: ray.get(refs, timeout=timeout))
    for i, rank in enumerate(ranks):
        fan.add(rank, "g", i, 3, i)
    held = hold([[ray.put("a"), ray.put("b")], [], [ray.put("c")]])
    assert [len(h) for h in held] == [2, 0, 1] and len({h.refs for h in held[0] + held[2]}) == 1
    assert values((1, held[2][0], held[0][1])) == (1, "c", "b")
    assert fan.get([fan.call(ranks[1], "run", (held[0][0], 2, held[2][0]), {}, 1)]) == [("a", 2, "c")]
    with pytest.raises(ValueError, match="owner is gone"):
        fan.get([fan.call(ranks[0], "run", (Held(lost.remote(), 0),), {}, 1)])
    assert fan.get([fan.call(ranks[0], "run", (held[0][1],), {}, 1)]) == [("b",)]


def test_the_local_backend_delivers_any_error_at_get_as_ray_does():
    """torch's CheckpointException is a BaseException: it too must reach the caller through `get`."""
    from siirl_dag.runtime.backends import LocalBackend

    class ShardCutShort(BaseException):
        pass

    class Worker:
        def load(self):
            raise ShardCutShort("EOFError")

    backend = LocalBackend(None)
    done = backend.call(Worker(), Worker.load)
    with pytest.raises(ShardCutShort):
        backend.get(done)


def test_local_backend_refuses_multi_rank_meshes(tmp_path):
    from siirl_dag.errors import ConfigError

    pipe = pipeline(tmp_path, """
        meshes: {a: "megatron:d2"}
        nodes: [{id: gen, kind: t_expand, mesh: a, model: m}]
        """, "runtime.backend=local")
    with pytest.raises(ConfigError, match="mesh 'a' of node 'gen' has several ranks; use runtime.backend=ray"):
        Runtime(pipe).start()


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_ctrl_c_stops_a_run_cleanly(tmp_path):
    """SIGINT during a step: exit 130 with a one-line message, and the run's Ray is gone."""
    import signal
    import subprocess
    import sys
    import time

    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": [f"prompt {i}" for i in range(4)], "data_source": ["d"] * 4,
                             "ground_truth": ["1"] * 4}), tmp_path / "train.parquet")
    (tmp_path / "p.yaml").write_text(textwrap.dedent(f"""\
        name: ctrlc
        cluster: {{nodes: 1, devices_per_node: 1, device: cpu}}
        models: {{m: {{path: unused}}}}
        data: {{train_files: {tmp_path}/train.parquet, train_batch_size: 2}}
        nodes: [{{id: slow, kind: "runtime_kinds:t_sleep", params: {{seconds: 120}}}}]
        trainer: {{total_steps: 1, logger: [console], default_local_dir: {tmp_path}/ckpt, log_dir: {tmp_path}/logs,
                  export_hf: false}}
        runtime: {{stop_grace_s: 6}}
        """))
    # SIGINT's default restored in the run: a suite started in the background of a non-interactive
    # shell inherits it ignored, and then so would the run
    proc = subprocess.Popen([sys.executable, "-m", "siirl_dag.main", str(tmp_path / "p.yaml")], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ,
                            "PYTHONPATH": str(Path(__file__).parent)},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    seen = []  # the engine's own lines: on the console's stderr, beside the progress bar
    while not any(line.startswith("[runtime] ready") for line in seen) and proc.poll() is None:
        seen.append(proc.stderr.readline())
    time.sleep(3)  # the step (120 s) is running
    rays = _descendants(proc.pid, lambda p: p.name() in ("raylet", "gcs_server"))
    assert rays, "the run started a Ray of its own"
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    err = "".join(seen) + err
    assert proc.returncode == 130, err[-2000:]
    assert "interrupted; stopped cleanly." in err and "Traceback" not in err and not out
    assert "[runtime] stopping: 1 worker(s) still busy, given 6 s" in err, "the user is told what the wait is for"
    deadline = time.time() + 30
    while _alive(rays) and time.time() < deadline:
        time.sleep(0.5)
    assert not _alive(rays), "the run's Ray processes must be gone"


def test_wire_format_is_exact_and_narrow():
    """int64 ids/masks cross the object store narrowed (uint8/int32) and come back identical."""
    from siirl_dag.runtime.batch import tensor_from_wire, tensor_to_wire

    cases = {"mask": (torch.tensor([[1, 0, 1]]), "uint8"), "ids": (torch.tensor([[0, 70000, -5]]), "int32"),
             "big": (torch.tensor([[2**40, 1]]), "int64"), "f": (torch.tensor([0.5, 1.5]), "float32"),
             "bf16": (torch.tensor([1.0, 2.5], dtype=torch.bfloat16), "int16")}
    for name, (t, sent) in cases.items():
        array, dtype = tensor_to_wire(t)
        array.setflags(write=False)  # as the object store hands it out
        assert str(array.dtype) == sent, name
        for copy in (True, False):
            back = tensor_from_wire(array, dtype, copy=copy)
            assert back.dtype == t.dtype and torch.equal(back, t), (name, copy)
