"""`module:attr` references: ours (a strategy's engine, a weight-sync path), imported as written, and
a user's (a node kind, a tool, a score parser), with a message fit for the user when they fail. And
where the run's processes import them from: the processes the run starts (Ray's workers, an agents'
process) import what the driver does; the programs it starts for the user (an agent program, maybe in
a Python of its own) get the environment the run was started with."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

USER_PYTHONPATH = "SIIRL_DAG_USER_PYTHONPATH"  # the PYTHONPATH the run was started with ("": none)


def importing_env() -> dict[str, str]:
    """Environment variables for a Python process of the run's that must import what this one does: its
    sys.path as PYTHONPATH, and the run's own PYTHONPATH kept beside it (for `user_program_env`)."""
    paths = [os.path.abspath(p) if p else os.getcwd() for p in sys.path]
    return {"PYTHONPATH": os.pathsep.join(paths),
            USER_PYTHONPATH: os.environ.get(USER_PYTHONPATH, os.environ.get("PYTHONPATH", ""))}


def user_program_env() -> dict[str, str]:
    """This process's environment as a program of the user's gets it: PYTHONPATH as the run was started
    with (this process's own lists the run's Python's standard library, which another Python cannot import)."""
    env = dict(os.environ)
    started_with = env.pop(USER_PYTHONPATH, None)
    if started_with is not None:
        env.pop("PYTHONPATH", None)
        if started_with:
            env["PYTHONPATH"] = started_with
    return env


def user_ref(ref: str, what: str, known: dict) -> Any:
    """The object a user's `module:attr` names; LookupError fit for the user otherwise. Importing the
    module runs the user's code, so whatever that raises (SyntaxError, sys.exit, ...) becomes one too."""
    module_name, colon, attr = ref.partition(":")
    if not (colon and module_name and attr):
        names = f"one of: {', '.join(sorted(known))}, or " if known else ""
        raise LookupError(f"unknown {what} '{ref}'; expected {names}module:function (a colon between the module and "
                          "the name)")
    try:
        found = importlib.import_module(module_name)
    except (Exception, SystemExit) as exc:
        where = " (in the folder the run starts in, or a folder on PYTHONPATH)" if isinstance(exc, ModuleNotFoundError) else ""
        raise LookupError(f"cannot import module '{module_name}' of {what} '{ref}' ({type(exc).__name__}: {exc}); "
                          f"expected an importable module{where}") from None
    for part in attr.split("."):
        found = getattr(found, part, None)
        if found is None:
            raise LookupError(f"module '{module_name}' has no '{attr}' ({what} '{ref}')")
    return found


def registered_or_user(ref: str, what: str, registered: dict, attr: str, expected: type, decorator: str) -> Any:
    """A `registered` name, or a user's `module:function` whose decorator (`decorator`) set `attr` on it to
    an `expected`; LookupError fit for the user otherwise (a node kind, a tool)."""
    if ref in registered:
        return registered[ref]
    found = getattr(user_ref(ref, what, registered), attr, None)
    if not isinstance(found, expected):
        raise LookupError(f"'{ref}' is not a {what}; expected a function decorated with {decorator}")
    return found


def import_ref(ref: str) -> Any:
    """Import `module:attr` (a strategy's engine class, a weight-sync path, for instance)."""
    module_name, _, attr = ref.partition(":")
    return getattr(importlib.import_module(module_name), attr)
