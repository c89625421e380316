"""Helpers for multi-process tests: gloo ranks started with torch.multiprocessing, tiny HF models.

`run_ranks(fn, world_size, *args)` runs `fn(rank, world_size, *args)` in new processes joined in
one process group (gloo; `backend="nccl"` for ranks on GPUs) and returns the per-rank results (an exception in any rank fails the call
with that rank's traceback). `fn` must be importable (a module-level function).

The ranks are forked from a server process that imported torch, Megatron, transformers and vLLM once for the
test process (multiprocessing's forkserver): a fresh interpreter per rank spent 10-15 s of CPU on those
imports alone. `fresh=True` spawns new interpreters, for what happens at import time (and for NCCL ranks).
"""

from __future__ import annotations

import io
import os
import socket
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pack(value: Any) -> bytes:
    """Results as bytes: tensors sent through the queue would live in the exiting child's memory."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


# what every rank imports, once in the fork server (cpu_compat first: it quiets megatron's import)
PRELOAD = ["torch", "siirl_dag.strategies.megatron.cpu_compat", "megatron.core", "siirl_dag.strategies.megatron.engine",
           "transformers", "vllm.entrypoints.llm"]


def _entry(fn: Callable, rank: int, world: int, port: int, queue, args: tuple, backend: str, env: dict) -> None:
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(env)  # the test's environment now, not the fork server's when it started
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        os.environ["MASTER_PORT"] = str(port)  # as the runtime's ranks have it (vLLM's CPU TP names its files by it)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        queue.put((rank, True, _pack(fn(rank, world, *args))))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, False, traceback.format_exc()))
    finally:
        try:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
        except ImportError:
            pass
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable, world_size: int, *args: Any, timeout: float = 240, backend: str = "gloo",
              fresh: bool = False) -> list[Any]:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    fresh = fresh or backend == "nccl"  # the fork server's imports may touch CUDA, which a fork does not survive
    ctx = mp.get_context("spawn" if fresh else "forkserver")
    if not fresh:
        ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.SimpleQueue()
    port = _free_port()
    env = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, queue, args, backend, env)) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors = []
    try:
        import time

        deadline = time.monotonic() + timeout
        while len(results) + len(errors) < world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks did not finish in {timeout}s")
            if queue.empty():
                if any(p.exitcode not in (None, 0) for p in procs) and queue.empty():
                    time.sleep(0.5)
                    if queue.empty():
                        raise RuntimeError(f"a rank died: exit codes {[p.exitcode for p in procs]}")
                time.sleep(0.05)
                continue
            rank, ok, value = queue.get()
            if ok:
                results[rank] = torch.load(io.BytesIO(value), weights_only=False)
            else:
                errors.append(f"rank {rank}:\n{value}")
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise RuntimeError("\n".join(errors))
    return [results[r] for r in range(world_size)]


TINY = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=256,
            initializer_range=0.1)


def make_tiny_hf(directory: str, arch: str = "qwen2", seed: int = 0, **overrides: Any) -> str:
    """Save a randomly initialised tiny HF causal LM (fp32) and return its directory."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
        "qwen3_moe": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM),
    }
    config_cls, model_cls = classes[arch]
    kwargs = dict(TINY)
    if arch == "qwen3_moe":
        kwargs.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**kwargs)).float()
    randomize_norms_and_biases(model)
    model.save_pretrained(directory)
    return directory


@torch.no_grad()
def randomize_norms_and_biases(model) -> None:
    """Random (not zero/one) norms and biases, so conversions must be exact to pass."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1 + 0.1 * torch.randn_like(p))
        elif name.endswith("bias"):
            p.copy_(0.1 * torch.randn_like(p))


def hf_logits(path: str, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=input_ids, attention_mask=attention_mask).logits


def hf_state(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(os.path.join(path, "model.safetensors"))


def make_batch(n: int = 8, prompt_len: int = 6, resp_len: int = 5, vocab: int = 256, seed: int = 0) -> dict:
    """A batch in the ARCHITECTURE.md layout: left-padded prompts, right-padded responses."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(1, vocab, (n, prompt_len), generator=g)
    responses = torch.randint(1, vocab, (n, resp_len), generator=g)
    plen = torch.randint(1, prompt_len + 1, (n,), generator=g)
    rlen = torch.randint(1, resp_len + 1, (n,), generator=g)
    prompt_mask = (torch.arange(prompt_len)[None] >= prompt_len - plen[:, None]).long()
    response_mask = (torch.arange(resp_len)[None] < rlen[:, None]).long()
    prompts = prompts * prompt_mask
    responses = responses * response_mask
    attention_mask = torch.cat([prompt_mask, response_mask], 1)
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(1) - 1).clamp(min=0),
        "advantages": torch.randn(n, resp_len, generator=g),
        "uid": [f"u{i // 2}" for i in range(n)],
    }


def dims(world: int, sizes: dict):
    """The sizes of a mesh of `world` ranks (data parallel fills the rest), as placement gives them."""
    from siirl_dag.placement.parallel_dims import ParallelDims

    model = sizes.get("tp", 1) * sizes.get("pp", 1) * sizes.get("cp", 1)
    return ParallelDims(**{"dp": world // model, **sizes})
