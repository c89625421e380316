"""MegatronEngine: log-probs and actor updates (or, as a value model, values and critic updates)
of one model node on one rank of its mesh.

Data contract: each rank is given its data-parallel shard of the batch (docs/ARCHITECTURE.md
layout; ranks of one model-parallel group get the same shard) and every rank returns the result
for that shard. All work goes through megatron's pipeline schedule (`get_forward_backward_func`),
so tensor, pipeline (incl. virtual), expert and data parallelism share one code path.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
from collections.abc import Mapping
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from siirl_dag.errors import ConfigError
from siirl_dag.strategies.base import MiniBatchTotals, RankContext, Strategy
from siirl_dag.strategies.megatron import (batching, checkpoint, context_parallel, hf_convert, logprobs, lora, memory,
                                           offload, options, optim, response_head, routing_replay)
from siirl_dag.strategies.megatron import model as model_lib
from siirl_dag.strategies.megatron.spec import keywords

log = logging.getLogger(__name__)
# loss_fn(logprobs [b,R], entropy [b,R] | None, micro batch, totals) -> (this micro batch's share of the
# mini batch's loss, metrics); a value loss takes (values [b,R], micro batch, totals)
LossFn = Callable[[torch.Tensor, "torch.Tensor | None", dict, MiniBatchTotals], "tuple[torch.Tensor, dict]"]
ValueLossFn = Callable[[torch.Tensor, dict, MiniBatchTotals], "tuple[torch.Tensor, dict]"]


class MegatronEngine(Strategy):
    name = "megatron"

    def __init__(self, ctx: RankContext, model: Any, options_: dict[str, Any] | None = None):
        super().__init__(ctx, model, options_ or {})
        from megatron.core.transformer import TransformerConfig

        self.opts = options.resolve(self.options)
        self.cuda = ctx.device == "cuda" and torch.cuda.is_available()
        if self.cuda:
            torch.cuda.set_device(ctx.cuda_index)
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        self.mesh = ctx.dims
        options.check_device(self.opts, self.mesh.cp, model_lib.use_transformer_engine())
        if not self.cuda and any(self.opts[k] for k in ("param_offload", "grad_offload", "optimizer_offload")):
            log.warning("megatron: param/grad/optimizer offload are no-ops on CPU devices (already in host memory)")
        if self.opts["deterministic"]:
            torch.use_deterministic_algorithms(True)
        model_lib.init_parallel(self.mesh, self.opts["seed"])
        self.spec, shape = model_lib.model_config_kwargs(self.model_path, self.opts["value_head"])
        self.config = self._transformer_config(TransformerConfig, shape)
        self.lora = self.model_field("lora")  # models.lora.LoraSpec: the base frozen, adapters trained
        self.chunks = model_lib.build_model(self.spec, self.config, self.mesh, self.device, self.lora, self.opts["seed"])
        routing_replay.release(self.chunks)
        self._head = response_head.ResponseHead(self.chunks, self.config, self.mesh.cp)
        self._routers: dict[int, list] = {}  # id(model chunk) -> its MoE routers, for routing replay
        self._records: dict | None = None  # while recording routes: (micro batch, layer) -> the experts chosen
        # a recomputed forward re-runs the routers: replayed routes queue for it (routing_replay.Replay)
        self._routers_recompute = self.opts["recompute_granularity"] == "full" or self.opts["moe_layer_recompute"]
        self.train_state: optim.Trainable | None = None
        bound = hf_convert.bind(self.chunks, self.spec.value_head)  # resolved once, for every export
        self._exports = {"model": [b for b in bound if not b.rule.lora], "adapters": [b for b in bound if b.rule.lora]}
        self._offload = offload.Offload(self.opts)

    # ---------------------------------------------------------------- setup
    def _transformer_config(self, cls, shape: dict[str, Any]):
        o, m = self.opts, self.mesh
        dtype = torch.bfloat16 if o["bf16"] else torch.float32
        recompute = o["recompute_granularity"]
        kw = dict(
            shape,
            **keywords(m),
            sequence_parallel=o["sequence_parallel"] and m.tp > 1,
            params_dtype=dtype,
            pipeline_dtype=dtype,
            bf16=o["bf16"],
            recompute_granularity=recompute,
            recompute_method=(o["recompute_method"] or "uniform") if recompute == "full" else None,
            recompute_num_layers=(o["recompute_num_layers"] or 1) if recompute == "full" else None,
            deterministic_mode=o["deterministic"],
            # Interleaved 1F1B with pp=2 sends activations and grads to the same peer in one batch,
            # which can pair them up crosswise; megatron's training loop uses split p2p ops there.
            overlap_p2p_comm=m.vpp > 1,
            batch_p2p_comm=m.vpp == 1,
            # Weights come from the HF checkpoint, but megatron only tags TP-sharded weights
            # (which grad-norm and checkpoint code rely on) in its init path: keep it on.
            perform_initialization=True,
            cuda_graph_scope=[],  # what its default "full" means (megatron warns that "full" is deprecated)
        )
        if self.spec.num_experts:
            kw.update(moe_token_dispatcher_type=o["moe_token_dispatcher_type"], moe_enable_routing_replay=True,
                      moe_grouped_gemm=o["moe_grouped_gemm"], moe_layer_recompute=o["moe_layer_recompute"])
        try:
            return cls(**kw)
        except (AssertionError, ValueError) as e:
            raise ConfigError(f"megatron-core rejects this model/mesh/options combination: {e}", ("options",))

    def _trainable(self) -> optim.Trainable:
        if self.train_state is None:
            self.train_state = optim.build(self.chunks, self.config, self.opts)
        return self.train_state

    @property
    def _model(self) -> list:
        return self.train_state.model if self.train_state else self.chunks

    # --------------------------------------------------------- parallel info
    def _ps(self):
        from megatron.core import parallel_state

        return parallel_state

    @property
    def dp_rank(self) -> int:
        return self._ps().get_data_parallel_rank(with_context_parallel=True)

    @property
    def dp_size(self) -> int:
        return self._ps().get_data_parallel_world_size(with_context_parallel=True)

    @property
    def dp_group(self):
        """The data-parallel group, None on one rank: what a statistic over the whole batch reduces over."""
        return self._ps().get_data_parallel_group() if self.dp_size > 1 else None

    def _dp_max(self, *values: int, op: str = "MAX") -> list[int]:
        """Agree on shapes across DP ranks (expert-parallel collectives span them); op="SUM": add them up."""
        t = torch.tensor(values, dtype=torch.long, device=self.device)
        if self.dp_size > 1:
            dist.all_reduce(t, op=getattr(dist.ReduceOp, op), group=self._ps().get_data_parallel_group(with_context_parallel=True))
        return t.tolist()

    def _totals(self, response_mask: torch.Tensor) -> MiniBatchTotals:
        """The response tokens and non-empty rows of a mini batch, summed over the DP ranks."""
        t = torch.tensor([float(response_mask.sum()), float((response_mask.sum(-1) > 0).sum())],
                         dtype=torch.float64, device=self.device)
        if self.dp_size > 1:
            dist.all_reduce(t, group=self._ps().get_data_parallel_group())
        return MiniBatchTotals(*t.tolist())

    def _from_last_stage(self, tensor: torch.Tensor) -> torch.Tensor:
        ps = self._ps()
        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            tensor = tensor.to(self.device)
            dist.broadcast(tensor, src=dist.get_process_group_ranks(group)[-1], group=group)
        return tensor.cpu()

    # ------------------------------------------------------------- forward
    def _forward_step(self, loss: Callable, data_iterator: Iterator[dict], model):
        mb = {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) else v
              for k, v in next(data_iterator).items()}
        if id(model) not in self._routers:
            self._routers[id(model)] = routing_replay.routers(model)
        found = self._routers[id(model)]
        with routing_replay.Replay(found, mb.get("_routed_experts"), self.config.sequence_parallel, self.device,
                                   self._routers_recompute), routing_replay.Record(found, self._records, mb.get("_micro")), \
                self._head.at(mb["_logit_index"]) as mb["_at_responses"]:
            out = model(context_parallel.local(mb["_input_ids"]), context_parallel.local(mb["_position_ids"]), None)
        return out, functools.partial(loss, mb)

    def _run(self, mbs: list[dict], loss: Callable, seq: int, mbs_size: int, forward_only: bool) -> list:
        from megatron.core.pipeline_parallel import get_forward_backward_func

        try:
            return get_forward_backward_func()(
                forward_step_func=functools.partial(self._forward_step, loss),
                data_iterator=batching.iterate(mbs, len(self._model)),
                model=self._model,
                num_microbatches=len(mbs),
                seq_length=seq,
                micro_batch_size=mbs_size,
                forward_only=forward_only,
            )
        finally:  # routes queued for recompute, or left by a failed step, go
            for found in self._routers.values():
                routing_replay.reset(found)

    def _prepare(self, batch: Mapping[str, Any], replay_routes: bool = False) -> tuple[dict, int]:
        """Align rows to a sequence length all DP ranks agree on (EP collectives span DP); with
        `replay_routes`, the batch's `routed_experts` too, for the routers to replay."""
        pad_to = (self.mesh.tp if self.config.sequence_parallel else 1) * (2 * self.mesh.cp if self.mesh.cp > 1 else 1)
        seq = self._dp_max(batching.seq_length(batch, pad_to))[0]
        if replay_routes:
            self._need_experts()
        return batching.align(batch, seq, replay_topk=self.spec.moe_topk if replay_routes else None), seq

    def _need_experts(self) -> None:
        if not self.spec.num_experts:
            raise ConfigError("routing replay needs an MoE model; this one has no routed experts", ("params",))

    def _need(self, value_model: bool, what: str) -> None:
        """Log-probs need the LM head, values the value head: refuse the other kind of engine."""
        if self.spec.value_head != value_model:
            has = "a value model (value_head: true)" if self.spec.value_head else "a language model"
            raise ConfigError(f"{what} needs {'a value' if value_model else 'a language'} model, but this engine "
                              f"holds {has}; expected value_head: {str(value_model).lower()} on this mesh and model",
                              ("options", "value_head"))

    @torch.no_grad()
    def _forward_only(self, batch: Mapping[str, Any], micro_batch_size: int | None, head: Callable,
                      keys: list[str], replay_routes: bool = False, record_routes: bool = False) -> dict[str, torch.Tensor]:
        """Run `head(micro_batch, model output) -> {key: [b, R]}` over micro batches through the
        pipeline schedule; every rank gets the [B, R] results of its shard (and with `record_routes`
        the experts its routers chose, as `routed_experts`)."""
        n_rows, resp_len = batch["responses"].shape
        aligned, seq = self._prepare(batch, replay_routes)
        mbs = batching.micro_size(micro_batch_size or self.opts["micro_batch_size"], seq,
                                  self.opts["dynamic_micro_batch_tokens"], self.mesh.vpp, self.mesh.pp)
        n_micro = self._dp_max(-(-n_rows // mbs))[0]
        if self.mesh.vpp > 1:  # the interleaved schedule runs micro batches in groups of pp
            n_micro = -(-n_micro // self.mesh.pp) * self.mesh.pp
        padded = batching.pad_rows(batch, aligned, n_micro * mbs)
        micro = batching.micro_batches(*padded, mbs)
        if record_routes:
            self._need_experts()
            self._records = {}
            for i, mb in enumerate(micro):
                mb["_micro"] = i

        def loss(mb, output):
            return output.new_zeros(()), {k: v.float() for k, v in head(mb, output).items()}

        for m in self._model:
            m.eval()
        try:
            results = self._run(micro, loss, seq, mbs, forward_only=True)
        finally:
            records, self._records = self._records, None
        out = {}
        if record_routes:
            rows = padded[0]
            out["routed_experts"] = routing_replay.recorded(
                records, n_micro * mbs, seq, self.spec.num_layers, self.spec.moe_topk, self.spec.num_experts,
                self.config.sequence_parallel,
                batching.source_positions(rows, seq), rows["attention_mask"].sum(1), batch["input_ids"].shape[1])[:n_rows]
        for k in keys:
            if self._ps().is_pipeline_last_stage(ignore_virtual=True):
                full = torch.cat([r[k].cpu() for r in results])[:n_rows].contiguous()
            else:
                full = torch.zeros(n_rows, resp_len)
            out[k] = self._from_last_stage(full)
        return out

    def compute_logprobs(self, batch: Mapping[str, Any], temperature: float = 1.0, micro_batch_size: int | None = None,
                         return_entropy: bool = False, adapters: bool = True, replay_routes: bool = False,
                         record_routes: bool = False) -> dict[str, torch.Tensor]:
        """{"logprobs": [B, R]} (and "entropy") of the response tokens; 0 on response padding.
        `adapters=False`: as the frozen base computes them (a reference model without weights of its own);
        `replay_routes`: through the experts of the batch's `routed_experts` (routing_replay.py);
        `record_routes`: also "routed_experts", the experts the routers chose (for an update to replay)."""
        self._need(False, "compute_logprobs")

        def head(mb, logits):
            lp, ent = logprobs.response_logprobs(mb, logits, self.spec.vocab_size, self.mesh.cp, temperature, return_entropy)
            return {"logprobs": lp} if ent is None else {"logprobs": lp, "entropy": ent}

        keys = ["logprobs"] + (["entropy"] if return_entropy else [])
        with contextlib.nullcontext() if adapters else lora.disabled(self.chunks):
            return self._forward_only(batch, micro_batch_size, head, keys, replay_routes, record_routes)

    def probe_logprobs(self, batch: Mapping[str, Any]) -> torch.Tensor:
        """Log-probs of the response tokens of a small fixed batch (verified sync's probe)."""
        return self.compute_logprobs(batch)["logprobs"]

    def compute_values(self, batch: Mapping[str, Any], micro_batch_size: int | None = None) -> torch.Tensor:
        """Values [B, R]: entry j is the value of the state before response token j (the output at
        position P+j-1, as verl's critic); 0 on response padding."""
        self._need(True, "compute_values")

        def head(mb, values):
            return {"values": logprobs.response_values(mb, values)}

        return self._forward_only(batch, micro_batch_size, head, ["values"])["values"]

    # --------------------------------------------------------------- train
    def train(self, batch: Mapping[str, Any], loss_fn: LossFn, mini_batch_size: int, micro_batch_size: int,
              epochs: int = 1, entropy: bool = True, replay_routes: bool = False,
              entropy_grad: bool = True) -> dict[str, float]:
        """PPO-style update: `epochs` passes over mini batches, one optimizer step per mini batch.

        mini_batch_size counts samples over all DP ranks (so results do not depend on the DP size);
        micro_batch_size is per rank. loss_fn(logprobs [b,R], entropy [b,R] | None, micro_batch, totals)
        -> (the micro batch's share of the mini batch's loss: its sums over the `totals` of the whole mini
        batch, metrics); the shares add up to the loss of the mini batch as one. `replay_routes`: as
        compute_logprobs. `entropy_grad=False`: the entropy is a metric only, computed outside autograd
        (a loss without an entropy bonus does not pay its backward through the vocabulary).
        """
        self._need(False, "train")

        def loss(mb, logits, totals):
            return loss_fn(*logprobs.response_logprobs(mb, logits, self.spec.vocab_size, self.mesh.cp, 1.0, entropy,
                                                       entropy_grad), mb, totals)

        return self._update(batch, loss, mini_batch_size, micro_batch_size, epochs, replay_routes)

    def train_values(self, batch: Mapping[str, Any], loss_fn: ValueLossFn, mini_batch_size: int,
                     micro_batch_size: int | None = None, epochs: int = 1) -> dict[str, float]:
        """The critic's update, as `train` but with loss_fn(values [b,R], micro_batch) -> (loss, metrics);
        micro_batch_size defaults to the `micro_batch_size` option."""
        self._need(True, "train_values")

        def loss(mb, values, totals):
            return loss_fn(logprobs.response_values(mb, values), mb, totals)

        return self._update(batch, loss, mini_batch_size, micro_batch_size or self.opts["micro_batch_size"], epochs)

    def _update(self, batch: Mapping[str, Any], loss_fn: Callable, mini_batch_size: int, micro_batch_size: int,
                epochs: int, replay_routes: bool = False) -> dict[str, float]:
        """The mini-batch loop of `train` / `train_values`; loss_fn(micro_batch, model output, totals)."""
        state = self._trainable()
        n_rows = batch["responses"].shape[0]
        aligned, seq = self._prepare(batch, replay_routes)
        (total,), (widest,) = self._dp_max(n_rows, op="SUM"), self._dp_max(n_rows)
        parts, size, micro_batch_size = batching.mini_batches(n_rows, total, widest, mini_batch_size, micro_batch_size, seq,
                                                              self.dp_size, self.opts["dynamic_micro_batch_tokens"],
                                                              self.mesh.vpp, self.mesh.pp)

        def loss(totals, shares, mb, output):
            value, metrics = loss_fn(mb, output, totals)
            # megatron divides by the micro batches, its DDP by the DP ranks: undo both, since the shares
            # already add up to the mini batch's loss (and report a copy: megatron scales it in place)
            value = value * shares
            return value, {"loss": value.detach().clone(), **metrics}

        for m in state.model:
            m.train()
        sums: dict[str, float] = {}
        grad_norms, steps = [], 0
        for _ in range(epochs):
            for start, stop in parts:
                sub, sub_aligned = batching.take(batch, aligned, start, stop, size)
                micro = batching.micro_batches(sub, sub_aligned, micro_batch_size)
                step_loss = functools.partial(loss, self._totals(sub["response_mask"]), len(micro) * self.dp_size)
                for m in state.model:
                    m.zero_grad_buffer()
                state.optimizer.zero_grad()
                for r in self._run(micro, step_loss, seq, micro_batch_size, forward_only=False):
                    for k, v in r.items():
                        sums[k] = sums.get(k, 0.0) + float(v) / len(micro)
                # Advance the schedule first: step k uses lr(k), so warm-up starts above 0.
                state.scheduler.step(increment=1)
                lr = state.optimizer.param_groups[0]["lr"]
                _, grad_norm, _ = state.optimizer.step()
                grad_norms.append(float(grad_norm) if grad_norm is not None else 0.0)
                steps += 1
        metrics = self._reduce_metrics({k: v / steps for k, v in sums.items()})
        metrics.update(grad_norm=sum(grad_norms) / steps, lr=lr)
        return metrics

    def _reduce_metrics(self, local: dict[str, float]) -> dict[str, float]:
        """Mean over DP ranks, from the last pipeline stage to every rank."""
        ps = self._ps()
        if ps.get_pipeline_model_parallel_world_size() > 1:
            group = ps.get_pipeline_model_parallel_group()
            box = [local]
            dist.broadcast_object_list(box, src=dist.get_process_group_ranks(group)[-1], group=group)
            local = box[0]
        keys = sorted(local)
        t = torch.tensor([local[k] for k in keys], dtype=torch.float64, device=self.device)
        if self.dp_size > 1:
            dist.all_reduce(t, group=ps.get_data_parallel_group(with_context_parallel=True))
            t /= self.dp_size
        return dict(zip(keys, t.cpu().tolist()))

    # ------------------------------------------------------------- weights
    def _sync_params(self) -> None:
        """With overlap_param_gather the last optimizer step's params arrive lazily: force them."""
        if self.train_state and self.opts["overlap_param_gather"]:
            for m in self.train_state.model:
                m.start_param_sync(force_sync=True)

    def export_hf_weights(self, copy: bool = True, first_rank_only: bool = False, timings: dict | None = None,
                          what: str = "merged") -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, full tensor) on every rank, or whole on the first rank only; collective over
        the model-parallel group. copy=False may yield views of the live parameters (see hf_convert.export_hf);
        `timings["convert_s"]` accrues the seconds spent converting to HF's layout. `what`, with
        adapters: "merged" (the model as it computes, `W + scale * B A`), "base" (the frozen base),
        "adapters" (only them, under PEFT's names); without, the three are the model (none for "adapters")."""
        self._sync_params()
        bounds = self._exports["adapters" if what == "adapters" else "model"]
        return hf_convert.export_hf(bounds, self.spec, copy, first_rank_only, timings, merged=what == "merged")

    def save_hf(self, directory: str) -> None:
        """The model as it computes, merged adapters included, as an HF folder."""
        checkpoint.save_hf(self.export_hf_weights(first_rank_only=True), self.spec, directory)

    def save_adapters(self, directory: str) -> None:
        """The adapters as a PEFT folder (adapter_config.json, adapter_model.safetensors) vLLM and peft load."""
        export = self.export_hf_weights(first_rank_only=True, what="adapters")
        if self.spec.value_head:  # its head trains too (every rank walks the whole export: it is collective)
            head = ((n, t) for n, t in self.export_hf_weights(first_rank_only=True, what="base") if n == "score.weight")
            export = itertools.chain(export, head)
        checkpoint.save_peft(export, self.lora, self.spec, directory)

    def save_checkpoint(self, directory: str) -> None:
        """Model and training state; with adapters only them and their optimizer (the base is the HF folder's)."""
        self._sync_params()
        checkpoint.save(self.chunks, self.train_state, directory, adapters_only=self.lora is not None)

    def load_checkpoint(self, directory: str, load_optimizer: bool = True) -> None:
        state = self._trainable() if load_optimizer and checkpoint.has_optimizer(directory) else self.train_state
        checkpoint.load(self.chunks, state, directory, adapters_only=self.lora is not None)

    def memory_gib(self) -> dict[str, float]:
        """What this rank holds in weights, gradients and optimizer state (to check the memory plan)."""
        return memory.measured(self.chunks, self.train_state)

    # ------------------------------------------------------------- offload
    def offload(self) -> None:
        """Free the GPU for a colocated role: params / grads / optimizer state to host, as configured."""
        if self.cuda and not self._offload.active:
            self._offload.to_host(self.chunks, self.train_state)

    def onload(self) -> None:
        if self._offload.active:
            self._offload.restore()

