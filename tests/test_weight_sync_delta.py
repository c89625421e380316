"""Delta weight sync (weight_sync.mode=delta): bf16 buckets rebuilt bit for bit from their XOR
deltas; the in-process path sends deltas after a first full sync and heals a dropped bucket or a
missed version with a full sync; the route table's choice of mode; and through the real stack
(a Megatron rank, a vLLM engine, over shared memory and a gloo group, the model or LoRA adapters):
the bytes the engine loads equal the trainer's, vLLM's log-probs equal Megatron's, a missed
version is healed."""

from __future__ import annotations

import pytest
import torch

from siirl_dag.weight_sync import delta
from siirl_dag.weight_sync.delta import DeltaMismatch
from test_weight_sync import (LOGPROB_INPUTS, TRAIN_STEP, RecordingEngine, assert_same_logprobs, placed, prompts,  # noqa: F401
                              ray_session, sampled_logprobs)


def bf16_bucket(seed: int, lr: float = 0.0, base: list | None = None) -> list:
    """A bucket of bf16 tensors, or `base` after a sign-Adam-like step of size `lr` (what Adam's first step is)."""
    g = torch.Generator().manual_seed(seed)
    if base is None:
        return [(f"w{i}", (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16))
                for i, shape in enumerate([(64, 48), (48,), (7, 3, 5)])]
    return [(n, (t.float() - lr * torch.randn(t.shape, generator=g).sign()).to(torch.bfloat16)) for n, t in base]


def bits(bucket: list) -> list:
    return [(n, t.view(torch.int16).clone()) for n, t in bucket]


@pytest.mark.parametrize("lr", [1e-6, 2e-4, 1e-1])
def test_a_bf16_bucket_is_rebuilt_bit_for_bit_from_its_delta(lr):
    old = bf16_bucket(0)
    new = bf16_bucket(1, lr, old)
    base, raw, layout = delta.to_bytes(old), delta.to_bytes(new), delta.layout_of(new)
    d = delta.encode(3, 7, base, raw, layout)
    assert (d.index, d.base) == (3, 7)
    rebuilt = delta.from_bytes(d.layout, delta.decode(d, base))
    assert [(n, t.shape, t.dtype) for n, t in rebuilt] == [(n, t.shape, t.dtype) for n, t in new]
    for (_, got), (_, want) in zip(bits(rebuilt), bits(new)):
        assert torch.equal(got, want)
    if lr == 1e-6:  # below bf16's resolution but for the weights nearest zero: the delta is a few bytes
        assert len(d.data) < raw.nbytes / 10


def test_a_delta_applied_to_other_bytes_than_its_base_is_refused():
    old = bf16_bucket(0)
    base, raw = delta.to_bytes(old), delta.to_bytes(bf16_bucket(1, 1e-2, old))
    d = delta.encode(0, 1, base, raw, delta.layout_of(old))
    other = base.copy()
    other[5] ^= 1  # one bit
    with pytest.raises(DeltaMismatch, match=r"bucket 0 \(first tensor 'w0'\) was rebuilt from its delta with other bytes"):
        delta.decode(d, other)


# --- through the in-process path, with engines that record what they get --------------------------------

class SteppingEngine:
    """A trainer whose export is bf16 tensors that change a little at every version (`step`)."""

    def __init__(self, lr: float = 2e-4):
        self.tensors, self.lr, self.seed = bf16_bucket(0), lr, 0
        self.tensors += [(f"v{i}", t.clone()) for i, (_, t) in enumerate(bf16_bucket(5))]

    def step(self) -> None:
        self.seed += 1
        self.tensors = bf16_bucket(self.seed, self.lr, self.tensors)

    def export_hf_weights(self, copy=True, first_rank_only=False, timings=None, what="merged"):
        yield from self.tensors

    def offload(self):
        pass

    def onload(self):
        pass


class KeepingEngine(RecordingEngine):
    """Records the bits of every tensor of its last load."""

    def load_weights(self, named, version):
        self.got = {}
        for name, t in named:
            self.got[name] = t.view(torch.int16).clone()
        self.version = version

    def holds(self, trainer: SteppingEngine) -> bool:
        return self.got.keys() == dict(trainer.tensors).keys() and all(
            torch.equal(self.got[n], t.view(torch.int16)) for n, t in trainer.tensors)


def in_process(trainer, rollout, verify: bool = True):
    from dataclasses import replace

    from siirl_dag.runtime.backends import LocalBackend
    from siirl_dag.runtime.worker import RankWorker
    from siirl_dag.weight_sync.in_process import InProcess

    t, r = RankWorker("train", 0, 1), RankWorker("gen", 0, 1)
    t.engines["t"], r.engines["r"] = trainer, rollout
    path = InProcess(replace(placed(LocalBackend(None), t, r, verify=verify), delta=True))
    return path, r.pipes[path.name]


def test_after_a_full_first_sync_the_in_process_path_sends_deltas_and_the_engine_gets_the_same_bits():
    trainer, engine = SteppingEngine(), KeepingEngine()
    path, receiver = in_process(trainer, engine)
    first = path.sync(1)
    assert first["sync/delta_buckets"] == 0 and first["sync/sent_bytes"] == first["sync/bytes"]
    assert engine.holds(trainer) and receiver.version == 1
    for version in (2, 3, 4):
        trainer.step()
        stats = path.sync(version)
        assert stats["sync/delta_buckets"] == stats["sync/buckets"] > 1 and stats["sync/delta_fallback"] == 0
        assert stats["sync/sent_bytes"] < stats["sync/bytes"]
        assert stats["sync/encode_s"] > 0 and stats["sync/decode_s"] > 0
        assert engine.holds(trainer) and engine.version == version == receiver.version


@pytest.fixture
def dropping_a_bucket_once(monkeypatch):
    """The in-process pipe loses the first bucket of the next sync in transit, once."""
    from siirl_dag.weight_sync.in_process import LocalPipe

    read, dropped = LocalPipe.read, []

    def dropping(self):
        payload = read(self)
        if not dropped and isinstance(payload, (list, delta.Delta)):
            dropped.append(payload)
            return read(self)
        return payload

    return lambda: monkeypatch.setattr(LocalPipe, "read", dropping)


@pytest.mark.parametrize("verify", [True, False])
def test_a_delta_lost_in_transit_is_detected_and_healed_by_a_full_sync(dropping_a_bucket_once, verify):
    trainer, engine = SteppingEngine(), KeepingEngine()
    path, _ = in_process(trainer, engine, verify)
    path.sync(1)
    trainer.step()
    dropping_a_bucket_once()
    stats = path.sync(2)
    assert stats["sync/delta_fallback"] == 1 and stats["sync/delta_buckets"] == 0, "sent again in full"
    assert engine.holds(trainer) and engine.version == 2
    trainer.step()
    assert path.sync(3)["sync/delta_buckets"] > 0 and engine.holds(trainer), "deltas again after the full sync"


def test_a_missed_version_is_detected_before_the_engine_is_touched_and_healed_by_a_full_sync(monkeypatch, caplog):
    trainer, engine = SteppingEngine(), KeepingEngine()
    path, receiver = in_process(trainer, engine)
    path.sync(1)
    trainer.step()
    path.sync(2)
    receiver.version = 1  # as if the delta to version 2 never reached this rank
    loads, load = [], KeepingEngine.load_weights
    monkeypatch.setattr(KeepingEngine, "load_weights", lambda self, named, version: (loads.append(version),
                                                                                     load(self, named, version)))
    trainer.step()
    stats = path.sync(3)
    assert "bucket 0 came as a delta from version 2, but this rank holds version 1 of bucket 0" in caplog.text
    assert loads == [3], "the refused delta never reached the engine; the full sync did"
    assert stats["sync/delta_fallback"] == 1 and engine.holds(trainer) and receiver.version == 3


# --- the mode at the door and in the route table --------------------------------------------------------

def test_the_mode_is_chosen_per_route_and_shown_and_a_bad_one_is_refused_at_its_line(tmp_path, capsys):
    import json

    from siirl_dag.config import load_pipeline
    from siirl_dag.weight_sync.routes import routes_json
    from test_config import BASE, problems, write
    from test_door import cli

    colocated = BASE.replace("  - {id: reward,", "  - {id: colo_rollout, kind: rollout, mesh: colo, model: policy, "
                             "weights_from: actor_update}\n  - {id: reward,").replace(
        "  train: megatron:d2\n", "  train: megatron:d2\n  colo: {alloc: vllm:d2, colocate_with: train}\n")
    text = colocated + "runtime: {backend: ray}\nweight_sync: {mode: delta}\n"
    by_rollout = {r["rollout"]: r for r in routes_json(load_pipeline(write(tmp_path, text)))}
    assert (by_rollout["rollout"]["path"], by_rollout["rollout"]["mode"]) == ("shared_memory", "delta")
    assert by_rollout["colo_rollout"]["mode"] == "full" and "in process" in by_rollout["colo_rollout"]["mode_reason"]
    assert {r["mode"] for r in routes_json(load_pipeline(write(tmp_path, colocated)))} == {"full"}  # the default

    code, out, _ = cli(capsys, "validate", str(write(tmp_path, text)), "--json")
    shown = {r["rollout"]: r["mode"] for r in json.loads(out)["pipeline"]["weight_sync"]}
    assert code == 0 and shown == {"rollout": "delta", "colo_rollout": "full"}

    bad = BASE + "weight_sync:\n  mode: fast\n"
    (p,) = problems(tmp_path, bad)
    assert p.path == ("weight_sync", "mode") and p.line == len(bad.splitlines())
    code, _, err = cli(capsys, "validate", str(write(tmp_path, bad)))
    assert code == 2 and f"p.yaml:{p.line}:" in err and "weight_sync.mode: " in err


# --- through the real stack -------------------------------------------------------------------------------

PIPELINE = """\
name: delta
cluster: {{nodes: 1, devices_per_node: 2, device: cpu}}
models: {{policy: {{path: {model}, dtype: float32{lora}}}}}
data: {{train_files: unused.parquet, train_batch_size: 4, max_prompt_length: 16, max_response_length: 8}}
meshes: {{train: "megatron:d1", gen: "vllm:d1"}}
nodes:
  - {{id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: actor_update,
     options: {{n: 2, temperature: 1.0, dtype: float32, kv_cache_gb: 0.05, max_model_len: 32, enforce_eager: true}}}}
  - {{id: reward, kind: reward, deps: [rollout]}}
  - {{id: advantage, kind: advantage, deps: [reward]}}
  - {{id: old_logprob, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {{output: old_logprobs}}}}
  - {{id: actor_update, kind: actor_update, deps: [advantage, old_logprob], mesh: train, model: policy,
     options: {{lr: {lr}, micro_batch_size: 2}}, params: {{mini_batch_size: 4, entropy_coeff: 0.5}}}}
runtime: {{backend: ray, cpus_per_rank: 0.5, weight_sync_bucket_mb: 0.05, weight_sync_path: {path},
           verify_probe_every: 1}}
weight_sync: {{mode: delta}}
"""
LORA = ", lora: {rank: 8, alpha: 16, target_modules: [all-linear]}"


def _held(worker, pipe: str) -> tuple:
    """A delta pipe's version and a digest of the bytes it holds (what the engine was last given)."""
    import hashlib

    end = worker.pipes[pipe]
    return end.version, hashlib.sha256(b"".join(b.tobytes() for b in end.bases)).hexdigest()


def _miss_a_version(worker, pipe: str) -> None:
    """Planted on the rollout rank: its bytes count as a version older than they are (a delta it never got)."""
    worker.pipes[pipe].version -= 1


@pytest.mark.engines
@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("path, lora", [("shared_memory", ""), ("process_group", LORA)],
                         ids=["shared_memory", "process_group-lora"])
def test_deltas_through_the_real_stack_give_the_engine_the_trainers_bytes_and_a_missed_version_heals(
        tmp_path, tiny_model_dir, path, lora):
    from siirl_dag.config import load_pipeline
    from siirl_dag.runtime import Runtime

    f = tmp_path / "p.yaml"
    f.write_text(PIPELINE.format(model=tiny_model_dir, lora=lora, lr="1.0e-1" if lora else "1.0e-2", path=path))
    with Runtime(load_pipeline(f, []), progress=lambda *_: None) as rt:
        route = rt.routes["rollout"]
        assert (route.path, route.mode, route.payload) == (path, "delta", "adapters" if lora else "model")
        name = rt.weight_syncs.paths["rollout"].name  # made by the start-up sync, in full
        ends = [w for w, _ in rt.roles["actor_update"][:1] + rt.roles["rollout"]]

        def held() -> list:
            return rt.backend.get([w.__ray_call__.remote(_held, name) for w in ends])

        rt.run_step(prompts(0), step=1, nodes=TRAIN_STEP)
        stats = rt.sync_weights(1)
        assert stats["sync/delta_buckets"] == stats["sync/buckets"] > 1 and stats["sync/delta_fallback"] == 0
        assert stats["sync/sent_bytes"] < stats["sync/bytes"] and stats["sync/probe_diff"] < 1e-4
        trainer, rollout = held()
        assert trainer == rollout and trainer[0] == 1, "the engine was given the trainer's bytes, bit for bit"
        assert_same_logprobs(sampled_logprobs(rt, "rollout", "old_logprob", 4))

        rt.backend.get([w.__ray_call__.remote(_miss_a_version, name) for w, _ in rt.roles["rollout"]])
        rt.run_step(prompts(8), step=2, nodes=TRAIN_STEP)
        healed = rt.sync_weights(2)
        assert healed["sync/delta_fallback"] == 1 and healed["sync/delta_buckets"] == 0, "sent again in full"
        trainer, rollout = held()
        assert trainer == rollout and trainer[0] == 2 and rt.versions.held["rollout"] == 2
        assert_same_logprobs(sampled_logprobs(rt, "rollout", "old_logprob", 12))
