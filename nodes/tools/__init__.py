"""Built-in tools of agent rollouts. Importing this package registers them (one line per tool)."""

from nodes.tools import calculator, python_sandbox  # noqa: F401
