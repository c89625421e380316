"""Registries of node kinds, strategies and tools: adding one is one new file plus one line.

A node kind is a function that runs one node on a batch, decorated with `@node_kind(...)`, which
records its data contract (keys consumed and produced), the strategies it can run on, and the
schema of its params. Built-in kinds live in the top-level `nodes/` package, which imports this
module and nothing imports back here: looking a kind up by name is `siirl_dag.kinds`', a tool
`nodes.tools`'. A user's own kind is named in the YAML as `module:function`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

from siirl_dag.strategies.megatron.spec import SPEC as MEGATRON
from siirl_dag.strategies.spec import StrategySpec
from siirl_dag.strategies.vllm.spec import SPEC as VLLM

Keys = Union[Sequence[str], Callable[[dict], Sequence[str]]]


@dataclass(frozen=True)
class NodeKind:
    name: str
    fn: Callable[..., dict]
    consumes: Keys = ()
    produces: Keys = ()
    strategies: tuple[str, ...] = ()  # empty: a compute node, runs on CPU beside the driver
    params_schema: str | None = None  # file under siirl_dag/schemas/nodes/
    trains: bool = False  # updates weights of its model (a valid `weights_from` target)
    check: Callable[..., list] | None = None  # extra checks: check(node, pipeline) -> [Problem]
    # checks of the prompts a run feeds it, before anything starts:
    # check_data(node, pipeline, dataset) -> [message] (dataset: a data.PromptDataset)
    check_data: Callable[..., list[str]] | None = None
    # the tokens each prompt takes as this node feeds it to its model (rows of the dataset, in order):
    # prompt_lengths(node, pipeline, dataset) -> [int]; data.filter_overlong_prompts drops by it
    prompt_lengths: Callable[..., list[int]] | None = None
    # it filters rows: its output `keep` (one flag per row) marks the rows the step trains on, and the
    # schedule re-runs it and its ancestors on more prompts until the step is full (any schedule:
    # trainer/schedules/dynamic_sampling.py);
    # its params carry `max_gen_batches`, the rounds a step may take
    filters_rows: bool = False
    # it continues its own output when run on it (NodeContext.resuming): the segments of a partial rollout
    resumes: bool = False
    # what its params ask of the engine it runs on: engine_options(params) -> options, set as if the
    # node wrote them (a rollout returning routed experts needs an engine started to record them)
    engine_options: Callable[[dict], dict] | None = None
    # its output rows are its input rows repeated `options.n` times (samples per prompt), its inputs re-emitted
    expands: bool = False
    # keys it reads when an upstream node holds them, and does without otherwise (an agent's own rewards)
    reads_if_held: tuple[str, ...] = ()
    # what its params make it do in the pipeline, in a line, for `plan` and `visualize`: describe(params, pipeline) -> str
    describe: Callable[[dict, Any], str] | None = None
    # metrics of its own that the console's line of each step shows beside the trainer's (lost episodes, say)
    shown: tuple[str, ...] = ()

    def consumed(self, params: dict) -> tuple[str, ...]:
        return tuple(self.consumes(params) if callable(self.consumes) else self.consumes)

    def produced(self, params: dict) -> tuple[str, ...]:
        return tuple(self.produces(params) if callable(self.produces) else self.produces)

    @property
    def is_model_node(self) -> bool:
        return bool(self.strategies)


KINDS: dict[str, NodeKind] = {}  # name -> kind, as `node_kind` registers them (the built-ins: `siirl_dag.kinds`)

# Strategies: name -> its spec (strategies/<name>/spec.py): adding one is one spec file plus one line here.
STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for spec in (VLLM, MEGATRON)}


def node_kind(name: str | None = None, *, consumes: Keys = (), produces: Keys = (), strategies: Sequence[str] = (),
              params_schema: str | None = None, trains: bool = False, check: Callable | None = None,
              check_data: Callable | None = None, prompt_lengths: Callable | None = None, filters_rows: bool = False,
              resumes: bool = False, engine_options: Callable | None = None, expands: bool = False,
              reads_if_held: Sequence[str] = (), describe: Callable | None = None, shown: Sequence[str] = ()):
    """Decorator registering a node kind. With name=None the function is only annotated (user kinds)."""

    def register(fn: Callable) -> Callable:
        kind = NodeKind(name or f"{fn.__module__}:{fn.__qualname__}", fn, consumes, produces, tuple(strategies),
                        params_schema, trains, check, check_data, prompt_lengths, filters_rows, resumes, engine_options,
                        expands, tuple(reads_if_held), describe, tuple(shown))
        fn.node_kind = kind
        if name is not None:
            if name in KINDS and _origin(KINDS[name].fn) != _origin(fn):
                raise ValueError(f"node kind '{name}' is registered twice ({_origin(KINDS[name].fn)} and {_origin(fn)})")
            KINDS[name] = kind
        return fn

    return register


def _origin(fn: Callable) -> tuple[str, str]:
    """Where a function is defined: the same file imported twice (a script run as __main__ and
    imported by a worker) registers the same kind, not a conflicting one."""
    code = getattr(fn, "__code__", None)
    return (code.co_filename if code else fn.__module__, fn.__qualname__)


# ---- tools an agent rollout may call ------------------------------------------------------------------

@dataclass(frozen=True)
class Tool:
    """A function an agent's model calls by name with JSON arguments, answering with a string."""

    name: str
    fn: Callable[..., str]
    description: str
    parameters: dict  # JSON Schema of the arguments (the OpenAI tool format's `parameters`)
    available: Callable[[], str | None] | None = None  # why it cannot run on this machine, or None

    def spec(self) -> dict:
        """As the chat template shows it to the model (`tools=[...]`)."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}


TOOLS: dict[str, Tool] = {}  # name -> tool, as `tool` registers them (the built-ins: `nodes.tools`)


def tool(name: str | None = None, *, parameters: dict, description: str = "",
         available: Callable[[], str | None] | None = None):
    """Decorator registering a tool. With name=None the function is only annotated (a user's tool,
    named in the YAML as `module:function` and called by the model by the function's name)."""

    def register(fn: Callable[..., str]) -> Callable[..., str]:
        fn.tool = Tool(name or fn.__name__, fn, description or (fn.__doc__ or "").strip().split("\n")[0],
                       parameters, available)
        if name is not None:
            TOOLS[name] = fn.tool
        return fn

    return register
