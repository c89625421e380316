"""Registries of node kinds, strategies and tools: adding one is one new file plus one line.

A node kind is a function that runs one node on a batch, decorated with `@node_kind(...)`, which
records its data contract (keys consumed and produced), the strategies it can run on, and the
schema of its params. Built-in kinds live in the top-level `nodes/` package; a user's own kind is
named in the YAML as `module:function`.
"""

from __future__ import annotations

import importlib
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

    def consumed(self, params: dict) -> tuple[str, ...]:
        return tuple(self.consumes(params) if callable(self.consumes) else self.consumes)

    def produced(self, params: dict) -> tuple[str, ...]:
        return tuple(self.produces(params) if callable(self.produces) else self.produces)

    @property
    def is_model_node(self) -> bool:
        return bool(self.strategies)


_KINDS: dict[str, NodeKind] = {}

# Strategies: name -> its spec (strategies/<name>/spec.py): adding one is one spec file plus one line here.
STRATEGIES: dict[str, StrategySpec] = {spec.name: spec for spec in (VLLM, MEGATRON)}


def node_kind(name: str | None = None, *, consumes: Keys = (), produces: Keys = (), strategies: Sequence[str] = (),
              params_schema: str | None = None, trains: bool = False, check: Callable | None = None,
              check_data: Callable | None = None, prompt_lengths: Callable | None = None, filters_rows: bool = False,
              resumes: bool = False, engine_options: Callable | None = None, expands: bool = False):
    """Decorator registering a node kind. With name=None the function is only annotated (user kinds)."""

    def register(fn: Callable) -> Callable:
        kind = NodeKind(name or f"{fn.__module__}:{fn.__qualname__}", fn, consumes, produces, tuple(strategies),
                        params_schema, trains, check, check_data, prompt_lengths, filters_rows, resumes, engine_options,
                        expands)
        fn.node_kind = kind
        if name is not None:
            if name in _KINDS and _origin(_KINDS[name].fn) != _origin(fn):
                raise ValueError(f"node kind '{name}' is registered twice ({_origin(_KINDS[name].fn)} and {_origin(fn)})")
            _KINDS[name] = kind
        return fn

    return register


def _origin(fn: Callable) -> tuple[str, str]:
    """Where a function is defined: the same file imported twice (a script run as __main__ and
    imported by a worker) registers the same kind, not a conflicting one."""
    code = getattr(fn, "__code__", None)
    return (code.co_filename if code else fn.__module__, fn.__qualname__)


def _load_builtin_kinds() -> None:
    importlib.import_module("nodes")


def registered_kinds() -> dict[str, NodeKind]:
    _load_builtin_kinds()
    return dict(_KINDS)


def resolve_kind(ref: str) -> NodeKind:
    """A registered name, or `module:function` for a function decorated with @node_kind.

    Raises LookupError with a message fit for the user; importing the module runs the user's code,
    so whatever that raises (SyntaxError, sys.exit, ...) becomes such a message too.
    """
    kinds = registered_kinds()
    if ref in kinds:
        return kinds[ref]
    fn = user_ref(ref, "node kind", kinds)
    kind = getattr(fn, "node_kind", None)
    if not isinstance(kind, NodeKind):
        raise LookupError(f"'{ref}' is not a node kind; expected a function decorated with "
                          "@siirl_dag.registry.node_kind(consumes=..., produces=...)")
    return kind


def user_ref(ref: str, what: str, known: dict) -> Any:
    """The object a user's `module:attr` names; LookupError fit for the user otherwise. Importing the
    module runs the user's code, so whatever that raises (SyntaxError, sys.exit, ...) becomes one too."""
    module_name, colon, attr = ref.partition(":")
    if not (colon and module_name and attr):
        raise LookupError(f"unknown {what} '{ref}'; expected one of: {', '.join(sorted(known))}, or module:function")
    try:
        found = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        raise LookupError(f"cannot import module '{module_name}' of {what} '{ref}' ({type(exc).__name__}: {exc}); "
                          "expected an importable module") from None
    for part in attr.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise LookupError(f"module '{module_name}' has no '{attr}' ({what} '{ref}')")
    return found


def import_ref(ref: str) -> Any:
    """Import `module:attr` (a strategy's engine class, a weight-sync path, for instance)."""
    module_name, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module_name), attr)


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


_TOOLS: dict[str, Tool] = {}


def tool(name: str | None = None, *, parameters: dict, description: str = "",
         available: Callable[[], str | None] | None = None):
    """Decorator registering a tool. With name=None the function is only annotated (a user's tool,
    named in the YAML as `module:function` and called by the model by the function's name)."""

    def register(fn: Callable[..., str]) -> Callable[..., str]:
        fn.tool = Tool(name or fn.__name__, fn, description or (fn.__doc__ or "").strip().split("\n")[0],
                       parameters, available)
        if name is not None:
            _TOOLS[name] = fn.tool
        return fn

    return register


def resolve_tool(ref: str) -> Tool:
    """A built-in tool's name, or `module:function` for a function decorated with @tool; LookupError
    with a message fit for the user otherwise."""
    importlib.import_module("nodes.tools")
    if ref in _TOOLS:
        return _TOOLS[ref]
    fn = user_ref(ref, "tool", _TOOLS)
    found = getattr(fn, "tool", None)
    if not isinstance(found, Tool):
        raise LookupError(f"'{ref}' is not a tool; expected a function decorated with "
                          "@siirl_dag.registry.tool(parameters={...JSON Schema...})")
    return found
