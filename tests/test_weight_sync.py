"""Weight sync trainer -> rollout through the real stack: Megatron ranks (TP2, PP2, EP2 MoE) train a
step, the new weights reach vLLM engines on a separate mesh (shared memory, or a gloo process group)
and on the trainer's own ranks (in-process handoff), and vLLM's log-probs of what it samples then equal
Megatron's; a corruption planted in the pipe is caught by the verification. Plus the pieces alone:
buckets, each path between Ray actors, failures, and the decision table."""

from __future__ import annotations

import os

import pytest
import torch

from siirl_dag.config import load_pipeline
from siirl_dag.placement.allocation import parse_allocation
from siirl_dag.runtime import Batch, PipelineError, Runtime
from siirl_dag.runtime.worker import RankWorker
from siirl_dag.weight_sync.path import Placed
from siirl_dag.weight_sync.stream import Buckets

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
runtime: {{backend: ray, cpus_per_rank: 0.25, weight_sync_bucket_mb: 0.05, weight_sync_path: {path},
           verify_probe_every: 1, fan_out: {fan_out}}}
"""
# load_format dummy: random weights until the runtime's start-up sync (which the first assertion checks)
ROLLOUT = ("{n: 2, temperature: 1.0, dtype: float32, kv_cache_gb: 0.05, max_model_len: 32, enforce_eager: true, "
           "load_format: dummy}")
TRAIN_STEP = ["rollout", "reward", "advantage", "old_logprob", "actor_update"]
LOGPROB_INPUTS = ["input_ids", "attention_mask", "position_ids", "responses", "response_mask"]
# trainer layout -> (allocation, its world size, MoE model, path between the separate meshes, the separate
# rollout's allocation: the MoE one shards its experts over two TP ranks, runtime.fan_out). No TP1 layout of
# its own (each layout is an engine start-up of about two minutes): a one-rank trainer's sync to real engines
# runs in test_e2e, test_weight_sync_delta and test_lora_sync, and pp2 asks for `auto` (shared memory on one
# CPU machine). ep2 calls every rank through leaders (fan_out 1), as meshes of more than 64 ranks are called
LAYOUTS = {
    "tp2": ("t2", 2, False, "process_group", "d1", 0),
    "pp2": ("p2", 2, False, "auto", "d1", 0),
    "ep2": ("d2e2", 2, True, "process_group", "t2", 1),
}


@pytest.fixture(scope="module")
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


def _compute_logprobs(worker: RankWorker, key: str, batch: dict) -> dict:
    return worker.engines[key].compute_logprobs(batch)


def _zero_a_layer_after_the_next_load(worker: RankWorker) -> None:
    """Planted in a colocated rollout's process: the engine's next load ends with one layer's output
    projection zeroed inside vLLM (what it computes with), though every tensor reached its loader."""
    from siirl_dag.strategies.vllm.rollout import VllmRollout

    load = VllmRollout.load_weights

    def corrupted(self, named_tensors, version):
        load(self, named_tensors, version)
        VllmRollout.load_weights = load
        self.llm.collective_rpc(lambda w: w.model_runner.get_model().model.layers[0].self_attn.o_proj.weight.data.zero_())

    VllmRollout.load_weights = corrupted


def _zero_half_of_a_tensor(worker: RankWorker) -> None:
    """Planted in a rollout rank's process: the pipe delivers the first bucket with half of its first
    tensor zeroed (a shard lost in transit), once."""
    from siirl_dag.weight_sync import shared_memory, process_group

    for cls in (shared_memory.ChannelPipe, process_group.SyncGroup):
        read = cls.read

        def corrupted(self, read=read, cls=cls):
            payload = read(self)
            if isinstance(payload, list):
                cls.read = read
                name, t = payload[0]
                payload[0] = (name, torch.cat([t.flatten()[: t.numel() // 2], t.new_zeros(t.numel() - t.numel() // 2)]).view(t.shape))
            return payload

        cls.read = corrupted


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("layout", LAYOUTS)
def test_trained_weights_reach_separate_and_colocated_rollouts(tmp_path, tiny_model_dir, moe_model_dir, layout):
    train, world, moe, path, gen, fan_out = LAYOUTS[layout]
    f = tmp_path / "p.yaml"
    devices = world + parse_allocation(f"vllm:{gen}")[0].dims.world_size
    f.write_text(PIPELINE.format(devices=devices, model=moe_model_dir if moe else tiny_model_dir, train=train,
                                 world=world, gen=gen, rollout=ROLLOUT, path=path, fan_out=fan_out))
    with Runtime(load_pipeline(f, []), progress=lambda *_: None) as rt:
        assert len(rt.backend.fan.leaders) == 4 * fan_out  # the trainer's two ranks, the rollout's two
        expected = "shared_memory" if path == "auto" else path
        assert rt.routes["rollout"].path == expected and rt.routes["colo_rollout"].path == "colocated"
        step = rt.collect(rt.run_step(prompts(0), step=0, nodes=TRAIN_STEP),
                          LOGPROB_INPUTS + ["rollout_logprobs", "old_logprobs"])
        assert_same_logprobs(step)  # rollout and trainer agree on the initial weights (start() synced them)
        assert rt.versions.trainer["actor_update"] == 1 and rt.versions.held == {"rollout": 0, "colo_rollout": 0}

        # staleness 0: a rollout still holding version 0 refuses to generate
        with pytest.raises(PipelineError, match="would generate with weights version 0, older than version 1"):
            rt.run_step(prompts(4), step=1, nodes=["rollout"])

        # the update changed what the trainer computes on the rows it trained on
        trained = rt.backend.get([w.__ray_call__.remote(_compute_logprobs, role.engine_key, dict(step.only(LOGPROB_INPUTS)))
                                  for w, role in rt.roles["old_logprob"]])[0]["logprobs"]
        mask = step["response_mask"].bool()
        assert (trained - step["old_logprobs"])[mask].abs().max() > 1e-2

        # a shard lost in transit: the verification names the tensor, and the rollout refuses to generate
        rt.backend.get([w.__ray_call__.remote(_zero_half_of_a_tensor) for w, _ in rt.roles["rollout"]])
        with pytest.raises(PipelineError, match=r"weight sync 'actor_update' -> 'rollout' \(version 1, path "
                                                rf"{expected}\) failed: .*tensor '[\w.]+' reached the engine with other values"):
            rt.sync_weights()
        with pytest.raises(PipelineError, match="would generate with weights version 0, older than version 1"):
            rt.run_step(prompts(4), step=1, nodes=["rollout"])

        both = rt.sync_weights()  # a new pipe, and the colocated rollout too
        assert rt.versions.held == {"rollout": 1, "colo_rollout": 1}
        # the probe: both engines compute the same log-probs of a fixed batch (fp32: within 1e-5 here)
        assert both["sync/rollout/probe_diff"] < 1e-4 and both["sync/colo_rollout/probe_diff"] < 1e-4
        assert both["sync/rollout/buckets"] > 5, "a small bucket size cuts the model into many buckets"
        assert both["sync/rollout/bytes"] == both["sync/colo_rollout/bytes"] > 0
        assert both["sync/rollout/load_s"] > 0 and both["sync/colo_rollout/handoff_s"] > 0
        # the export's time, apart: splitting fused q/k/v and gate/up into HF tensors, and the rest
        assert both["sync/rollout/convert_s"] > 0 and both["sync/rollout/gather_s"] > 0
        assert both["timing_s/sync_weights"] >= both["sync/colo_rollout/handoff_s"] + both["sync/rollout/load_s"]
        assert_same_logprobs(sampled_logprobs(rt, "rollout", "old_logprob", 4))
        assert_same_logprobs(sampled_logprobs(rt, "colo_rollout", "colo_logprob", 8))

        rt.run_step(prompts(12), step=2, nodes=TRAIN_STEP)  # a later step through the same pipe
        later = rt.sync_weights()
        assert later["sync/rollout/bytes"] == later["sync/colo_rollout/bytes"] == both["sync/rollout/bytes"]
        assert_same_logprobs(sampled_logprobs(rt, "rollout", "old_logprob", 12))
        assert_same_logprobs(sampled_logprobs(rt, "colo_rollout", "colo_logprob", 16))

        # a layer zeroed inside the colocated rollout's engine after its load: the probe sees it
        rt.run_step(prompts(20), step=3, nodes=TRAIN_STEP)
        rt.backend.get([w.__ray_call__.remote(_zero_a_layer_after_the_next_load) for w, _ in rt.roles["colo_rollout"]])
        with pytest.raises(PipelineError, match=r"weight sync 'actor_update' -> 'colo_rollout' \(version 3, path colocated"
                                                r"\) failed: the rollout's log-probs of a fixed probe differ from the "
                                                r"trainer's by [\d.e-]+ on average"):
            rt.sync_weights()


# --- the pieces alone, with engines that record what they get -----------------------------------------

class RecordingEngine:
    """Consumes the weights iterator like an engine does; records what arrived (name and value, read
    when it arrived). `retain` keeps every tensor, as vLLM's nested weight generators keep some."""

    def __init__(self, fail_at: str | None = None, retain: bool = False, fail_once: bool = False):
        self.loaded, self.values, self.version, self.fail_at, self.retain = [], [], 0, fail_at, retain
        self.kept, self.fail_once = [], fail_once

    def load_weights(self, named, version):
        for name, t in named:
            if name == self.fail_at:
                self.fail_at = None if self.fail_once else name
                raise KeyError(f"no parameter {name}")
            self.loaded.append(name)
            self.values.append(float(t[0]))
            if self.retain:
                self.kept.append(t)
        self.version = version

    def offload(self):
        pass

    def onload(self):
        pass


class ExportingEngine:
    """A trainer engine whose export records how far it was walked (and may fail half-way)."""

    def __init__(self, n: int, fail_at: int | None = None):
        self.n, self.walked, self.fail_at = n, 0, fail_at

    def export_hf_weights(self, copy: bool = True, first_rank_only: bool = False, timings=None, what="merged"):
        for i in range(self.n):
            if i == self.fail_at:
                raise RuntimeError("gather failed")
            self.walked += 1
            yield f"w{i}", torch.full((256,), float(i))  # 1 KiB each

    def offload(self):
        pass

    def onload(self):
        pass


def test_buckets_pull_only_what_the_next_bucket_needs():
    pulled = []

    def export():
        for i in range(10):
            pulled.append(i)
            yield f"w{i}", torch.full((256,), float(i))  # 1 KiB each

    buckets = Buckets(export(), 3 * 1024, {})
    first = buckets.next()
    assert [n for n, _ in first] == ["w0", "w1", "w2"] and pulled == [0, 1, 2]
    rest = []
    while (b := buckets.next()) is not None:
        rest.append([n for n, _ in b])
    assert rest == [["w3", "w4", "w5"], ["w6", "w7", "w8"], ["w9"]]
    assert buckets.stats["sync/bytes"] == 10 * 1024 and buckets.stats["sync/buckets"] == 4


def test_buckets_never_exceed_their_size_and_a_larger_tensor_travels_alone():
    sizes = [1, 2, 1, 5, 1, 1]  # KiB
    buckets = Buckets(((f"w{i}", torch.zeros(256 * kib)) for i, kib in enumerate(sizes)), 3 * 1024, {})
    got = []
    while (b := buckets.next()) is not None:
        got.append([n for n, _ in b])
    assert got == [["w0", "w1"], ["w2"], ["w3"], ["w4", "w5"]]


def _install(worker: RankWorker, key: str, engine) -> None:
    worker.engines[key] = engine


def _engine(worker: RankWorker, key: str):
    return worker.engines[key]


def _pipes(worker: RankWorker) -> list[str]:
    return sorted(worker.pipes)


def ray_worker(group: str, key: str, engine):
    import ray

    w = ray.remote(RankWorker).options(num_cpus=0).remote(group, 0, 1)
    ray.get(w.__ray_call__.remote(_install, key, engine))
    return w


def placed(backend, trainer, *rollouts, verify: bool = True) -> Placed:
    return Placed("update", "rollout", backend, [(trainer, "t")], [(r, "r") for r in rollouts], 2048, verify, "cpu")


def ray_placed(trainer_engine, *rollout_engines, verify: bool = True) -> Placed:
    from types import SimpleNamespace

    from siirl_dag.runtime.backends import RayBackend

    workers = [ray_worker("train", "t", trainer_engine)] + [ray_worker("gen", "r", e) for e in rollout_engines]
    return placed(RayBackend(SimpleNamespace(runtime=SimpleNamespace(address=None, fan_out=0))), *workers, verify=verify)


def engines(pair: Placed) -> list:
    import ray

    return ray.get([w.__ray_call__.remote(_engine, key) for w, key in pair.trainer_ranks + pair.rollout_ranks])


def pipes(pair: Placed) -> list:
    import ray

    return ray.get([w.__ray_call__.remote(_pipes) for w, _ in pair.trainer_ranks + pair.rollout_ranks])


STREAMED = ["shared_memory", "process_group"]


def streamed(name: str, pair: Placed):
    from siirl_dag.weight_sync.process_group import ProcessGroup
    from siirl_dag.weight_sync.shared_memory import SharedMemory

    return {"shared_memory": SharedMemory, "process_group": ProcessGroup}[name](pair)


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("path", STREAMED)
def test_every_bucket_reaches_every_rollout_rank_sync_after_sync_though_the_engine_keeps_references(path):
    pair = ray_placed(ExportingEngine(9), RecordingEngine(), RecordingEngine(retain=True))
    sync = streamed(path, pair)
    for version in (1, 2, 3):
        stats = sync.sync(version)
        assert stats["sync/buckets"] == 5 and stats["sync/bytes"] == 9 * 1024 and stats["sync/load_s"] > 0
    for rollout in engines(pair)[1:]:
        assert rollout.loaded == [f"w{i}" for i in range(9)] * 3 and rollout.version == 3
        assert rollout.values == [float(i) for i in range(9)] * 3, "each tensor holds its own data when loaded"


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("path", STREAMED)
def test_a_failed_load_still_takes_the_whole_stream_and_close_retires_the_pipe_on_every_rank(path):
    pair = ray_placed(ExportingEngine(40), RecordingEngine(fail_at="w3", fail_once=True))
    sync = streamed(path, pair)
    with pytest.raises(Exception, match="no parameter w3"):
        sync.sync(1)
    trainer, rollout = engines(pair)
    assert trainer.walked == 40, "the trainer's export is walked to its end" and rollout.version == 0
    assert all(len(p) == 1 for p in pipes(pair))
    sync.close()  # what the runtime does with a path that failed
    assert pipes(pair) == [[], []]
    assert streamed(path, pair).sync(2)["sync/buckets"] == 20  # the next path makes a new pipe
    assert engines(pair)[1].version == 2


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_a_failed_export_fails_the_load_and_keeps_the_old_version():
    pair = ray_placed(ExportingEngine(40, fail_at=7), RecordingEngine())
    with pytest.raises(Exception, match="gather failed"):
        streamed("shared_memory", pair).sync(1)
    _, rollout = engines(pair)
    assert rollout.version == 0 and rollout.loaded == [f"w{i}" for i in range(6)]  # w6 was in the failed bucket


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_a_new_channel_removes_the_semaphores_ended_ray_sessions_left_behind():
    """Ray names a channel buffer's two semaphores after its raylet and does not always unlink them."""
    from test_orphan_files import planted

    with planted("sem.obj{pid}-1795323247401977351", "sem.hdr{pid}-1795323247401977351") as (stale, live):
        streamed("shared_memory", ray_placed(ExportingEngine(3), RecordingEngine())).sync(1)
        assert not any(map(os.path.exists, stale)) and all(map(os.path.exists, live))


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
def test_a_restarted_rollout_gets_a_new_pipe_and_the_trainer_lets_the_old_one_go():
    pair = ray_placed(ExportingEngine(6), RecordingEngine())
    old = streamed("shared_memory", pair)
    old.sync(1)
    old.close()  # what runtime.recovery.Recovery._restart_group does before it replaces the rollout's workers
    new_worker = ray_worker("gen", "r", RecordingEngine())
    new = streamed("shared_memory", placed(pair.backend, pair.trainer_ranks[0][0], new_worker))
    assert new.sync(2)["sync/buckets"] == 3
    trainer_pipes, old_pipes = pipes(pair)
    assert trainer_pipes == [new.name] and old_pipes == []


def test_a_resync_after_a_restart_stamps_an_update_that_landed_and_is_not_counted_yet(tmp_path):
    """async: a rollout rebuilt while its trainer's update (another batch's job) runs gets the weights
    after that update, so they carry the version the update makes once it is collected."""
    from types import SimpleNamespace

    from siirl_dag.weight_sync.syncs import WeightSyncs
    from siirl_dag.weight_sync.versions import WeightVersions
    from test_config import BASE, write

    class Path:  # the path's own behaviour is tested above; here only the version it is given
        def __init__(self):
            self.versions = []

        def start(self, version):
            self.versions.append(version)
            return lambda: {"sync/bytes": 1}

    pipe = load_pipeline(write(tmp_path, BASE))
    rt = SimpleNamespace(pipe=pipe, versions=WeightVersions.of(pipe), trace=None)
    rt.versions.trainer["actor_update"] = 3
    syncs = WeightSyncs(rt)
    syncs.paths["rollout"] = path = Path()
    assert "timing_s/sync_weights" in syncs.run(landed=frozenset({"actor_update"}))
    assert path.versions == [4] and rt.versions.held == {"rollout": 4}
    rt.versions.trainer["actor_update"] = 4  # the update's job collected: nothing left to send
    assert syncs.run() == {} and path.versions == [4]


# --- in one process (runtime.backend=local), and verification -------------------------------------------

def local_sync(trainer_engine, rollout_engine, verify: bool = True, version: int = 7):
    from siirl_dag.runtime.backends import LocalBackend
    from siirl_dag.weight_sync.in_process import InProcess

    trainer, rollout = RankWorker("train", 0, 1), RankWorker("gen", 0, 1)
    trainer.engines["t"], rollout.engines["r"] = trainer_engine, rollout_engine
    return InProcess(placed(LocalBackend(None), trainer, rollout, verify=verify)).sync(version)


def test_in_process_delivers_every_bucket_in_order_and_stamps_the_version():
    engine = RecordingEngine()
    metrics = local_sync(ExportingEngine(6), engine)
    assert engine.loaded == [f"w{i}" for i in range(6)] and engine.version == 7
    assert metrics["sync/buckets"] == 3 and metrics["sync/bytes"] == 6 * 1024 and metrics["sync/verify_s"] > 0


def test_a_failed_load_drains_the_trainers_export_and_keeps_the_old_version():
    engine, trainer = RecordingEngine(fail_at="w3"), ExportingEngine(40)
    with pytest.raises(KeyError, match="no parameter w3"):
        local_sync(trainer, engine)
    assert engine.version == 0 and engine.loaded == ["w0", "w1", "w2"]
    assert trainer.walked == 40, "the trainer's export (collective on its ranks) is walked to its end"


@pytest.fixture
def dropping_the_second_bucket(monkeypatch):
    from siirl_dag.weight_sync.in_process import LocalPipe

    read, seen = LocalPipe.read, []

    def dropping(self):
        payload = read(self)
        seen.append(payload)
        return read(self) if len(seen) == 2 else payload

    monkeypatch.setattr(LocalPipe, "read", dropping)


def test_a_skipped_bucket_is_caught_and_named(dropping_the_second_bucket):
    from siirl_dag.weight_sync.fingerprints import SyncMismatch

    engine = RecordingEngine()
    with pytest.raises(SyncMismatch, match=r"2 tensor\(s\) the trainer sent never reached the engine, first 'w2'"):
        local_sync(ExportingEngine(6), engine)
    assert engine.version == 0, "a load that did not verify is not stamped"


def test_without_verification_a_skipped_bucket_goes_unnoticed(dropping_the_second_bucket):
    engine = RecordingEngine()
    local_sync(ExportingEngine(6), engine, verify=False)
    assert engine.loaded == ["w0", "w1", "w4", "w5"] and engine.version == 7


def test_a_changed_value_is_named_with_its_tensor():
    from siirl_dag.weight_sync.fingerprints import Fingerprints, SyncMismatch

    sent, got = Fingerprints(), Fingerprints()
    for name, t in (("a", torch.arange(100.0)), ("b", torch.ones(3, 40))):
        sent.add(name, t)
        got.add(name, t.clone())
    got.check(sent.on_host())
    shard = torch.ones(3, 40)
    shard[2:] = 0  # the last third zeroed
    got.add("b", shard)
    with pytest.raises(SyncMismatch, match=r"tensor 'b' reached the engine with other values than the trainer sent "
                                           r"\(sampled element 11 of 16: 0.0 received, 1.0 sent"):
        got.check(sent.on_host())


def test_the_probe_batch_is_fixed_and_its_check_has_a_tolerance_per_precision():
    from siirl_dag.weight_sync.probe import check as check_probe
    from siirl_dag.weight_sync.probe import probe_batch
    from siirl_dag.weight_sync.fingerprints import SyncMismatch

    batch = probe_batch(450)
    assert torch.equal(batch["input_ids"], probe_batch(450)["input_ids"]) and batch["input_ids"].max() < 450
    assert batch["responses"].shape == (2, 15) and bool(batch["response_mask"].all())
    trainer = -5 * torch.rand(2, 15)
    assert check_probe(trainer, trainer + 5e-4, float32=True) == pytest.approx(5e-4, rel=1e-3)
    assert check_probe(trainer, trainer + 0.05, float32=False) == pytest.approx(0.05, rel=1e-3)
    with pytest.raises(SyncMismatch, match=r"differ from the trainer's by 0.05 on average \(at most 0.05; tolerance 0.001\)"):
        check_probe(trainer, trainer + 0.05, float32=True)
    with pytest.raises(SyncMismatch):
        check_probe(trainer, torch.full_like(trainer, float("nan")), float32=False)


def test_a_failed_colocated_load_still_walks_the_trainers_export_to_its_end():
    from siirl_dag.weight_sync.stream import handoff

    trainer, engine = ExportingEngine(40), RecordingEngine(fail_at="w3")
    with pytest.raises(KeyError, match="no parameter w3"):
        handoff(trainer, engine, 1, "model")
    assert trainer.walked == 40, "the other trainer ranks are not left waiting in the export's collectives"
    assert engine.version == 0


def test_a_sync_puts_the_exporting_trainer_on_the_device_first(monkeypatch):
    """A third engine of the rank (a critic that updated after the actor, say) held the device: the
    trainer's parameters must be back before its export reads them. The allocator's cache (the trainer's
    last activations) is given back before the rollout wakes."""
    from siirl_dag.weight_sync import rank

    events = []
    monkeypatch.setattr(rank, "free_allocator_cache", lambda: events.append("cache freed"))

    def resident(engine, name):
        engine.onload, engine.offload = (lambda: events.append(f"{name} on")), (lambda: events.append(f"{name} off"))
        return engine

    worker = RankWorker("train", 0, 1)
    worker.engines = {"t": resident(ExportingEngine(2), "t"), "r": resident(RecordingEngine(), "r"),
                      "c": resident(RecordingEngine(), "c")}
    worker.active = "c"
    worker.handoff_weights("t", "r", 1, "model")
    assert events == ["c off", "cache freed", "t on", "r on", "t off"] and worker.active == "r"
    assert worker.engines["r"].loaded == ["w0", "w1"]
    events.clear()
    worker.active = "t"  # the usual turn: the trainer just updated
    worker.handoff_weights("t", "r", 2, "model")
    assert events == ["cache freed", "r on", "t off"] and worker.active == "r"
    events.clear()
    worker.active = "c"
    worker.walk_export("t", "model")
    assert events == ["c off", "t on"] and worker.active == "t"


def _group_member(rank: int, port: int, results) -> None:
    """Rank 0 writes once a reader (rank 2) is dead, then closes; rank 1 reads; rank 2 dies."""
    import signal
    import time

    from siirl_dag.weight_sync.process_group import SyncGroup

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


@pytest.mark.engines
def test_readers_of_a_process_group_whose_reader_died_fail_at_once_not_after_the_timeout():
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
    # gloo says "Connection closed by peer" or, when the peer's socket goes with a reset, "Connection reset by peer"
    gone = ("Connection closed", "Connection reset")
    assert any(g in got[0][0] for g in gone), "the writer finds the dead reader"
    assert any(g in got[1][0] for g in gone) and got[1][1] < 30, "the other reader is let go when the writer closes"
