"""The only place where megatron-core 0.16.1 is bent to run without CUDA or Transformer Engine.

megatron-core assumes a GPU in a handful of places (listed below, each where it is shimmed). Every shim
here is *narrow*: megatron modules get their own `torch` name (a proxy whose `torch.cuda` answers for
the CPU and whose tensor factories map device "cuda" to "cpu"), a few megatron functions are
replaced or wrapped, and nothing in torch itself is changed, so HF transformers, vLLM and our own
code in the same process see the real torch. Two entry points, both idempotent:

- `apply()`: the CPU shims; a no-op when CUDA is available.
- `apply_without_te()`: fixes for a missing Transformer Engine (the local layer spec), which
  also matter on a GPU without TE; a no-op when TE is installed.

Importing this module (without CUDA) also hides megatron's warnings about the missing CUDA-only
libraries: they are raised by megatron's own first import, which comes before `apply()`.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import sys
import threading
import types
import warnings
from typing import Any

import torch

_ORIG_TORCH = torch
_CUDA_TYPE_NAMES = {
    torch.float32: "torch.cuda.FloatTensor",
    torch.float16: "torch.cuda.HalfTensor",
    torch.bfloat16: "torch.cuda.BFloat16Tensor",
}
# Megatron modules whose CUDA call sites we reach; imported before patching so they get the proxy.
_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.experts",
    "megatron.core.optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.pipeline_parallel.p2p_communication",
    "megatron.core.dist_checkpointing",
    "megatron.core.dist_checkpointing.serialization",
    "megatron.core.dist_checkpointing.exchange_utils",
    "megatron.core.dist_checkpointing.strategies.torch",
    "megatron.core.dist_checkpointing.strategies.filesystem_async",
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",
    "megatron.core.dist_checkpointing.strategies.fully_parallel",
    "megatron.core.dist_checkpointing.strategies.async_utils",
    "megatron.core.optimizer_param_scheduler",
)
_state = {"cpu": False, "no_te": False}
if not torch.cuda.is_available():
    # Set on import (the strategy's modules import this one first): megatron warns at its own first
    # import that it falls back without Transformer Engine and Apex, both CUDA-only, so nothing to say here.
    warnings.filterwarnings("ignore", r"(Transformer Engine and Apex are|Apex is) not installed", UserWarning, "megatron")
_lock = threading.RLock()


def _cpu_device(device: Any) -> Any:
    """'cuda', 'cuda:0', torch.device('cuda') and bare indices -> 'cpu'; anything else unchanged."""
    if isinstance(device, torch.device):
        return torch.device("cpu") if device.type == "cuda" else device
    if isinstance(device, str) and device.startswith("cuda"):
        return "cpu"
    if isinstance(device, int) and not isinstance(device, bool):
        return "cpu"
    return device


def _on_cpu(factory):
    @functools.wraps(factory)
    def wrapper(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu_device(kwargs["device"])
        return factory(*args, **kwargs)

    return wrapper


class _NoStream:
    """Stands in for torch.cuda.Stream / Event: on CPU all work is already ordered."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args):
        pass

    def wait_event(self, *args):
        pass

    def record_event(self, *args):
        return _NoStream()

    def record(self, *args):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    __hash__ = object.__hash__


class _Proxy(types.ModuleType):
    """A module look-alike: its own overrides first, then the wrapped module's attributes."""

    def __init__(self, name: str, target: types.ModuleType, overrides: dict[str, Any]):
        super().__init__(name)
        self.__dict__.update(overrides)
        self.__dict__["_target"] = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_target"], name)


_CUDA = _Proxy(
    "torch.cuda",
    torch.cuda,
    {
        "current_device": lambda: "cpu",
        "synchronize": lambda *a, **k: None,
        "empty_cache": lambda: None,
        "Stream": _NoStream,
        "Event": _NoStream,
        "stream": lambda *a, **k: contextlib.nullcontext(),
        "current_stream": lambda *a, **k: _NoStream(),
        "default_stream": lambda *a, **k: _NoStream(),
        "get_rng_state": lambda *a, **k: torch.get_rng_state(),
        "set_rng_state": lambda state, *a, **k: torch.set_rng_state(state),
        "manual_seed": lambda seed: torch.manual_seed(seed),
        "manual_seed_all": lambda seed: torch.manual_seed(seed),
    },
)
_FACTORIES = ("tensor", "zeros", "ones", "empty", "full", "arange", "rand", "randn", "randint",
              "zeros_like", "ones_like", "empty_like", "full_like", "as_tensor")
_TORCH = _Proxy("torch", torch, {"cuda": _CUDA, **{f: _on_cpu(getattr(torch, f)) for f in _FACTORIES}})


@contextlib.contextmanager
def _tensors_answer_as_cuda():
    """While a wrapped megatron function runs: `t.cuda()` is `t`, `t.type()` names the CUDA type.

    These are Tensor methods, so no module proxy reaches them; the swap is scoped to the call.
    """
    with _lock:
        orig_type, orig_cuda = torch.Tensor.type, torch.Tensor.cuda

        def type_(self, *args, **kwargs):
            if args or kwargs or self.is_cuda:
                return orig_type(self, *args, **kwargs)
            return _CUDA_TYPE_NAMES.get(self.dtype) or orig_type(self)

        torch.Tensor.type, torch.Tensor.cuda = type_, lambda self, *a, **k: self
        try:
            yield
        finally:
            torch.Tensor.type, torch.Tensor.cuda = orig_type, orig_cuda


def _scoped(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _tensors_answer_as_cuda():
            return fn(*args, **kwargs)

    wrapper._siirl_cpu = True
    return wrapper


def _replace_everywhere(orig: Any, new: Any) -> None:
    """Rebind a function in its module and in every megatron module that imported it by name."""
    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("megatron.core"):
            for key, value in list(vars(mod).items()):
                if value is orig:
                    setattr(mod, key, new)


def _move_splits_to_numpy(tensor, as_numpy: bool = False, record_stream: bool = False):
    """maybe_move_tensor_to_cpu for CPU tensors: split sizes must still become numpy (not tensors)."""
    if as_numpy and torch.is_tensor(tensor):
        return tensor.numpy()
    return tensor


def _patch_proxies() -> None:
    for name, mod in list(sys.modules.items()):
        if name.startswith("megatron.core") and getattr(mod, "torch", None) is _ORIG_TORCH:
            mod.torch = _TORCH


def apply() -> None:
    """Make megatron-core run on CPU. No-op with CUDA; safe to call again (patches new modules)."""
    if torch.cuda.is_available():
        return
    with _lock:
        for name in _MODULES:
            importlib.import_module(name)
        _patch_proxies()  # cheap; also covers megatron modules imported since the last call
        if _state["cpu"]:
            return
        from megatron.core.models.common.language_module.language_module import LanguageModule
        from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer
        from megatron.core.tensor_parallel import random as tp_random
        from megatron.core.transformer.moe import token_dispatcher

        # RNG tracker: the "CUDA" RNG state is the CPU generator's state. Its fork() then warns
        # that the CPU state changed inside the (same) GPU state; that warning means nothing here.
        tp_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
        tp_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
        logging.getLogger(tp_random.__name__).addFilter(
            lambda record: "CPU RNG state changed" not in record.getMessage())
        # Tensor.cuda() / Tensor.type() checks, scoped to the functions that make them.
        for owner, attr in (
            (LanguageModule, "setup_embeddings_and_output_layer"),
            (distrib_optimizer.DistributedOptimizer, "__init__"),
            (optimizer.Float16OptimizerWithFloat16Params, "__init__"),
        ):
            setattr(owner, attr, _scoped(getattr(owner, attr)))
        orig_clip = clip_grads.clip_grad_by_total_norm_fp32
        _replace_everywhere(orig_clip, _scoped(orig_clip))
        # alltoall dispatcher: split sizes stay tensors on CPU unless converted here.
        token_dispatcher.maybe_move_tensor_to_cpu = _move_splits_to_numpy
        _state["cpu"] = True


def te_installed() -> bool:
    """Whether Transformer Engine imports (megatron-core's fused layers; `model.use_transformer_engine`)."""
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def apply_without_te() -> None:
    """Fixes for the local (non-TE) layer spec; no-op when Transformer Engine is installed."""
    if _state["no_te"] or te_installed():
        return
    with _lock:
        from megatron.core.transformer import torch_norm
        from megatron.core.transformer.moe import moe_utils

        # 0.16.1 bug: moe_utils only defines te_general_gemm when TE imports.
        if not hasattr(moe_utils, "te_general_gemm"):
            moe_utils.te_general_gemm = None
        # WrappedTorchNorm refuses sequence parallel. The norm itself is sequence-agnostic; what SP
        # needs is its grads summed over TP, which megatron does for params tagged like apex does.
        orig_new = torch_norm.WrappedTorchNorm.__new__

        def new(cls, config, hidden_size, eps=1e-5, *args, **kwargs):
            if not config.sequence_parallel:
                return orig_new(cls, config, hidden_size, eps, *args, **kwargs)
            config.sequence_parallel = False  # a copy would re-run (and fail) config validation
            try:
                norm = orig_new(cls, config, hidden_size, eps, *args, **kwargs)
            finally:
                config.sequence_parallel = True
            for p in norm.parameters():
                p.sequence_parallel = True
            return norm

        torch_norm.WrappedTorchNorm.__new__ = new
        _state["no_te"] = True
