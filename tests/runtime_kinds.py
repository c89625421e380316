"""Pure-Python node kinds and a trivial engine, registered only in tests, to exercise the runtime."""

from __future__ import annotations

import os
import time

import torch

from siirl_dag.errors import NodeFailure
from siirl_dag.registry import node_kind
from siirl_dag.strategies.base import Strategy


class EchoEngine(Strategy):
    """Stands in for a strategy: the runtime tests check scheduling and data flow, not models."""

    name = "echo"
    weights_version = 0  # the version a stand-in weight sync gave it (test_schedules)

    def pid(self) -> int:
        return os.getpid()

    def hold(self, version: int) -> None:
        self.weights_version = version


class BrokenEngine(Strategy):
    """An engine whose model cannot be built."""

    def __init__(self, ctx, model, options):
        raise RuntimeError("no such model")


@node_kind("t_expand", consumes=("raw_prompt",), produces=("x",), strategies=("megatron",), expands=True)
def t_expand(batch, ctx):
    """n rows per prompt; x = 100 * prompt number + sample index."""
    n = ctx.params.get("n", 1)
    index = torch.arange(batch.num_rows).repeat_interleave(n)
    x = torch.tensor([int(p.split()[-1]) * 100 + i % n for i, p in zip(range(len(index)), [batch["raw_prompt"][j] for j in index])])
    ctx.metrics["pid/" + ctx.node.id] = ctx.engine.pid()
    return ctx.expand(index, {"x": x.float()})


@node_kind("t_scale", consumes=("x",), produces=lambda p: (p.get("out", "y"),), strategies=("megatron",))
def t_scale(batch, ctx):
    """out = x * factor (+ seeded noise when asked); records its own wall-clock span."""
    start = time.time()
    time.sleep(ctx.params.get("sleep", 0))
    y = batch["x"] * ctx.params.get("factor", 2)
    if ctx.params.get("noise"):
        y = y + torch.rand(y.shape, generator=ctx.generator)
    ctx.metrics[f"span/{ctx.node.id}"] = (start, time.time())
    ctx.metrics[f"rows/{ctx.node.id}/dp{ctx.dp_rank}"] = batch.num_rows
    ctx.metrics["pid/" + ctx.node.id] = ctx.engine.pid()
    return {ctx.params.get("out", "y"): y}


@node_kind("t_join", consumes=lambda p: tuple(p["keys"]), produces=("s",))
def t_join(batch, ctx):
    """s = sum of the given keys (a compute node, beside the driver)."""
    return {"s": sum(batch[k] for k in ctx.params["keys"])}


@node_kind("t_fail", consumes=("x",), produces=("z",))
def t_fail(batch, ctx):
    print("t_fail: about to fail", flush=True)  # what a library would have said just before
    if ctx.params.get("told"):  # a failure its message tells whole (the user's agent, data or settings)
        raise NodeFailure("every episode was lost; the first: the agent raised")
    raise ValueError("boom: the test node failed on purpose")


@node_kind("t_flaky", consumes=("x",), produces=("z",), strategies=("megatron",))
def t_flaky(batch, ctx):
    """Kills its own process on the first call (a dead actor), works after a restart."""
    marker = ctx.params["marker"]
    if not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(1)
    return {"z": batch["x"] + 1}


@node_kind("t_update", consumes=("x",), produces=(), strategies=("megatron",), trains=True)
def t_update(batch, ctx):
    """Stands in for an actor update: the driver counts its weight versions."""
    EVENTS.append(("update", ctx.step))
    ctx.metrics["update/rows"] = batch.num_rows
    ctx.metrics["update/uids"] = sorted(set(batch["uid"]), key=int) if "uid" in batch else []
    return {}


EVENTS: list = []  # what ran, in order, in this process (the local backend): test_schedules reads it


@node_kind("t_rollout", consumes=("raw_prompt",), produces=("x", "weights_version", "token_weights_version",
                                                            "finish_reason"), strategies=("megatron",), resumes=True,
           expands=True)
def t_rollout(batch, ctx):
    """Stands in for a rollout: n rows per prompt (x as t_expand's), stamped with the version its engine holds.
    Samples of two tokens: in segments (ctx.segment_tokens) the first cuts them short, the second ends them."""
    n, v = ctx.params.get("n", 1), ctx.engine.weights_version
    EVENTS.append(("gen", ctx.step, v) if not ctx.resuming else ("resume", ctx.step, v))
    if ctx.resuming:
        tokens = batch["token_weights_version"].clone()
        tokens[:, 1] = v
        return dict(batch.merge({"token_weights_version": tokens, "finish_reason": ["stop"] * batch.num_rows}))
    index = torch.arange(batch.num_rows).repeat_interleave(n)
    x = torch.tensor([int(batch["raw_prompt"][j].split()[-1]) * 100 + i % n for i, j in enumerate(index.tolist())])
    rows = len(index)
    return ctx.expand(index, {"x": x.float(), "weights_version": torch.full((rows,), v),
                              "token_weights_version": torch.full((rows, 2), v),
                              "finish_reason": ["partial" if ctx.segment_tokens else "stop"] * rows})


@node_kind("t_keep", consumes=("x", "uid", "finish_reason"), produces=("keep",), filters_rows=True)
def t_keep(batch, ctx):
    """Stands in for filter_groups: keeps the rows of the even-numbered prompts (none with `none: true`)."""
    assert "partial" not in batch["finish_reason"], "the filter saw samples cut short"
    EVENTS.append(("keep", ctx.step))
    keep = (batch["x"] // 100 % 2 == 0) & (not ctx.params.get("none", False))
    return {"keep": keep.long()}


@node_kind("t_liar", consumes=("x",), produces=("z",))
def t_liar(batch, ctx):
    return {"w": batch["x"]}


@node_kind(consumes=(), produces=())
def t_sleep(batch, ctx):
    """A long compute step (a `module:function` kind): something to interrupt."""
    time.sleep(ctx.params["seconds"])
    return {}
