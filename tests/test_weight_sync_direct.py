"""Direct writes between separate meshes on one CPU machine: the rollout's first load recorded as a
plan of slice copies, replayed by the trainer's rank 0 into the rollout's shared parameters. The
pieces alone (a vLLM-like fusing loader), then the driver's protocol between Ray actors. The real
stack (Megatron trainers, vLLM) is in test_weight_sync."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

from siirl_dag.weight_sync.direct import Recorder, Segment, Targets
from test_row_blocks import blocked


class FusingModel(torch.nn.Module):
    """Loads like vLLM: q and k into one fused weight (rows), this rank's half of each (TP 2, rank 1
    unless told) by narrowing the incoming tensor, a bias whole, and a name it does not use."""

    def __init__(self, tp_rank: int = 1):
        super().__init__()
        self.tp_rank = tp_rank
        self.qk = torch.nn.Parameter(torch.zeros(4, 3))
        self.bias = torch.nn.Parameter(torch.zeros(4))

    def load(self, named, transform=lambda t: t):
        with torch.no_grad():
            for name, t in named:
                if name in ("q", "k"):
                    shard = t.narrow(0, 2 * self.tp_rank, 2)
                    self.qk.data.narrow(0, 0 if name == "q" else 2, 2).copy_(transform(shard))
                elif name == "bias":
                    self.bias.data.copy_(transform(t))


def export(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"q": torch.randn(4, 3, generator=g), "k": torch.randn(4, 3, generator=g),
            "bias": torch.randn(4, generator=g), "unused": torch.randn(2, generator=g)}


def recorded(model: FusingModel, transform=lambda t: t) -> Recorder:
    recorder = Recorder(Segment(model.parameters()))
    with recorder:
        model.load(recorder.track(export(0).items()), transform)
    return recorder


def test_a_recorded_load_replays_into_the_shared_parameters_and_its_file_is_gone_once_mapped():
    model = FusingModel()
    recorder = recorded(model)
    plan = recorder.plan()
    assert recorder.problem is None and set(plan.shapes) == {"q", "k", "bias", "unused"}
    assert {name: len(c) for name, c in plan.copies.items()} == {"q": 1, "k": 1, "bias": 1}
    assert os.path.exists(plan.path)
    targets = Targets([plan])
    assert not os.path.exists(plan.path), "unlinked once mapped: the memory goes with the processes"

    new = export(1)
    new["k"] = new["k"].t().contiguous().t()  # a trainer's strided view (a split of a fused tensor)
    assert not new["k"].is_contiguous()
    assert targets.write(new.items()) == sum(t.numel() * 4 for t in new.values())
    torch.testing.assert_close(model.qk.data, torch.cat([new["q"][2:], new["k"][2:]]), rtol=0, atol=0)
    torch.testing.assert_close(model.bias.data, new["bias"], rtol=0, atol=0)


def test_tensors_given_as_views_of_one_fused_weight_are_told_apart():
    """In process (colocated meshes) the export is views of the trainer's own fused weights."""
    model = FusingModel()

    def views(fused, bias):
        return [("q", fused[:4]), ("k", fused[4:]), ("bias", bias), ("unused", bias[:2])]

    recorder = Recorder(Segment(model.parameters()))
    with recorder:
        model.load(recorder.track(views(torch.randn(8, 3), torch.randn(4))))
    targets = Targets([recorder.plan()])
    fused, bias = torch.randn(8, 3), torch.randn(4)
    targets.write(views(fused, bias))
    torch.testing.assert_close(model.qk.data, torch.cat([fused[2:4], fused[6:]]), rtol=0, atol=0)
    torch.testing.assert_close(model.bias.data, bias, rtol=0, atol=0)


class RowBlockedModel(torch.nn.Module):
    """A fused weight of 12 rows that computes from row blocks of 4 (like vLLM's CPU linear layers):
    q (rows 0-5) and k (6-11) cut row blocks in the middle, so their copies do too."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(12, 3))
        self.blocks = torch.nn.Parameter(torch.zeros(3, 3, 4))

    def load(self, named):
        with torch.no_grad():
            for name, t in named:
                self.weight.data.narrow(0, 0 if name == "q" else 6, 6).copy_(t)


@pytest.mark.parametrize("read", [False, True], ids=["linear", "embedding"])
def test_copies_into_a_packed_weight_are_replayed_into_its_row_blocks_whatever_rows_they_cover(read):
    """`read`: the plain weight is read too (an embedding's lookup), so it is written as well."""
    model = RowBlockedModel()
    recorder = Recorder(Segment(model.parameters(), [(model.weight, model.blocks, 4, read)]))
    first = {"q": torch.randn(6, 3), "k": torch.randn(6, 3)}
    with recorder:
        model.load(recorder.track(first.items()))
    plan = recorder.plan()
    pieces = 2 + read  # a whole block and part of one, each (and the plain copy)
    assert [len(plan.copies[n]) for n in ("q", "k")] == [pieces, pieces]
    targets = Targets([plan])
    new = {"q": torch.randn(6, 3), "k": torch.randn(3, 6).t()}  # any strides
    targets.write(new.items())
    torch.testing.assert_close(model.blocks.data, blocked(torch.cat([new["q"], new["k"]]), 4), rtol=0, atol=0)
    plain = new if read else first  # a linear layer's plain weight is no longer written: nothing reads it
    torch.testing.assert_close(model.weight.data, torch.cat([plain["q"], plain["k"]]), rtol=0, atol=0)


class ExpertsModel(torch.nn.Module):
    """Two experts of 8 rows in one parameter that holds its own row blocks of 4 rows (vLLM's CPU MoE
    kernel's layout, which it packs in place after a load of plain experts)."""

    def __init__(self):
        super().__init__()
        self.experts = torch.nn.Parameter(torch.zeros(2, 8, 3), requires_grad=False)

    def load(self, named):
        with torch.no_grad():
            for name, t in named:
                self.experts.data[int(name)].copy_(t)


def test_a_weight_that_holds_its_own_row_blocks_gets_them_written_directly():
    model = ExpertsModel()
    recorder = Recorder(Segment(model.parameters(), [(model.experts, model.experts, 4, False)]))
    with recorder:
        model.load(recorder.track({"0": torch.randn(8, 3), "1": torch.randn(8, 3)}.items()))
    targets = Targets([recorder.plan()])
    new = {"0": torch.randn(8, 3), "1": torch.randn(3, 8).t()}
    targets.write(new.items())
    torch.testing.assert_close(model.experts.data.view(4, 3, 4), blocked(torch.cat([new["0"], new["1"]]), 4), rtol=0, atol=0)


def test_a_loader_that_computes_makes_no_plan():
    recorder = recorded(FusingModel(), transform=lambda t: t * 2)
    assert recorder.plan() is None and "something other than a slice" in recorder.problem
    os.unlink(recorder.segment.path)


def test_an_export_that_differs_from_the_recorded_one_is_refused():
    targets = Targets([recorded(FusingModel()).plan()])
    with pytest.raises(RuntimeError, match="'q' \\(5, 3\\)"):
        targets.write({**export(1), "q": torch.randn(5, 3)}.items())
    short = export(1)
    del short["unused"]
    with pytest.raises(RuntimeError, match="ended without \\['unused'\\]"):
        targets.write(short.items())


def test_a_small_dev_shm_is_refused_before_anything_moves(monkeypatch):
    from types import SimpleNamespace

    model = FusingModel()
    before = model.qk.data_ptr()
    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=0, f_frsize=4096))
    with pytest.raises(ValueError, match="has 0 MiB free, too little"):
        Segment(model.parameters())
    assert model.qk.data_ptr() == before, "the parameters stay where they were"


def test_files_of_dead_processes_are_swept_and_live_ones_kept():
    from test_leftovers import planted

    with planted("siirl-weights-{pid}-0") as (stale, live):
        Segment(FusingModel().parameters()).unlink()
        assert not any(map(os.path.exists, stale)) and all(map(os.path.exists, live))


# --- the driver's protocol between Ray actors -----------------------------------------------------

class Trainer:
    """A trainer engine whose export changes at every sync (and may fail half-way once)."""

    def __init__(self, fail_at_sync: int | None = None):
        self.syncs, self.fail_at_sync = 0, fail_at_sync

    def export_hf_weights(self, copy: bool = True, first_rank_only: bool = False, timings=None):
        self.syncs += 1
        for i, (name, t) in enumerate(export(self.syncs).items()):
            if self.syncs == self.fail_at_sync and i == 2:
                raise RuntimeError("gather failed")
            yield name, t


class Rollout:
    """A rollout engine with the direct-write methods of VllmRollout around a FusingModel."""

    def __init__(self, tp_rank: int = 1):
        self.model, self.version, self.ready = FusingModel(tp_rank), 0, True

    def load_weights(self, named, version, watch=None, cores=None):
        with watch or contextlib.nullcontext():
            self.model.load(named)
        self.version, self.ready, self.cores = version, True, cores

    def weight_parameters(self):
        return list(self.model.parameters())

    def expect_weights(self):
        self.ready = False

    def weights_written(self, version, cores=None):
        self.version, self.ready, self.cores = version, True, cores


@pytest.fixture(scope="module")
def ray_session():
    from siirl_dag.runtime.backends import init_ray, stop_ray

    init_ray(num_cpus=2)
    yield
    stop_ray()


def _install(worker, key, engine):
    worker.engines[key] = engine


def _state(worker):
    engine = worker.engines["r"]
    return engine.version, engine.ready, engine.model.qk.data.clone(), engine.cores


def test_later_syncs_write_straight_into_the_rollout_and_fall_back_to_recording_when_needed(ray_session):
    import ray

    from siirl_dag.runtime.backends import RayBackend
    from siirl_dag.runtime.worker import RankWorker
    from siirl_dag.weight_sync import WeightSync
    from test_weight_sync import sync_runtime

    trainer, rollout = (ray.remote(RankWorker).options(num_cpus=0).remote(group, 0, 1) for group in ("train", "gen"))
    ray.get([trainer.__ray_call__.remote(_install, "t", Trainer(fail_at_sync=6)),
             rollout.__ray_call__.remote(_install, "r", Rollout())])
    rt = sync_runtime(None, trainer, rollout)
    rt.backend = RayBackend(rt.pipe)

    def expected(sync: int) -> torch.Tensor:
        weights = export(sync)
        return torch.cat([weights["q"][2:], weights["k"][2:]])

    sync = WeightSync(rt)
    first = sync("update", "rollout", 1)  # through the channel, recorded
    assert first["sync/buckets"] >= 1 and "sync/write_s" not in first
    second = sync("update", "rollout", 2)  # the trainer writes into the rollout's parameters
    assert second["sync/write_s"] > 0 and "sync/buckets" not in second and second["sync/bytes"] == first["sync/bytes"]
    version, ready, qk, cores = ray.get(rollout.__ray_call__.remote(_state))
    assert (version, ready, cores) == (2, True, 2)  # it finished with the waiting trainer's core too
    torch.testing.assert_close(qk, expected(2), rtol=0, atol=0)

    # another pipe to the same rollout moves its parameters to a new file: the first pipe's next
    # sync writes where nobody reads (the trainer's 4th export), the rollout says it moved, and
    # the sync records again (the 5th)
    assert "sync/buckets" in WeightSync(rt)("update", "rollout", 3)
    again = sync("update", "rollout", 4)
    assert "sync/buckets" in again
    version, ready, qk, _ = ray.get(rollout.__ray_call__.remote(_state))
    assert (version, ready) == (4, True)
    torch.testing.assert_close(qk, expected(5), rtol=0, atol=0)

    # an export that fails half-way through a direct write (the 6th): the rollout refuses to generate
    with pytest.raises(RuntimeError, match="gather failed"):
        sync("update", "rollout", 5)
    version, ready, _, _ = ray.get(rollout.__ray_call__.remote(_state))
    assert (version, ready) == (4, False)
    assert "sync/buckets" in sync("update", "rollout", 6), "a failed pipe is retired: the next one records"
    version, ready, qk, _ = ray.get(rollout.__ray_call__.remote(_state))
    assert (version, ready) == (6, True)
    torch.testing.assert_close(qk, expected(7), rtol=0, atol=0)
    assert sync("update", "rollout", 7)["sync/write_s"] > 0
    torch.testing.assert_close(ray.get(rollout.__ray_call__.remote(_state))[2], expected(8), rtol=0, atol=0)


def test_each_rollout_rank_gets_its_own_shard_written_and_a_share_of_the_cores(ray_session):
    """A t2 rollout: two plans (each rank's half of q and k), written by one keeper, each rank
    finishing with one of the machine's two cores."""
    import ray

    from siirl_dag.runtime.backends import RayBackend
    from siirl_dag.runtime.worker import RankWorker
    from siirl_dag.weight_sync import WeightSync
    from test_weight_sync import sync_runtime

    trainer, *rollouts = (ray.remote(RankWorker).options(num_cpus=0).remote(g, r, 1)
                          for g, r in (("train", 0), ("gen", 0), ("gen", 1)))
    ray.get([trainer.__ray_call__.remote(_install, "t", Trainer())] +
            [w.__ray_call__.remote(_install, "r", Rollout(tp_rank)) for tp_rank, w in enumerate(rollouts)])
    rt = sync_runtime(None, trainer, *rollouts)
    rt.backend = RayBackend(rt.pipe)
    sync = WeightSync(rt)
    assert "sync/buckets" in sync("update", "rollout", 1)
    assert sync("update", "rollout", 2)["sync/write_s"] > 0
    weights = export(2)
    for tp_rank, w in enumerate(rollouts):
        version, ready, qk, cores = ray.get(w.__ray_call__.remote(_state))
        assert (version, ready, cores) == (2, True, 1)
        half = slice(2 * tp_rank, 2 * tp_rank + 2)
        torch.testing.assert_close(qk, torch.cat([weights["q"][half], weights["k"][half]]), rtol=0, atol=0)


def test_colocated_syncs_replay_from_this_processs_memory_whatever_room_dev_shm_has(monkeypatch):
    """`RankSync.handoff`, both engines in one process: the first sync records the loader, later ones
    replay it. The parameters move into this process's memory, not /dev/shm, which is full here
    (a container's default is 64 MB)."""
    from types import SimpleNamespace

    from siirl_dag.weight_sync.rank import RankSync

    monkeypatch.setattr(os, "statvfs", lambda path: SimpleNamespace(f_bavail=0, f_frsize=4096))
    rank = RankSync({"t": Trainer(), "r": Rollout()})
    rollout = rank.engines["r"]
    first = rank.handoff("t", "r", 1)
    assert "sync/write_s" not in first and rollout.version == 1, "the first sync goes through the loader"
    later = rank.handoff("t", "r", 2)
    assert later["sync/write_s"] > 0 and rollout.version == 2 and rollout.ready, "a replay"
    new = export(2)
    torch.testing.assert_close(rollout.model.qk.data, torch.cat([new["q"][2:], new["k"][2:]]), rtol=0, atol=0)
    assert rank.segments["r"].path is None
