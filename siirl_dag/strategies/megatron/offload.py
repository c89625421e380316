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


class Offload:
    """One engine's training state in host memory between `to_host` and `restore`, as its options say.
    With the distributed optimizer, params and grads live in DDP buffers, which megatron parks itself;
    other params and the optimizer's tensors are parked here. The pinned host copies stay from one
    offload to the next (a colocated trainer offloads at every step), as megatron's buffers keep theirs."""

    def __init__(self, opts: dict) -> None:
        self.opts = opts
        self.active = False
        self._buffers: list = []
        self._host: dict[str, list[torch.Tensor]] = {"params": [], "optimizer": []}
        self._parked: dict[str, Parked] = {"params": [], "optimizer": []}

    def to_host(self, chunks: list[torch.nn.Module], state) -> None:
        o = self.opts
        self._buffers = [b for m in state.model for b in m.buffers + m.expert_parallel_buffers] if state else []
        params = [p for c in chunks for p in c.parameters()]
        if state and o["optimizer_offload"]:  # the model's own params are param_offload's to move
            self._park("optimizer", optimizer_tensors(state.optimizer), skip=_storage_addresses(params))
        for b in self._buffers:
            b.offload_to_cpu(move_params=o["param_offload"], move_grads=o["grad_offload"])
        if o["param_offload"] and not any(b.param_data is not None for b in self._buffers):
            self._park("params", params)
        torch.cuda.empty_cache()
        self.active = True

    def restore(self) -> None:
        _unpark(self._parked["params"])
        for b in self._buffers:
            b.reload_from_cpu(move_params=self.opts["param_offload"], move_grads=self.opts["grad_offload"])
        _unpark(self._parked["optimizer"])
        self._parked = {"params": [], "optimizer": []}
        self.active = False

    def _park(self, kind: str, tensors: Iterable[torch.Tensor], skip: frozenset[int] = frozenset()) -> None:
        """Each CUDA tensor's storage (once per storage, none at an address in `skip`) copied to pinned
        host memory, then resized to nothing."""
        parked, seen, host = [], set(skip), self._host[kind]
        for t in tensors:
            storage = t.untyped_storage()
            if not t.is_cuda or storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            i = len(parked)
            if i == len(host) or host[i].numel() != storage.nbytes():
                host[i:i + 1] = [torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=True)]
            host[i].copy_(_as_bytes(storage), non_blocking=True)
            parked.append((storage, host[i]))
        torch.cuda.synchronize()  # the host copies are whole before the device memory goes
        for storage, _ in parked:
            storage.resize_(0)
        self._parked[kind] = parked


Parked = list[tuple[torch.UntypedStorage, torch.Tensor]]  # a storage and its pinned host copy


def _unpark(parked: Parked) -> None:
    for storage, host in parked:
        storage.resize_(host.numel())
        _as_bytes(storage).copy_(host, non_blocking=True)


def _storage_addresses(tensors: Iterable[torch.Tensor]) -> frozenset[int]:
    return frozenset(t.untyped_storage().data_ptr() for t in tensors)


def optimizer_tensors(optimizer) -> list[torch.Tensor]:
    """The tensors a megatron optimizer (chained or not) keeps: its torch optimizers' parameters
    (fp32 master copies, or the model's own parameters) and their state (Adam's moments)."""
    inner = [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])
             if getattr(o, "optimizer", None) is not None and not getattr(o, "is_stub_optimizer", False)]
    params = [p for o in inner for g in o.param_groups for p in g["params"]]
    state = [v for o in inner for s in o.state.values() for v in s.values() if torch.is_tensor(v)]
    return params + state
