"""Training state: DDP wrappers, megatron's optimizer, and the LR schedule, built from options.

Built lazily (the first `train` or optimizer checkpoint load), so a log-prob-only node (reference
model, old log-probs) never allocates gradient buffers or optimizer state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Trainable:
    model: list  # DistributedDataParallel chunks, in pipeline-chunk order
    optimizer: Any  # MegatronOptimizer (ChainedOptimizer with MoE)
    scheduler: Any  # OptimizerParamScheduler


def build(chunks: list[torch.nn.Module], config, opts: dict[str, Any]) -> Trainable:
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
        finalize_model_grads,
    )
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=opts["bf16"],
        overlap_grad_reduce=opts["overlap_grad_reduce"],
        overlap_param_gather=opts["overlap_param_gather"],
        use_distributed_optimizer=opts["use_distributed_optimizer"],
    )
    model = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk, disable_bucketing=i > 0)
        for i, chunk in enumerate(chunks)
    ]
    # What megatron's own training loop wires into the schedule.
    config.finalize_model_grads_func = finalize_model_grads
    config.no_sync_func = [m.no_sync for m in model]
    if len(model) == 1:
        config.no_sync_func = config.no_sync_func[0]
    if opts["overlap_grad_reduce"]:
        config.grad_sync_func = [m.start_grad_sync for m in model]
        if len(model) == 1:
            config.grad_sync_func = config.grad_sync_func[0]
    if opts["overlap_param_gather"]:
        config.param_sync_func = [m.start_param_sync for m in model]
        if len(model) == 1:
            config.param_sync_func = config.param_sync_func[0]

    beta1, beta2 = opts["betas"]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=opts["lr"],
            min_lr=opts["min_lr"],
            weight_decay=opts["weight_decay"],
            adam_beta1=beta1,
            adam_beta2=beta2,
            adam_eps=opts["eps"],
            clip_grad=opts["clip_grad"],
            bf16=opts["bf16"],
            params_dtype=torch.bfloat16 if opts["bf16"] else torch.float32,
            use_distributed_optimizer=opts["use_distributed_optimizer"],
            overlap_param_gather=opts["overlap_param_gather"],
        ),
        model,
    )
    warmup = opts["lr_warmup_steps"]
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0 if warmup else opts["lr"],
        max_lr=opts["lr"],
        min_lr=opts["min_lr"],
        lr_warmup_steps=warmup,
        lr_decay_steps=opts["lr_decay_steps"] or warmup + 1,
        lr_decay_style=opts["lr_decay_style"],
        start_wd=opts["weight_decay"],
        end_wd=opts["weight_decay"],
        wd_incr_steps=1,
        wd_incr_style="constant",
    )
    return Trainable(model, optimizer, scheduler)
