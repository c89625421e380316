"""Verified sync (runtime.verify_sync, on by default): `SAMPLES` values of every tensor, sampled where
the trainer sends it and where the rollout's loader takes it (a gather, not a pass over its bytes). A
tensor missing, unexpected or changed fails the sync naming it; the rollout then refuses to generate
until a sync succeeds. What the engines then compute with is the probe's (`probe`)."""

from __future__ import annotations

import functools

import torch

SAMPLES = 16  # per tensor, spread evenly over its elements: a zeroed TP shard holds about SAMPLES / tp of them


class SyncMismatch(RuntimeError):
    """The rollout's engine was given other weights than the trainer sent."""


@functools.lru_cache(maxsize=4096)
def _positions(numel: int, device: torch.device) -> torch.Tensor:
    return torch.linspace(0, numel - 1, min(SAMPLES, numel), dtype=torch.float64).round().long().to(device)


def sample(t: torch.Tensor) -> torch.Tensor:
    """SAMPLES values of `t` at fixed positions of its flattened elements (on its device)."""
    if t.numel() == 0:
        return t.new_empty(0)
    flat = t.view(-1) if t.is_contiguous() else t.flatten()
    return flat[_positions(flat.numel(), flat.device)]


class Fingerprints:
    def __init__(self) -> None:
        self.samples: dict[str, torch.Tensor] = {}  # the samples of every tensor of one sync, by HF name

    def add(self, name: str, t: torch.Tensor) -> None:
        self.samples[name] = sample(t)

    def on_host(self) -> dict[str, torch.Tensor]:
        """The samples in host memory (to travel with the end of a stream)."""
        return {name: s.cpu() for name, s in self.samples.items()}

    def check(self, sent: dict[str, torch.Tensor]) -> None:
        """Raise SyncMismatch unless these are the samples the trainer `sent`."""
        missing, extra = sorted(sent.keys() - self.samples.keys()), sorted(self.samples.keys() - sent.keys())
        if missing or extra:
            what = (f"{len(missing)} tensor(s) the trainer sent never reached the engine, first {missing[0]!r}"
                    if missing else f"the engine was given {len(extra)} tensor(s) the trainer did not send, first {extra[0]!r}")
            raise SyncMismatch(what)
        for name, want in sent.items():
            got = self.samples[name].cpu()
            if got.dtype != want.dtype or not torch.equal(got, want):
                at = next((i for i, (a, b) in enumerate(zip(got.tolist(), want.tolist())) if a != b), 0)
                raise SyncMismatch(f"tensor {name!r} reached the engine with other values than the trainer sent "
                                   f"(sampled element {at} of {len(want)}: {got.tolist()[at] if len(got) > at else None} "
                                   f"received, {want.tolist()[at]} sent; dtype {got.dtype} / {want.dtype})")
