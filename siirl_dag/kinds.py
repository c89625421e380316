"""The node kinds a pipeline can name: the built-in ones (importing `nodes` registers them in
`registry.KINDS`) and a user's `module:function` decorated with `@registry.node_kind`."""

from __future__ import annotations

from siirl_dag.refs import registered_or_user
from siirl_dag.registry import KINDS, NodeKind


def resolve_kind(ref: str) -> NodeKind:
    """A registered name, or `module:function` for a function decorated with @node_kind; LookupError with
    a message fit for the user otherwise (importing the module runs the user's code: whatever that
    raises, SyntaxError, sys.exit, ..., becomes such a message too)."""
    import nodes  # noqa: F401 - registers the built-in kinds; imported when first needed, as they import
    # strategy modules that import the config package, which imports this module
    return registered_or_user(ref, "node kind", KINDS, "node_kind", NodeKind,
                              "@siirl_dag.registry.node_kind(consumes=..., produces=...)")
