"""The `vllm` rollout strategy: one vLLM engine per data-parallel rank, tensor parallel inside it.

The engine always runs inside the rank's own process (no engine-core subprocess): it starts in
seconds, weight updates hand tensors over by reference, and a colocated trainer shares the process.
When the runtime has made a process group for the mesh, every rank joins vLLM's
`external_launcher` executor: vLLM reads the world as (external dp) x t with t fastest, the
megatron-style rank order of our meshes, so each group of t consecutive ranks is one engine that
shards the model t ways. Without a process group (a script, a test) the engine is a plain t=1 one.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import random
import tempfile
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from siirl_dag import leftovers
from siirl_dag.errors import ConfigError, Problem
from siirl_dag.strategies.base import RankContext, Strategy
from siirl_dag.strategies.vllm import cpu_compat
from siirl_dag.strategies.vllm.layout import Sample, pack_batch, prompt_token_ids
from siirl_dag.strategies.vllm.options import resolve_options, sampling_kwargs

log = logging.getLogger(__name__)
_RPC_FOLDER = "siirl-vllm-rpc-"  # + pid: see `_rpc_folder`
# vLLM says this at INFO whenever the prefix cache is reset, which a weight update does every step
logging.getLogger("vllm.v1.core.block_pool").addFilter(lambda r: r.getMessage() != "Successfully reset prefix cache")


def model_path(model: Any) -> str:
    """A model given as a path, or as a spec (dataclass or dict) with a `path`."""
    if isinstance(model, (str, os.PathLike)):
        return str(model)
    path = model.get("path") if isinstance(model, dict) else getattr(model, "path", None)
    if path is None:
        raise ConfigError([Problem(("model",), "no model path; expected a path or a model spec with `path`")])
    return str(path)


@functools.cache
def _rpc_base() -> str:
    return os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()


def _rpc_folder() -> str:
    """This process's folder for vLLM's sockets. A TP group's message queue binds two ZMQ sockets as
    files in VLLM_RPC_BASE_PATH (the temp folder), which nothing removes, not even a clean shutdown:
    every TP engine left two, a test run eight. An engine removes the files its start made, and
    the folder if no other engine of the process uses it (`close`); a killed process's folder goes
    at the next start of an engine on its machine."""
    leftovers.sweep_dead(rf"{_RPC_FOLDER}(\d+)", _rpc_base())
    path = os.path.join(_rpc_base(), f"{_RPC_FOLDER}{os.getpid()}")
    os.makedirs(path, mode=0o700, exist_ok=True)
    return path


@contextlib.contextmanager
def host_rng_kept() -> Iterator[None]:
    """vLLM seeds the global RNGs of the process it starts in; give the host its own state back."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    try:
        yield
    finally:
        torch.set_rng_state(states[0])
        random.setstate(states[1])
        np.random.set_state(states[2])


class VllmRollout(Strategy):
    """Generates responses in the batch layout and takes weight updates in place."""

    name = "vllm"

    def __init__(self, ctx: RankContext, model: Any, options: dict[str, Any]):
        super().__init__(ctx, model, resolve_options(options))
        self.tp = ctx.dims.tp
        self.weights_version = 0
        # True while the engine holds no real weights: load_format "dummy", or after a level-2 sleep
        self._needs_weights = self.options["load_format"] == "dummy"
        self._logged_offload_noop = False
        self._left: list[str] = []  # files of this engine vLLM leaves behind (sockets; TP shared memory on CPU)
        self._sockets = _rpc_folder()
        self.llm = self._start_engine(model_path(model))
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = self.llm.llm_engine.model_config.max_model_len
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = self.tokenizer.eos_token_id if pad is None else pad

    def _start_engine(self, path: str):
        # The in-process engine core (vLLM's external_launcher executor requires it too).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import LLM  # importing vLLM costs seconds: only ranks that roll out pay

        opts, shared_group = self.options, dist.is_available() and dist.is_initialized()
        kwargs: dict[str, Any] = dict(
            model=path, dtype=opts["dtype"], seed=opts["seed"] + self.ctx.rank // self.tp,
            gpu_memory_utilization=opts["gpu_memory_utilization"], max_num_seqs=opts["max_num_seqs"],
            max_model_len=opts["max_model_len"], enforce_eager=opts["enforce_eager"],
            enable_prefix_caching=opts["enable_prefix_caching"], logprobs_mode=opts["logprobs_mode"],
            load_format=opts["load_format"], tensor_parallel_size=self.tp, enable_sleep_mode=True,
        )
        if shared_group:
            if dist.get_world_size() != self.ctx.world_size:
                raise RuntimeError(f"the process group has {dist.get_world_size()} ranks but the rollout mesh has "
                                   f"{self.ctx.world_size}: the runtime must give each mesh its own group")
            kwargs["distributed_executor_backend"] = "external_launcher"
            # vLLM's GPU worker takes LOCAL_RANK as its device index among the visible ones
            local = self.ctx.local_device_index if cpu_compat.active() else self.ctx.cuda_index
            os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(local), WORLD_SIZE=str(dist.get_world_size()))
        elif self.tp > 1:
            raise RuntimeError(f"t={self.tp} needs the runtime's process group over the mesh "
                               "(torch.distributed is not initialized in this process)")
        first = self.ctx.rank // self.tp * self.tp
        on_cpu = cpu_compat.building(list(range(first, first + self.tp)), self._left) if cpu_compat.active() \
            else contextlib.nullcontext()
        if cpu_compat.active():
            kwargs.update(cpu_compat.engine_kwargs(opts))
        start = time.perf_counter()
        os.environ["VLLM_RPC_BASE_PATH"] = self._sockets  # the same for every engine of a process: vLLM caches it
        with host_rng_kept(), leftovers.created(self._sockets, self._left), on_cpu:
            llm = LLM(**kwargs)
        log.info("vLLM engine (t=%d, rank %d) started in %.1f s", self.tp, self.ctx.rank, time.perf_counter() - start)
        return llm

    def generate(self, prompts: Sequence[str | Sequence[int] | Sequence[dict]], sampling: dict[str, Any] | None,
                 max_prompt_length: int, max_response_length: int,
                 chat_template: bool | None = None) -> dict[str, Any]:
        """Sample responses; rows are prompt-major (the n samples of a prompt are adjacent).

        `sampling` overrides the options' n, temperature, top_p, top_k, max_tokens, stop and
        stop_token_ids for this call, and may add `seed` (reproducible samples), `greedy` or
        `validate` (see options.sampling_kwargs). Text prompts are tokenized raw or through the chat
        template (`chat_template`, default: the option); chat lists ({role, content} messages) always
        through it; token-id prompts are used as given.
        Returns the batch-layout tensors plus the lists `finish_reason` and `sample_index` (the
        prompt each row answers).
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self._needs_weights:
            raise RuntimeError("the engine holds no complete weights (load_format 'dummy', offload() with "
                               "sleep_level 2, or a weight load that failed part-way): call load_weights "
                               "before generate")
        kw = sampling_kwargs(self.options, sampling or {}, max_response_length)
        use_chat = self.options["chat_template"] if chat_template is None else chat_template
        prompt_ids = [prompt_token_ids(self.tokenizer, p, use_chat) for p in prompts]
        self._check_lengths(prompt_ids, max_prompt_length, max_response_length)
        seed, n = kw.pop("seed"), kw["n"]
        # Stop strings need detokenized text; without them decoding text is wasted work.
        base = dict(kw, logprobs=0, detokenize=bool(kw["stop"]))
        # Seeded: prompt i gets seed + i*n and vLLM gives its samples seed + i*n + j, all distinct.
        params = (SamplingParams(**base) if seed is None
                  else [SamplingParams(**base, seed=seed + i * n) for i in range(len(prompt_ids))])
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False)
        samples = [
            Sample(i, c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)], c.finish_reason)
            for i, out in enumerate(outputs)
            for c in sorted(out.outputs, key=lambda c: c.index)
        ]
        return pack_batch(prompt_ids, samples, max_prompt_length, max_response_length, self.pad_token_id)

    def _check_lengths(self, prompt_ids: list[list[int]], max_prompt_length: int, max_response_length: int) -> None:
        bad = [(i, len(p)) for i, p in enumerate(prompt_ids) if not 0 < len(p) <= max_prompt_length]
        if bad:
            shown = ", ".join(f"prompt {i} has {n} tokens" for i, n in bad[:5])
            raise ConfigError([Problem(("data", "max_prompt_length"),
                                       f"{len(bad)} prompt(s) empty or too long: {shown}, expected 1 to "
                                       f"max_prompt_length={max_prompt_length}; raise it or filter the data")])
        if max_prompt_length + max_response_length > self.max_model_len:
            raise ConfigError([Problem(("options", "max_model_len"),
                                       f"max_prompt_length + max_response_length = "
                                       f"{max_prompt_length + max_response_length} exceeds the engine's "
                                       f"max_model_len={self.max_model_len}; raise it or shorten the lengths")])

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the engine's weights in place with HF-named tensors and stamp `version`.

        `named_tensors` may be a generator (the weight sync's stream): it is consumed once, tensor by
        tensor, by vLLM's own loader (which fuses q/k/v and gate/up and cuts this rank's TP shard), so
        every tensor of a layer must come. If the load fails part-way the engine refuses to generate
        until a load succeeds. The prefix cache is reset: no KV state of the old weights survives.
        """
        self._check_version(version)
        tensors = iter(named_tensors)
        try:
            self.llm.collective_rpc(_load_weights, args=(tensors,))
            if next(tensors, None) is not None:
                raise RuntimeError("vLLM's weight loader returned before the last tensor")
        except BaseException:
            self._needs_weights = True  # some tensors may be new and the rest old: never generate from that
            raise
        self.llm.reset_prefix_cache()
        self.weights_version, self._needs_weights = version, False

    def _check_version(self, version: int) -> None:
        if version < self.weights_version:
            raise ValueError(f"weights version {version} is older than the engine's {self.weights_version}")

    def offload(self) -> None:
        """Free the device for a colocated trainer (vLLM sleep mode). A no-op on CPU."""
        if cpu_compat.active():
            if not self._logged_offload_noop:
                log.info("offload/onload do nothing on CPU (vLLM has no sleep mode there): "
                         "the engine keeps its weights and its kv_cache_gb of KV cache")
                self._logged_offload_noop = True
            return
        self.llm.sleep(level=self.options["sleep_level"])
        self._needs_weights = self.options["sleep_level"] == 2

    def onload(self) -> None:
        if not cpu_compat.active():
            self.llm.wake_up()

    def close(self) -> None:
        """Shut the engine down. vLLM's shutdown also destroys torch.distributed's default group:
        when the engine shares the runtime's group, close it last."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        leftovers.remove(self._left)
        with contextlib.suppress(OSError):  # another engine of this process may still use it
            os.rmdir(self._sockets)


def _load_weights(worker: Any, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Run in vLLM's worker (`collective_rpc`; in process, so the iterator goes by reference)."""
    model = worker.model_runner.get_model()
    model.load_weights(tensors)
    if cpu_compat.active():
        cpu_compat.after_load(model)
