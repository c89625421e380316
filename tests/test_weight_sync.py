"""Weight sync trainer -> rollout through the real stack: Megatron ranks (TP2, PP2, EP2 MoE, TP1) train
one step, the new weights stream into vLLM engines on a separate mesh (TP2 for the MoE model: its
experts sharded; object store, or a gloo process group) and on the trainer's own ranks (in-process
handoff), and vLLM's log-probs of what it samples then equal Megatron's; a later step's weights go
straight into vLLM's parameters (direct writes). Plus the pieces alone: buckets, the shared-memory
channel between two Ray actors, and the driver's protocol in one process."""

from __future__ import annotations

import os

import pytest
import torch

from siirl_dag.config import load_pipeline
from siirl_dag.placement.allocation import parse_allocation
from siirl_dag.runtime import Batch, PipelineError, Runtime
from siirl_dag.weight_sync import WeightSync
from siirl_dag.weight_sync.buckets import Buckets, from_wire, to_wire

PIPELINE = """\
name: ws
cluster: {{nodes: 1, devices_per_node: {devices}, device: cpu}}
models: {{policy: {{path: {model}, dtype: float32}}}}
data: {{train_files: unused.parquet, train_batch_size: 4, max_prompt_length: 16, max_response_length: 8}}
meshes:
  train: "megatron:{train}"
  gen: "vllm:{gen}"
  colo: {{alloc: "vllm:d{world}", colocate_with: train}}
nodes:
  - {{id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: actor_update, options: {rollout}}}
  - {{id: reward, kind: reward, deps: [rollout]}}
  - {{id: advantage, kind: advantage, deps: [reward]}}
  - {{id: old_logprob, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {{output: old_logprobs}}}}
  - {{id: actor_update, kind: actor_update, deps: [advantage, old_logprob], mesh: train, model: policy,
     options: {{lr: 1.0e-2, micro_batch_size: 2}}, params: {{mini_batch_size: 4, entropy_coeff: 0.5}}}}
  - {{id: colo_rollout, kind: rollout, mesh: colo, model: policy, weights_from: actor_update, options: {rollout}}}
  - {{id: colo_logprob, kind: logprob, deps: [colo_rollout], mesh: train, model: policy, params: {{output: old_logprobs}}}}
runtime: {{backend: ray, cpus_per_rank: 0.25, weight_sync_bucket_mb: 0.05}}
"""
# load_format dummy: random weights until the runtime's start-up sync (which the first assertion checks)
ROLLOUT = ("{n: 2, temperature: 1.0, dtype: float32, kv_cache_gb: 0.05, max_model_len: 32, enforce_eager: true, "
           "load_format: dummy}")
TRAIN_STEP = ["rollout", "reward", "advantage", "old_logprob", "actor_update"]
LOGPROB_INPUTS = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]
# trainer layout -> (allocation, its world size, MoE model, transport between the separate meshes, the
# separate rollout's allocation: the MoE one shards its experts over two TP ranks)
LAYOUTS = {
    "tp1": ("d1", 1, False, "object_store", "d1"),
    "tp2": ("t2", 2, False, "collective", "d1"),
    "pp2": ("p2", 2, False, "object_store", "d1"),
    "ep2": ("d2e2", 2, True, "collective", "t2"),
}


@pytest.fixture(scope="module", autouse=True)
def ray_session():
    from siirl_dag.runtime.backends import init_ray, stop_ray

    init_ray(num_cpus=4)
    yield
    stop_ray()


@pytest.fixture(scope="module")
def moe_model_dir(tmp_path_factory) -> str:
    from make_tiny_model import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("moe"), arch="qwen3_moe", num_experts=4, tie_word_embeddings=False)


def prompts(first: int) -> Batch:
    ids = range(first, first + 4)
    return Batch(meta={"raw_prompt": [f"Q: {i}+{i + 1}=? A:" for i in ids], "uid": [str(i) for i in ids],
                       "data_source": ["demo/arith"] * 4, "ground_truth": [str(2 * i + 1) for i in ids]})


def sampled_logprobs(rt: Runtime, gen: str, logprob: str, first: int) -> Batch:
    result = rt.run_step(prompts(first), step=1, nodes=[gen, logprob])
    return rt.collect(result, ["rollout_logprobs", "old_logprobs", "response_mask"])


def assert_same_logprobs(batch: Batch) -> None:
    mask = batch["response_mask"].bool()
    assert mask.sum() > 8
    torch.testing.assert_close(batch["rollout_logprobs"][mask], batch["old_logprobs"][mask], atol=1e-4, rtol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_trained_weights_reach_separate_and_colocated_rollouts(tmp_path, tiny_model_dir, moe_model_dir, layout):
    train, world, moe, transport, gen = LAYOUTS[layout]
    f = tmp_path / "p.yaml"
    devices = world + parse_allocation(f"vllm:{gen}")[0].world_size
    f.write_text(PIPELINE.format(devices=devices, model=moe_model_dir if moe else tiny_model_dir, train=train,
                                 world=world, gen=gen, rollout=ROLLOUT))
    with Runtime(load_pipeline(f, []), progress=lambda *_: None) as rt:
        step = rt.collect(rt.run_step(prompts(0), step=0, nodes=TRAIN_STEP),
                          LOGPROB_INPUTS + ["rollout_logprobs", "old_logprobs"])
        assert_same_logprobs(step)  # rollout and trainer agree on the initial weights (start() synced them)
        assert rt.versions["actor_update"] == 1 and rt.synced == {"rollout": 0, "colo_rollout": 0}

        # staleness 0: a rollout still holding version 0 refuses to generate
        with pytest.raises(PipelineError, match="would generate with weights version 0, older than version 1"):
            rt.run_step(prompts(4), step=1, nodes=["rollout"])

        # the update changed what the trainer computes on the rows it trained on
        trained = rt.engine_call("old_logprob", "compute_logprobs", dict(step.only(LOGPROB_INPUTS)))[0]["logprobs"]
        mask = step["response_mask"].bool()
        assert (trained - step["old_logprobs"])[mask].abs().max() > 1e-2

        metrics = WeightSync(rt)("actor_update", "rollout", 1, transport=transport)
        assert metrics["sync/buckets"] > 5, "a small bucket size cuts the model into many buckets"
        assert metrics["sync/bytes"] > 0 and metrics["sync/load_s"] > 0
        # the export's time, apart: splitting fused q/k/v and gate/up into HF tensors, and the rest
        assert metrics["sync/convert_s"] > 0 and metrics["sync/gather_s"] > 0
        rt.synced["rollout"] = 1
        assert_same_logprobs(sampled_logprobs(rt, "rollout", "old_logprob", 4))  # the weights `transport` carried
        colocated = rt.sync_weights()  # only the colocated rollout is behind now
        # two consumers: each one's metrics under its own name
        assert colocated["sync/colo_rollout/handoff_s"] > 0 and colocated["sync/colo_rollout/bytes"] == metrics["sync/bytes"]
        assert colocated["sync/colo_rollout/convert_s"] > 0
        assert not any(k.startswith("sync/rollout/") for k in colocated)
        rt.synced = {"rollout": 0, "colo_rollout": 0}
        both = rt.sync_weights()
        assert both["sync/rollout/bytes"] == both["sync/colo_rollout/bytes"] == metrics["sync/bytes"]
        assert both["timing_s/sync_weights"] >= both["sync/colo_rollout/handoff_s"] + both["sync/rollout/load_s"]
        assert rt.synced == {"rollout": 1, "colo_rollout": 1}

        assert_same_logprobs(sampled_logprobs(rt, "colo_rollout", "colo_logprob", 8))

        # the runtime's own pipe (object store) recorded the rollout's last load, and each colocated
        # rank its engine's: after another update, the trainer's rank 0 writes straight into the
        # separate rollout's parameters, and each trainer rank into its colocated engine's (an MoE
        # rollout's experts too: they are prepacked back into the parameters they arrived in)
        rt.run_step(prompts(12), step=2, nodes=TRAIN_STEP)
        later = rt.sync_weights()
        assert later["sync/rollout/write_s"] > 0 and "sync/rollout/buckets" not in later
        assert later["sync/rollout/convert_s"] > 0 and later["sync/colo_rollout/write_s"] > 0
        assert later["sync/rollout/bytes"] == later["sync/colo_rollout/bytes"] == metrics["sync/bytes"]
        assert_same_logprobs(sampled_logprobs(rt, "rollout", "old_logprob", 12))
        assert_same_logprobs(sampled_logprobs(rt, "colo_rollout", "colo_logprob", 16))


# --- the streaming pieces alone ------------------------------------------------------------------

def test_buckets_pull_only_what_the_next_bucket_needs():
    pulled = []

    def export():
        for i in range(10):
            pulled.append(i)
            yield f"w{i}", torch.full((256,), float(i))  # 1 KiB each

    buckets = Buckets(export(), bucket_bytes=3 * 1024)
    first = buckets.next()
    assert [n for n, _ in first] == ["w0", "w1", "w2"] and pulled == [0, 1, 2]
    rest = []
    while (b := buckets.next()) is not None:
        rest.append([n for n, _ in b])
    assert rest == [["w3", "w4", "w5"], ["w6", "w7", "w8"], ["w9"]]
    assert buckets.stats["sync/bytes"] == 10 * 1024 and buckets.stats["sync/buckets"] == 4
    wire = to_wire([("b", torch.arange(4, dtype=torch.bfloat16))])
    [(name, t)] = list(from_wire(wire))
    assert name == "b" and t.dtype == torch.bfloat16 and t.tolist() == [0, 1, 2, 3]


def test_buckets_never_exceed_their_size_and_a_larger_tensor_travels_alone():
    sizes = [1, 2, 1, 5, 1, 1]  # KiB
    export = ((f"w{i}", torch.zeros(256 * kib)) for i, kib in enumerate(sizes))
    buckets = Buckets(export, bucket_bytes=3 * 1024)
    got = []
    while (b := buckets.next()) is not None:
        got.append([n for n, _ in b])
    assert got == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5"]]


class RecordingEngine:
    """Consumes the weights iterator like an engine does; records what arrived (name and value, read
    when it arrived). `retain` keeps every tensor, as vLLM's nested weight generators keep some."""

    def __init__(self, fail_at: str | None = None, retain: bool = False, fail_once: bool = False):
        self.loaded, self.values, self.version, self.fail_at, self.retain = [], [], 0, fail_at, retain
        self.kept, self.fail_once = [], fail_once

    def load_weights(self, named, version, watch=None, cores=None):
        for name, t in named:
            if name == self.fail_at:
                self.fail_at = None if self.fail_once else name
                raise KeyError(f"no parameter {name}")
            self.loaded.append(name)
            self.values.append(float(t[0]))
            if self.retain:
                self.kept.append(t)
        self.version = version


class ExportingEngine:
    """A trainer engine whose export records how far it was walked (and may fail half-way)."""

    def __init__(self, n: int, fail_at: int | None = None):
        self.n, self.walked, self.fail_at = n, 0, fail_at

    def export_hf_weights(self, copy: bool = True, first_rank_only: bool = False, timings=None):
        for i in range(self.n):
            if i == self.fail_at:
                raise RuntimeError("gather failed")
            self.walked += 1
            yield f"w{i}", torch.full((256,), float(i))  # 1 KiB each


# --- rank to rank through a Ray shared-memory channel ---------------------------------------------

def channel_sync(trainer_engine, *rollout_engines, syncs: int = 1):
    """The keeper's `send` and each rollout rank's `receive` in Ray actors of their own, over one
    channel made once and used `syncs` times; returns every part's result (or exception) per sync,
    the keeper first, and the engines."""
    import ray

    from siirl_dag.weight_sync import RankSync

    @ray.remote(num_cpus=0)
    class Rank:
        def __init__(self, engine):
            self.sync = RankSync({"e": engine})

        def op(self, name, *args):
            return getattr(self.sync, name)(*args)

        def engine(self):
            return self.sync.engines["e"]

    keeper, readers = Rank.remote(trainer_engine), [Rank.remote(e) for e in rollout_engines]
    nodes = ray.get([r.op.remote("node") for r in readers])
    pipe = ray.get(keeper.op.remote("open_channel", "p", list(zip(readers, nodes))))
    ray.get([r.op.remote("attach", "p", pipe) for r in readers])
    results = []
    for version in range(1, syncs + 1):
        calls = [keeper.op.remote("send", "e", 2048, "p")] + [r.op.remote("receive", "e", version, "p") for r in readers]
        out = []
        for call in calls:
            try:
                out.append(ray.get(call, timeout=60))
            except ray.exceptions.RayTaskError as error:
                out.append(error)
        results.append(out)
    return results, ray.get(keeper.engine.remote()), *ray.get([r.engine.remote() for r in readers])


def test_a_new_channel_removes_the_semaphores_ended_ray_sessions_left_behind():
    """Ray names a channel buffer's two semaphores after its raylet and does not always unlink them."""
    from test_leftovers import planted

    with planted("sem.obj{pid}-1795323247401977351", "sem.hdr{pid}-1795323247401977351") as (stale, live):
        [(sent, received)], _, _ = channel_sync(ExportingEngine(3), RecordingEngine())
        assert received["sync/load_s"] > 0
        assert not any(map(os.path.exists, stale)) and all(map(os.path.exists, live))


def test_channel_carries_every_bucket_sync_after_sync_though_the_engine_keeps_references():
    results, trainer, rollout = channel_sync(ExportingEngine(9), RecordingEngine(retain=True), syncs=3)
    for sent, received in results:
        assert sent["sync/buckets"] == 5 and sent["sync/bytes"] == 9 * 1024 and received["sync/load_s"] > 0
    assert rollout.loaded == [f"w{i}" for i in range(9)] * 3 and rollout.version == 3
    assert rollout.values == [float(i) for i in range(9)] * 3, "each tensor holds its own data when loaded"


def test_channel_feeds_every_bucket_to_every_rollout_rank():
    results, _, *rollouts = channel_sync(ExportingEngine(9), RecordingEngine(), RecordingEngine(retain=True), syncs=2)
    assert all(not isinstance(part, Exception) for parts in results for part in parts)
    for rollout in rollouts:
        assert rollout.values == [float(i) for i in range(9)] * 2 and rollout.version == 2


def test_channel_a_failed_load_still_takes_the_whole_stream():
    [(sent, received)], trainer, rollout = channel_sync(ExportingEngine(40), RecordingEngine(fail_at="w3"))
    assert sent["sync/buckets"] == 20 and trainer.walked == 40, "the trainer's export is walked to its end"
    assert "no parameter w3" in str(received) and rollout.version == 0


def test_channel_a_failed_export_fails_the_load_and_keeps_the_old_version():
    [(sent, received)], trainer, rollout = channel_sync(ExportingEngine(40, fail_at=7), RecordingEngine())
    assert "gather failed" in str(sent)
    assert "the trainer's weight export failed" in str(received) and "gather failed" in str(received)
    assert rollout.version == 0 and rollout.loaded == [f"w{i}" for i in range(6)]  # w6 was in the failed bucket


# --- the driver's stream protocol, with recording engines -----------------------------------------

def sync_runtime(backend, trainer, *rollouts):
    """What WeightSync reads of a Runtime: one trainer rank (engine "t") and rollout ranks ("r") on
    one machine of two devices."""
    from types import SimpleNamespace

    return SimpleNamespace(backend=backend, roles={"update": [(trainer, SimpleNamespace(engine_key="t"))],
                                                   "rollout": [(r, SimpleNamespace(engine_key="r")) for r in rollouts]},
                           pipe=SimpleNamespace(runtime=SimpleNamespace(weight_sync_bucket_mb=2 / 1024, address=None,
                                                                        cpus_per_rank=1),
                                                cluster=SimpleNamespace(device="cpu", nodes=1, devices_per_node=2),
                                                nodes={"rollout": SimpleNamespace(mesh="gen")},
                                                plan=SimpleNamespace(meshes={"gen": _mesh([0] * len(rollouts))})))


def _mesh(machines):
    """A placed mesh whose ranks sit on these machines."""
    from types import SimpleNamespace

    return SimpleNamespace(ranks=[SimpleNamespace(machine=m) for m in machines])


def test_rollout_ranks_finish_their_loads_with_the_cores_of_their_machine():
    """A sync runs while every other rank waits: each machine's cores are split among its rollout
    ranks (vLLM's CPU re-pack scales with threads); GPUs and one process keep their own threads."""
    from types import SimpleNamespace

    rt = sync_runtime(SimpleNamespace(name="ray"), None, None)
    rt.pipe.cluster.devices_per_node, rt.pipe.runtime.cpus_per_rank = 4, 2
    rt.pipe.plan.meshes["gen"] = _mesh([0, 0, 0, 1])
    assert WeightSync(rt)._cores("rollout") == [2, 2, 2, 8]
    rt.pipe.runtime.cpus_per_rank = 0.5
    assert WeightSync(rt)._cores("rollout") == [1, 1, 1, 2]
    rt.backend.name = "local"
    assert WeightSync(rt)._cores("rollout") == [None] * 4
    rt.backend.name, rt.pipe.cluster.device = "ray", "cuda"
    assert WeightSync(rt)._cores("rollout") == [None] * 4


def stream_sync(trainer_engine, rollout_engine):
    """One sync in process (runtime.backend=local)."""
    from siirl_dag.runtime.backends import LocalBackend
    from siirl_dag.runtime.worker import RankWorker

    trainer, rollout = RankWorker("train", 0, 1), RankWorker("gen", 0, 1)
    trainer.engines["t"], rollout.engines["r"] = trainer_engine, rollout_engine
    return WeightSync(sync_runtime(LocalBackend(None), trainer, rollout))("update", "rollout", 7)


def _group_member(rank: int, port: int, results) -> None:
    """Rank 0 writes once a reader (rank 2) is dead, then closes; rank 1 reads; rank 2 dies."""
    import signal
    import time

    from siirl_dag.weight_sync.collective import SyncGroup

    group, t0 = SyncGroup("127.0.0.1", port, rank, 3, "cpu"), time.monotonic()
    if rank == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        if rank == 0:
            time.sleep(1)
            group.write([("w", torch.ones(1000))])
        else:
            group.read()
        results.put((rank, "no error", time.monotonic() - t0))
    except RuntimeError as error:
        results.put((rank, str(error)[:200], time.monotonic() - t0))
    finally:
        if rank == 0:
            group.close()
            time.sleep(90)  # still holding the group, as a failed sync's traceback may


def test_readers_of_a_collective_whose_reader_died_fail_at_once_not_after_the_timeout():
    import multiprocessing as mp

    from dist_utils import _free_port

    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), _free_port()
    members = [ctx.Process(target=_group_member, args=(rank, port, results)) for rank in range(3)]
    for member in members:
        member.start()
    try:
        got = dict((rank, (error, seconds)) for rank, error, seconds in (results.get(timeout=120) for _ in range(2)))
    finally:
        for member in members:
            member.kill()
    assert "Connection closed" in got[0][0], "the writer finds the dead reader"
    assert "Connection closed" in got[1][0] and got[1][1] < 30, "the other reader is let go when the writer closes"


def _install(worker, key, engine):
    worker.engines[key] = engine


def _pipes(worker):
    return sorted(worker._weight_sync.pipes) if worker._weight_sync else []


@pytest.mark.parametrize("transport", ["object_store", "collective"])
def test_a_failed_sync_retires_its_pipe_on_every_rank_and_the_next_sync_makes_a_new_one(transport):
    import ray

    from siirl_dag.runtime.backends import RayBackend
    from siirl_dag.runtime.worker import RankWorker

    trainer, rollout = (ray.remote(RankWorker).options(num_cpus=0).remote(group, 0, 1) for group in ("train", "gen"))
    ray.get([trainer.__ray_call__.remote(_install, "t", ExportingEngine(6)),
             rollout.__ray_call__.remote(_install, "r", RecordingEngine(fail_at="w3", fail_once=True))])
    rt = sync_runtime(None, trainer, rollout)
    rt.backend = RayBackend(rt.pipe)
    sync = WeightSync(rt)
    with pytest.raises(KeyError, match="no parameter w3"):
        sync("update", "rollout", 1, transport=transport)
    assert ray.get([w.__ray_call__.remote(_pipes) for w in (trainer, rollout)]) == [[], []]
    metrics = sync("update", "rollout", 2, transport=transport)
    assert metrics["sync/buckets"] == 3
    engine = ray.get(rollout.__ray_call__.remote(lambda w: w.engines["r"]))
    assert engine.version == 2 and engine.loaded == ["w0", "w1", "w2"] + [f"w{i}" for i in range(6)]
    pipes = ray.get([w.__ray_call__.remote(_pipes) for w in (trainer, rollout)])
    assert pipes[0] == pipes[1] and len(pipes[0]) == 1


def test_a_restarted_rollout_group_gets_a_new_pipe_and_the_trainer_lets_the_old_one_go():
    import ray

    from siirl_dag.runtime.backends import RayBackend
    from siirl_dag.runtime.worker import RankWorker

    def worker(group, key, engine):
        w = ray.remote(RankWorker).options(num_cpus=0).remote(group, 0, 1)
        ray.get(w.__ray_call__.remote(_install, key, engine))
        return w

    trainer, old = worker("train", "t", ExportingEngine(6)), worker("gen", "r", RecordingEngine())
    rt = sync_runtime(None, trainer, old)
    rt.backend = RayBackend(rt.pipe)
    sync = WeightSync(rt)
    sync("update", "rollout", 1)
    first = ray.get(trainer.__ray_call__.remote(_pipes))
    new = worker("gen", "r", RecordingEngine())
    rt.roles["rollout"] = [(new, rt.roles["rollout"][0][1])]  # what Runtime._restart_group does
    assert sync("update", "rollout", 2)["sync/buckets"] == 3
    pipes = ray.get([w.__ray_call__.remote(_pipes) for w in (trainer, new, old)])
    assert pipes[0] == pipes[1] and len(pipes[0]) == 1 and pipes[0] != first and pipes[2] == []


def test_stream_delivers_every_bucket_in_order_and_stamps_the_version():
    engine = RecordingEngine()
    metrics = stream_sync(ExportingEngine(6), engine)
    assert engine.loaded == [f"w{i}" for i in range(6)] and engine.version == 7
    assert metrics["sync/buckets"] == 3 and metrics["sync/bytes"] == 6 * 1024 and metrics["sync/load_s"] > 0


def test_a_failed_load_drains_the_trainers_export_and_keeps_the_old_version():
    engine, trainer = RecordingEngine(fail_at="w3"), ExportingEngine(40)
    with pytest.raises(KeyError, match="no parameter w3"):
        stream_sync(trainer, engine)
    assert engine.version == 0 and engine.loaded == ["w0", "w1", "w2"]
    assert trainer.walked == 40, "the trainer's export (collective on its ranks) is walked to its end"


def test_a_failed_colocated_load_still_walks_the_trainers_export_to_its_end():
    from siirl_dag.weight_sync.rank import handoff

    trainer, engine = ExportingEngine(40), RecordingEngine(fail_at="w3")
    with pytest.raises(KeyError, match="no parameter w3"):
        handoff(trainer, engine, 1)
    assert trainer.walked == 40, "the other trainer ranks are not left waiting in the export's collectives"
    assert engine.version == 0


def test_a_sync_puts_the_exporting_trainer_on_the_device_first():
    """A third engine of the rank (a critic that updated after the actor, say) held the device: the
    trainer's parameters must be back before its export reads them."""
    from siirl_dag.runtime.worker import RankWorker

    events = []

    def resident(engine, name):
        engine.onload, engine.offload = (lambda: events.append(f"{name} on")), (lambda: events.append(f"{name} off"))
        return engine

    worker = RankWorker("train", 0, 1)
    worker.engines = {"t": resident(ExportingEngine(2), "t"), "r": resident(RecordingEngine(), "r"),
                      "c": resident(RecordingEngine(), "c")}
    worker.active = "c"
    worker.sync_handoff("t", "r", 1)
    assert events == ["c off", "t on", "r on", "t off"] and worker.active == "r"
    assert worker.engines["r"].loaded == ["w0", "w1"]
    events.clear()
    worker.active = "c"
    worker.weight_sync("export", "t", 2048)
    assert events == ["c off", "t on"] and worker.active == "t"
