"""Built-in tools of agent rollouts: importing this package registers them (one line per tool);
`resolve_tool` looks one up by name."""

from nodes.tools import calculator, python_sandbox  # noqa: F401
from siirl_dag.refs import registered_or_user
from siirl_dag.registry import TOOLS, Tool


def resolve_tool(ref: str) -> Tool:
    """A built-in tool's name, or `module:function` for a function decorated with @tool; LookupError
    with a message fit for the user otherwise."""
    return registered_or_user(ref, "tool", TOOLS, "tool", Tool, "@siirl_dag.registry.tool(parameters={...JSON Schema...})")
