"""Checkpoints: megatron dist_checkpointing (reshardable: save at one mesh, load at another) for
resume, and HF safetensors for users.

dist_checkpointing's writer may start a spawn-based manager: scripts that save must guard their
entry point with `if __name__ == "__main__":`.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
from typing import Any, Iterable

import torch
import torch.distributed as dist

from siirl_dag.strategies.megatron.hf_config import value_model_config
from siirl_dag.strategies.megatron.hf_convert import HFSpec

# Reshardable layouts: the distributed optimizer's state is saved per parameter (not per DP
# buffer), so a checkpoint moves between TP/PP/DP sizes.
_METADATA = {"distrib_optim_sharding_type": "fully_reshardable", "chained_optim_avoid_prefix": True}
_OPTIMIZER_MARK = "siirl_has_optimizer"


def _trained(chunk: torch.nn.Module) -> set[str]:
    """The parameters that train under adapters: the adapters, and a value model's head."""
    return {name for name, p in chunk.named_parameters() if p.requires_grad}


def _sharded(chunks: list[torch.nn.Module], state: Any, loading: bool, adapters_only: bool) -> dict[str, Any]:
    # One sub-dict per chunk: sharded keys carry global layer numbers, so chunking (VPP) may
    # differ between save and load. With adapters, the frozen base is the HF folder's: only what
    # trains (the only parameters the optimizer holds) is saved.
    model = {f"chunk{i}": {k: v for k, v in c.sharded_state_dict(metadata=_METADATA).items()
                           if not adapters_only or ".lora_" in k or k in _trained(c)} for i, c in enumerate(chunks)}
    sd: dict[str, Any] = {"model": model}
    if state is not None:
        sd["optimizer"] = state.optimizer.sharded_state_dict(model, is_loading=loading, metadata=_METADATA)
        sd["scheduler"] = state.scheduler.state_dict()
    return sd


def save(chunks: list[torch.nn.Module], state: Any, directory: str, adapters_only: bool = False) -> None:
    """Model, or its adapters (and optimizer + LR schedule once training started), of every rank into `directory`."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    # The save is synchronous: its writers' results come back in this process, so they need no queue
    # served by a multiprocessing manager (a spawned interpreter, ~4.5 s of CPU, that megatron starts
    # at a process's first save for asynchronous saves)
    if filesystem_async._results_queue is None:
        filesystem_async._results_queue = queue.Queue()
    if dist.get_rank() == 0:
        os.makedirs(directory, exist_ok=True)
    dist.barrier()
    dist_checkpointing.save(_sharded(chunks, state, False, adapters_only), directory,
                            content_metadata={_OPTIMIZER_MARK: state is not None})


def has_optimizer(directory: str) -> bool:
    from megatron.core import dist_checkpointing

    return bool((dist_checkpointing.load_content_metadata(directory) or {}).get(_OPTIMIZER_MARK))


def load(chunks: list[torch.nn.Module], state: Any, directory: str, adapters_only: bool = False) -> None:
    """Load into this rank's shards, resharding from whatever mesh saved the checkpoint."""
    from megatron.core import dist_checkpointing

    if state is not None and not has_optimizer(directory):
        state = None
    loaded = dist_checkpointing.load(_sharded(chunks, state, True, adapters_only), directory)
    for i, c in enumerate(chunks):
        missing, unexpected = c.load_state_dict(loaded["model"][f"chunk{i}"], strict=False)
        # the frozen base is the HF folder's
        wrong = unexpected + [k for k in missing if ".lora_" in k or k in _trained(c) or not adapters_only]
        if wrong:
            raise RuntimeError(f"checkpoint {directory} does not fit the model: {wrong[:3]}")
    if state is not None:
        state.optimizer.load_state_dict(loaded["optimizer"])
        state.scheduler.load_state_dict(loaded["scheduler"])


def save_hf(export: Iterable[tuple[str, torch.Tensor]], spec: HFSpec, directory: str,
            max_shard_bytes: int = 4 << 30) -> None:
    """An HF model directory (safetensors + the source's config/tokenizer files), written by rank 0
    from the engine's export to the first rank.

    Collective: every rank iterates the export; rank 0 streams it into shards of at most
    `max_shard_bytes`.
    """
    from safetensors.torch import save_file

    writer = dist.get_rank() == 0
    if writer:
        os.makedirs(directory, exist_ok=True)
    files: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, tensor in export:
        if not writer:
            continue
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > max_shard_bytes:
            files.append({})
            size = 0
        files[-1][name] = tensor.cpu().contiguous()
        size += nbytes
    if writer:
        _write_dir(files, spec, directory, save_file)
    dist.barrier()


def save_peft(export: Iterable[tuple[str, torch.Tensor]], lora: Any, spec: HFSpec, directory: str) -> None:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors, PEFT's `base_model.model.`
    names), written by rank 0 from the engine's adapter export (a value model's: with its `score` head,
    which PEFT keeps as a module to save). Collective, as `save_hf`."""
    from safetensors.torch import save_file

    writer = dist.get_rank() == 0
    tensors = {f"base_model.model.{name}": t.cpu().contiguous() for name, t in export if writer}
    if writer:
        os.makedirs(directory, exist_ok=True)
        save_file(tensors, os.path.join(directory, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(directory, "adapter_config.json"), "w") as f:
            json.dump(lora.peft_config(os.path.abspath(spec.path), spec.value_head), f, indent=2)
    dist.barrier()


def _write_dir(files: list[dict[str, torch.Tensor]], spec: HFSpec, directory: str, save_file) -> None:
    names = ["model.safetensors"] if len(files) == 1 else [
        f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for fname, tensors in zip(names, files):
        save_file(tensors, os.path.join(directory, fname), metadata={"format": "pt"})
    if len(files) > 1:
        index = {"metadata": {}, "weight_map": {k: f for f, t in zip(names, files) for k in t}}
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    for fname in os.listdir(spec.path):  # config, generation config, tokenizer files
        if not fname.endswith(".safetensors") and fname != "model.safetensors.index.json":
            src = os.path.join(spec.path, fname)
            if os.path.isfile(src):
                shutil.copy(src, os.path.join(directory, fname))
    if spec.value_head:  # the critic's head is `score`: say so, so HF loads it as a token classifier
        with open(os.path.join(spec.path, "config.json")) as f:
            cfg = value_model_config(json.load(f))
        with open(os.path.join(directory, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
