"""Built-in tools of agent rollouts: importing this package registers them (one line per tool);
`resolve_tool` looks one up by name."""

from nodes.tools import calculator, python_sandbox  # noqa: F401
from siirl_dag.refs import user_ref
from siirl_dag.registry import TOOLS, Tool


def resolve_tool(ref: str) -> Tool:
    """A built-in tool's name, or `module:function` for a function decorated with @tool; LookupError
    with a message fit for the user otherwise."""
    if ref in TOOLS:
        return TOOLS[ref]
    fn = user_ref(ref, "tool", TOOLS)
    found = getattr(fn, "tool", None)
    if not isinstance(found, Tool):
        raise LookupError(f"'{ref}' is not a tool; expected a function decorated with "
                          "@siirl_dag.registry.tool(parameters={...JSON Schema...})")
    return found
