"""Give a GPU's memory back while a colocated role uses it, keeping every tensor object in place.

Moving a parameter with `p.data = p.data.cpu()` changes its device, and autograd then drops the
parameter's gradient accumulator, and with it the hook megatron's DDP put there to sum gradients into
its buffer: after an onload, steps trained on gradients that went nowhere (grad norm 0; seen on an H100
with megatron's own optimizer offload, which moves an fp32 optimizer's parameters, the model's, that way).
Here each storage is copied to pinned host memory and resized to nothing, then resized and copied back,
as megatron's DDP buffers do for themselves (`offload_to_cpu`).
"""

from __future__ import annotations

from typing import Iterable

import torch


def _as_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage, 0, (storage.nbytes(),))


class HostCopies:
    """The storages of some GPU tensors, parked in host memory between `offload` and `onload`."""

    def __init__(self) -> None:
        self._parked: list[tuple[torch.UntypedStorage, torch.Tensor]] = []
        self._host: list[torch.Tensor] = []  # pinned buffers, reused from one offload to the next

    def offload(self, tensors: Iterable[torch.Tensor], skip: frozenset[int] = frozenset()) -> None:
        """Park the storage of each CUDA tensor, once per storage, except those at the addresses in `skip`."""
        seen = set(skip)
        for t in tensors:
            storage = t.untyped_storage()
            if not t.is_cuda or storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            i = len(self._parked)
            if i == len(self._host) or self._host[i].numel() != storage.nbytes():
                self._host[i:i + 1] = [torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)]
            self._host[i].copy_(_as_bytes(storage), non_blocking=True)
            self._parked.append((storage, self._host[i]))
        torch.cuda.synchronize()  # the host copies are whole before the device memory goes
        for storage, _ in self._parked:
            storage.resize_(0)

    def onload(self) -> None:
        for storage, host in self._parked:
            storage.resize_(host.numel())
            _as_bytes(storage).copy_(host, non_blocking=True)
        self._parked = []


def storage_addresses(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors a megatron optimizer (chained or not) keeps: its torch optimizers' parameters
    (fp32 master copies, or the model's own parameters) and their state (Adam's moments)."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])
             if getattr(o, "optimizer", None) is not None and not getattr(o, "is_stub_optimizer", False)]
    params = [p for o in inner for g in o.param_groups for p in g["params"]]
    state = [v for o in inner for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
    return params + state
