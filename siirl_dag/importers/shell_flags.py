"""A program's `--flag value` arguments in a run script (slime's `train.py`, OpenRLHF's
`train_ppo_ray`), read without running anything, as a Source.

The words come from `shell_script.command_arguments` (variables, defaults given elsewhere, arrays
spliced in). A flag takes the words after it up to the next flag, as argparse does: none is `True`
(a switch), one its value, several a list (`nargs`); `--flag=value` is one word. Numbers are typed
as argparse's int and float read them, other values stay strings. A flag whose value only running
the script gives is kept as written and marked unresolved; so is an array the script does not set
(`${MODEL_ARGS[@]}` from a file it sources), under its own text: it is never a flag's value.
"""

from __future__ import annotations

import re
from pathlib import Path

from siirl_dag.importers.shell_script import command_arguments, default_remark
from siirl_dag.importers.shell_words import Unresolved
from siirl_dag.importers.source import Source

FLAG = re.compile(r"--?[A-Za-z][\w.-]*")
_INT = re.compile(r"[-+]?\d+")
_SPLICE = re.compile(r"\[[@*]\]\}")
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")


def read_flags(path: str | Path, entry: re.Pattern, not_rl: re.Pattern, expected: str) -> Source:
    """The flags of the script's first command naming `entry` (see `command_arguments`)."""
    arguments, defaults = command_arguments(path, entry, not_rl, expected)
    source = Source(str(path), {})
    flag = None  # the flag the next plain words belong to
    for argument in arguments:
        if isinstance(argument.values, Unresolved):
            whole_array = _SPLICE.search(argument.raw)  # ${ARGS[@]}: flags of their own, never one flag's value
            key = flag if flag is not None and source.keys[flag][0] is True and not whole_array else argument.raw
            source.keys[key] = (argument.raw, source.line(key) or argument.line)
            source.unresolved[key] = str(argument.values)
            flag = None
            continue
        for text in argument.values:
            if FLAG.fullmatch(text.partition("=")[0]) and not _FLOAT.fullmatch(text):
                name, eq, value = text.partition("=")
                source.keys[name] = (typed(value) if eq else True, argument.line)
                source.unresolved.pop(name, None)
                default_remark(source, name, argument, defaults)
                flag = None if eq else name
            elif flag is not None:
                value, line = source.keys[flag]
                value = typed(text) if value is True else (value if isinstance(value, list) else [value]) + [typed(text)]
                source.keys[flag] = (value, line)
                default_remark(source, flag, argument, defaults)
            elif text:
                source.keys[text] = (text, argument.line)
                source.drop(text, "a word that is no --flag (a positional argument)")
    source.raise_problems()
    return source


def typed(text: str):
    """A flag's value as argparse's int or float would read it; anything else as written."""
    if _INT.fullmatch(text):
        return int(text)
    if _FLOAT.fullmatch(text):
        return float(text)
    return text
