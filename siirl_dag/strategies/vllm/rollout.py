"""The `vllm` rollout strategy: one vLLM engine per data-parallel rank, tensor parallel inside it.

The engine runs inside the rank's own process (no engine-core subprocess): it starts in seconds,
weight updates hand tensors over by reference, and a colocated trainer shares the process. With the
runtime's process group over the mesh, every rank joins vLLM's `external_launcher` executor, which
reads the world as (external dp) x t with t fastest, the rank order of our meshes: each group of t
consecutive ranks is one engine sharding the model t ways. Without a group the engine is a t=1 one.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import tempfile
import time
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import torch
import torch.distributed as dist

from siirl_dag import orphan_files
from siirl_dag.models.lora import payload
from siirl_dag.errors import ConfigError, Problem
from siirl_dag.strategies.base import RankContext, Strategy
from siirl_dag.strategies.vllm import cpu_compat
from siirl_dag.strategies.samples import PARTIAL, Sample, pack_batch, prompt_token_ids
from siirl_dag.strategies.vllm.options import ROUTES_NEED_GPU, resolve_options, sampled_logprobs, sampling_kwargs
from siirl_dag.strategies.vllm.turns import Turns

log = logging.getLogger(__name__)
_RPC_BASE = os.environ.get("VLLM_RPC_BASE_PATH") or tempfile.gettempdir()  # read before an engine sets it
_ADAPTER_ID = 1
# vLLM says this at INFO whenever the prefix cache is reset, which a weight update does every step
logging.getLogger("vllm.v1.core.block_pool").addFilter(lambda r: r.getMessage() != "Successfully reset prefix cache")


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
        self.tp, self.weights_version = ctx.dims.tp, 0
        # LoRA: served as adapters, or (models.lora.payload) as weights with them merged in
        self.lora, self._lora_request = self.model_field("lora"), None
        self.adapters = payload(self.lora, "cpu" if cpu_compat.active() else "cuda")[0] == "adapters"
        # True while the engine holds no complete weights: load_format dummy, a level-2 sleep, a failed load
        self._needs_weights = self.options["load_format"] == "dummy"
        self._asleep = False  # vLLM warns at a wake of an engine that is not asleep (a run's first sync)
        # A TP group's message queue binds two ZMQ sockets as files in VLLM_RPC_BASE_PATH that nothing
        # removes, not even a clean shutdown: each engine's go into a folder of the process, removed at close
        self._left: list[str] = []  # files vLLM leaves behind (sockets; TP shared memory on CPU)
        self._sockets = orphan_files.own_folder("siirl-vllm-rpc-", _RPC_BASE)
        self.llm = self._start_engine(self.model_path)
        self.tokenizer = tok = self.llm.get_tokenizer()
        self.pad_token_id = tok.eos_token_id if tok.pad_token_id is None else tok.pad_token_id

    def _start_engine(self, path: str):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the in-process engine core (external_launcher needs it too)
        from vllm import LLM  # importing vLLM costs seconds: only ranks that roll out pay

        opts, group = self.options, dist.is_available() and dist.is_initialized()
        kwargs: dict[str, Any] = dict(
            model=path, dtype=opts["dtype"], seed=opts["seed"] + self.ctx.rank // self.tp,
            gpu_memory_utilization=opts["gpu_memory_utilization"], max_num_seqs=opts["max_num_seqs"],
            max_model_len=opts["max_model_len"], enforce_eager=opts["enforce_eager"],
            enable_prefix_caching=opts["enable_prefix_caching"], logprobs_mode=opts["logprobs_mode"],
            load_format=opts["load_format"], tensor_parallel_size=self.tp, enable_sleep_mode=True,
        )
        if self.adapters:  # one adapter, on every row (rows without one beside it would take the last slot on CPU)
            kwargs.update(enable_lora=True, max_lora_rank=self.lora.rank, max_loras=1)
        if opts["return_routed_experts"]:  # for routing replay
            if cpu_compat.active():
                raise ConfigError(f"{ROUTES_NEED_GPU}; expected return_routed_experts: false on CPU",
                                  ("options", "return_routed_experts"))
            # vLLM picks the GPU model runner that records routes (0.25: V1; V2 refuses them there)
            kwargs["enable_return_routed_experts"] = True
        if group and dist.get_world_size() != self.ctx.world_size:
            raise RuntimeError(f"the process group has {dist.get_world_size()} ranks, the mesh {self.ctx.world_size}")
        if group:
            kwargs["distributed_executor_backend"] = "external_launcher"
            # vLLM's GPU worker takes LOCAL_RANK as its device index among the visible ones
            local = self.ctx.local_device_index if cpu_compat.active() else self.ctx.cuda_index
            os.environ.update(RANK=str(dist.get_rank()), LOCAL_RANK=str(local), WORLD_SIZE=str(dist.get_world_size()))
        elif self.tp > 1:
            raise RuntimeError(f"t={self.tp} needs the runtime's process group over the mesh "
                               "(torch.distributed is not initialized in this process)")
        on_cpu = contextlib.nullcontext()
        if cpu_compat.active():
            kwargs.update(cpu_compat.engine_kwargs(opts))
            first = self.ctx.rank // self.tp * self.tp
            on_cpu = cpu_compat.building(list(range(first, first + self.tp)), self._left)
        start = time.perf_counter()
        os.environ["VLLM_RPC_BASE_PATH"] = self._sockets  # the same for every engine of a process: vLLM caches it
        with host_rng_kept(), orphan_files.created(self._sockets, self._left), on_cpu:
            llm = LLM(**kwargs)
        log.info("vLLM engine (t=%d, rank %d) started in %.1f s", self.tp, self.ctx.rank, time.perf_counter() - start)
        return llm

    def generate(self, prompts: Sequence[str | Sequence[int] | Sequence[dict]], sampling: dict[str, Any] | None,
                 max_prompt_length: int, max_response_length: int,
                 chat_template: bool | None = None, max_new_tokens: int | None = None) -> dict[str, Any]:
        """Sample responses; rows are prompt-major (the n samples of a prompt are adjacent).

        `sampling` overrides the options' sampling keys for this call, and may add `seed`, `greedy` or
        `validate` (options.sampling_kwargs). Text prompts go through the chat template if
        `chat_template` (default: the option), chat lists always, token ids as given. Returns the
        batch-layout tensors plus `finish_reason` and `sample_index` (the prompt each row answers).
        `max_new_tokens`: a segment of a partial rollout; the samples it cuts short end with
        finish_reason PARTIAL, and `resume` continues them.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_weights()
        kw = sampling_kwargs(self.options, sampling or {}, max_response_length)
        use_chat = self.options["chat_template"] if chat_template is None else chat_template
        prompt_ids = [prompt_token_ids(self.tokenizer, p, use_chat) for p in prompts]
        bad = [(i, len(p)) for i, p in enumerate(prompt_ids) if not 0 < len(p) <= max_prompt_length]
        if bad:  # a run's prompts were measured before it started (nodes/rollout.py); max_model_len too
            shown = ", ".join(f"prompt {i} has {n} tokens" for i, n in bad[:5])
            raise ConfigError([Problem(("data", "max_prompt_length"), f"{len(bad)} prompt(s) empty or too long: {shown}, "
                                       f"expected 1 to max_prompt_length={max_prompt_length}; raise it or filter the data")])
        seed, limit = kw.pop("seed"), kw["max_tokens"]
        # only stop strings need the text
        params = SamplingParams(**dict(kw, detokenize=bool(kw["stop"]),
                                       max_tokens=min(limit, max_new_tokens or limit)))
        with self._seeded(seed):
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], params, use_tqdm=False,
                                        lora_request=self._lora_request)
        samples = [_sample(i, (), (), c, limit) for i, out in enumerate(outputs)
                   for c in sorted(out.outputs, key=lambda c: c.index)]
        return pack_batch(prompt_ids, samples, max_prompt_length, max_response_length, self.pad_token_id)

    @contextlib.contextmanager
    def _seeded(self, seed: int | None) -> Iterator[None]:
        """One seed for a whole call: the process's generators, which vLLM samples from, set to it and
        given back afterwards (an engine's TP ranks get the same seed from the runtime, its data-parallel
        engines each their own). The samples are reproducible for the same prompts in the same order.
        Not a seed per request: vLLM draws from each request's own generator row by row at every step on
        a CPU (5% of the demo's rollout), and on a GPU its FlashInfer sampler takes none and falls back
        to torch's."""
        if seed is None:
            yield
            return
        with torch.random.fork_rng(devices=[torch.cuda.current_device()] if torch.cuda.is_available() else []):
            torch.manual_seed(seed)
            yield

    def resume(self, prompt_ids: Sequence[Sequence[int]], samples: Sequence[Sample], sampling: dict[str, Any] | None,
               max_prompt_length: int, max_response_length: int, max_new_tokens: int | None = None) -> dict[str, Any]:
        """Continue the samples that end PARTIAL (each after its prompt and the tokens it has, prefilled
        with the weights held now) by up to `max_new_tokens` more, the others as they are; packed as
        `generate` packs. Each sample draws from a seed of its own and its length. A stop string that
        spans two segments is not seen."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        self._check_weights()
        kw = sampling_kwargs(self.options, sampling or {}, max_response_length)
        seed, limit = kw.pop("seed"), kw["max_tokens"]
        todo = [i for i, s in enumerate(samples) if s.finish_reason == PARTIAL]
        params = [SamplingParams(**dict(kw, n=1, detokenize=bool(kw["stop"]),
                                        max_tokens=min(limit - len(samples[i].token_ids), max_new_tokens or limit),
                                        seed=None if seed is None else
                                        (seed + i * 1_000_003 + len(samples[i].token_ids) * 97) % 2**31))
                  for i in todo]
        prompts = [TokensPrompt(prompt_token_ids=[*prompt_ids[samples[i].prompt_index], *samples[i].token_ids])
                   for i in todo]
        outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request) if todo else []
        out = list(samples)
        for i, o in zip(todo, outputs):
            out[i] = _sample(samples[i].prompt_index, samples[i].token_ids, samples[i].logprobs, o.outputs[0], limit)
        return pack_batch(prompt_ids, out, max_prompt_length, max_response_length, self.pad_token_id)

    def _check_weights(self) -> None:
        if self._needs_weights:
            raise RuntimeError("the engine holds no complete weights (load_format 'dummy', offload() with "
                               "sleep_level 2, or a weight load that failed part-way): call load_weights "
                               "before generate")

    def turns(self, sampling: dict[str, Any], max_response_length: int, stop: list[str]) -> Turns:
        """Single turns on this engine's step loop, for an agent's trajectories (nodes/agent_loop.py);
        `stop` strings end a turn and stay in its output."""
        self._check_weights()
        return Turns(self.llm.llm_engine, self.options, self._lora_request, sampling, max_response_length, stop)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the weights in place with HF-named tensors (a generator is consumed once, by vLLM's own
        loader, which fuses q/k/v and gate/up and cuts this rank's TP shard) and stamp `version`. After a
        load that failed part-way the engine refuses to generate until one succeeds. The prefix cache is
        reset: no KV state of the old weights survives."""
        if version < self.weights_version:
            raise ValueError(f"weights version {version} is older than the engine's {self.weights_version}")
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

    def load_adapters(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Replace the LoRA adapters the engine applies with these (HF-named, in memory: no file) and stamp
        `version`; if that fails the engine refuses to generate until a load succeeds."""
        from vllm.lora.request import LoRARequest

        if version < self.weights_version:
            raise ValueError(f"weights version {version} is older than the engine's {self.weights_version}")
        try:  # cloned: vLLM scales lora_B in place
            tensors = {f"base_model.model.{name}": t.clone() for name, t in named_tensors}
            self.llm.collective_rpc(_load_adapters, args=(tensors, self.lora.peft_config(self.model_path)))
        except BaseException:
            self._needs_weights = True
            raise
        self._lora_request = LoRARequest("adapters", _ADAPTER_ID, "mem://adapters")
        self.llm.reset_prefix_cache()  # its blocks are keyed on the adapter's name, which stays
        self.weights_version, self._needs_weights = version, False

    def probe_logprobs(self, batch: dict[str, Any]) -> torch.Tensor:
        """Log-probs of the response tokens of a small fixed batch, teacher-forced (verified sync's probe)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        rows = [ids[mask.bool()].tolist() for ids, mask in zip(batch["input_ids"], batch["attention_mask"])]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=r) for r in rows], SamplingParams(
            max_tokens=1, prompt_logprobs=0, detokenize=False), use_tqdm=False, lora_request=self._lora_request)
        R = batch["responses"].shape[1]
        return torch.tensor([[lp[t].logprob for lp, t in zip(o.prompt_logprobs[-R:], r[-R:])] for o, r in zip(outs, rows)])

    def offload(self) -> None:
        """Free the device for a colocated trainer (vLLM sleep mode; on CPU, where vLLM has none, the
        engine keeps its weights and its kv_cache_gb of KV cache)."""
        if not cpu_compat.active() and not self._asleep:
            self.llm.sleep(level=self.options["sleep_level"])
            self._needs_weights = self.options["sleep_level"] == 2
            self._asleep = True

    def onload(self) -> None:
        if self._asleep:
            self.llm.wake_up()
            self._asleep = False

    def close(self) -> None:
        """Shut the engine down. vLLM's shutdown also destroys torch.distributed's default group:
        when the engine shares the runtime's group, close it last."""
        if self.llm is not None:
            self.llm.llm_engine.engine_core.shutdown()
            self.llm = None
        orphan_files.remove(self._left)
        with contextlib.suppress(OSError):  # another engine of this process may still use it
            os.rmdir(self._sockets)


def _sample(index: int, tokens: Sequence[int], logprobs: Sequence[float], completion: Any, limit: int) -> Sample:
    """The tokens a sample had, then vLLM's completion of them; PARTIAL where the segment stopped it
    before its own limit (max_tokens)."""
    new = list(completion.token_ids)
    total = [*tokens, *new]
    reason = PARTIAL if completion.finish_reason == "length" and len(total) < limit else completion.finish_reason
    return Sample(index, total, [*logprobs, *sampled_logprobs(completion)], reason,
                  routed_experts=completion.routed_experts)


def _load_adapters(worker: Any, tensors: dict[str, torch.Tensor], config: dict) -> None:
    """Runs in vLLM's worker: the adapter built from the tensors, in place of the one before."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = worker.model_runner.lora_manager._adapter_manager
    adapter = LoRAModel.from_lora_tensors(_ADAPTER_ID, tensors, PEFTHelper.from_dict(config),
                                          device=str(worker.model_runner.device), dtype=worker.model_runner.model_config.dtype)
    manager.remove_adapter(_ADAPTER_ID)
    manager.add_adapter(adapter)
    manager.activate_adapter(_ADAPTER_ID)


def _load_weights(worker: Any, tensors: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Runs in vLLM's worker (`collective_rpc`, in process: the iterator goes by reference)."""
    model = worker.model_runner.get_model()
    model.load_weights(tensors)
    if cpu_compat.active():
        cpu_compat.after_load(model)
