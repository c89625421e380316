"""The Hydra overrides of a run script (siiRL, verl), read without running anything.

A script such as siiRL's `run_qwen3-8b-megatron.sh` sets variables (`export TP=2`,
`N=${N:-8}`, `B=$((A * N))`) and then passes `key=value` arguments to `python3 -m
siirl.main_dag` / `verl.trainer.main_ppo`, on continued lines or in a bash array. We read plain
assignments, expand `$X`, `${X}`, `${X:-default}` and integer `$((...))` from them (parsed, never
evaluated; the environment is not read: a default is taken as written), and return the command's
overrides as a `Source` with each argument's line. Command substitutions (`$(date)`) are not run:
what depends on them is left as written and reported.
"""

from __future__ import annotations

import ast
import operator
import re
import shlex
from pathlib import Path

import yaml

from siirl_dag.config.yaml_loader import LimitedLoader
from siirl_dag.errors import ConfigError, Problem
from siirl_dag.importers.source import Source

ENTRY_POINTS = re.compile(r"(siirl\.main_dag|verl\.trainer\.main_\w+|main_ppo|main_dag)\b")
_ASSIGN = re.compile(r"^(?:export\s+)?([A-Za-z_]\w*)=(.*)$")
_EXPANSION = re.compile(r"\\?\$(?:\(\((?P<arith>.*?)\)\)|\{(?P<name>[A-Za-z_]\w*)(?::?[-=](?P<default>[^}]*))?\}|(?P<bare>[A-Za-z_]\w*))")
_SUBSTITUTION = re.compile(r"\$\((?:[^()]|\((?:[^()]|\([^()]*\))*\))*\)")  # $(...) and $((...)), one word to the shell
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.floordiv,
          ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod}


class Unresolved(ValueError):
    """A variable the script does not assign, or a value only running it would give."""


def _arith(text: str, env: dict[str, str | Unresolved]) -> int:
    """Shell integer arithmetic (+ - * / %, parentheses, variables), parsed with `ast`, never evaluated."""
    text = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", r"\1", text)
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except SyntaxError:
        raise Unresolved(f"$(({text})) is not integer arithmetic") from None

    def value(node) -> int:
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            raw = _lookup(node.id, env)
            if not re.fullmatch(r"\s*-?\d+\s*", raw):
                raise Unresolved(f"${node.id} is {raw!r}, not an integer")
            return int(raw)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
            return -value(node.operand)
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            right = value(node.right)
            if right == 0 and type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod):
                raise Unresolved(f"$(({text})) divides by zero")
            return _ARITH[type(node.op)](value(node.left), right)
        raise Unresolved(f"$(({text})) is not integer arithmetic")

    return value(tree)


def _lookup(name: str, env: dict[str, str | Unresolved]) -> str:
    value = env.get(name, Unresolved(f"${name} is not assigned in the script"))
    if isinstance(value, Unresolved):
        raise value
    return value


def expand(text: str, env: dict[str, str | Unresolved]) -> str:
    """`text` with the script's variables substituted; raises Unresolved for what cannot be."""
    if "$(" in text.replace("$((", ""):
        raise Unresolved("a command substitution $(...), which is not run")

    def one(m: re.Match) -> str:
        if m.group("arith") is not None:
            return str(_arith(m.group("arith"), env))
        name = m.group("name") or m.group("bare")
        if name not in env and m.group("default") is not None:
            return " ".join(shlex.split(m.group("default")))
        return _lookup(name, env)

    return _EXPANSION.sub(one, text)


def _words(text: str, posix: bool = True) -> list[str]:
    """Shell words of a line; spaces inside $(...) and $((...)) do not split a word."""
    protected = _SUBSTITUTION.sub(lambda m: m.group(0).replace(" ", "\0"), text)
    return [w.replace("\0", " ") for w in shlex.split(protected, comments=True, posix=posix)]


def _assignment(line: str, env: dict[str, str | Unresolved]) -> None:
    """A plain `[export] NAME=value` line, expanded now as the shell does; anything else is skipped."""
    m = _ASSIGN.match(line)
    if not m or m.group(2).startswith("("):
        return
    name, rest = m.groups()
    try:
        words = _words(rest, posix=False)
    except ValueError:
        return
    if len(words) > 1:  # `A=b cmd` runs a command: not a plain assignment
        return
    word = words[0] if words else ""
    if word[:1] == word[-1:] == "'" and len(word) > 1:
        env[name] = word[1:-1]  # single quotes: taken literally
        return
    try:
        env[name] = expand(word[1:-1] if word[:1] == word[-1:] == '"' and len(word) > 1 else word, env)
    except Unresolved as exc:
        env[name] = exc


def _command_lines(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, text) of the training command: a continued command line or a bash array."""
    for i, line in enumerate(lines):
        code = line.split("#", 1)[0] if not line.lstrip().startswith("#") else ""
        if not ENTRY_POINTS.search(code):
            continue
        out, j = [], i
        in_array = i > 0 and bool(re.match(r"^\s*(?:export\s+)?[A-Za-z_]\w*=\($", lines[i - 1].split("#", 1)[0].rstrip()))
        while j < len(lines):
            text = lines[j].rstrip()
            if in_array and text.strip() == ")":
                break
            out.append((j + 1, text.removesuffix("\\")))
            if not in_array and not text.endswith("\\"):
                break
            j += 1
        return out
    return []


def read_script(path: str | Path) -> Source:
    """The overrides that the script's training command passes, as a Source (keys dotted)."""
    path = str(path)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(Problem((), f"cannot read the run script ({exc}); expected a readable shell script", file=path)) from None
    command = _command_lines(lines)
    if not command:
        raise ConfigError(Problem((), "no training command found; expected a line running `python3 -m siirl.main_dag` or "
                                      "`verl.trainer.main_ppo` with key=value arguments", file=path, line=1))
    env: dict[str, str | Unresolved] = {}
    for line in lines[: command[0][0] - 1]:
        _assignment(line.strip(), env)
    source = Source(path, {})
    started = False
    for number, text in command:
        try:
            words = _words(text)
        except ValueError as exc:
            source.problems.append(Problem((), f"cannot split the arguments ({exc}); expected shell words", file=path, line=number))
            continue
        for word in words:
            if not started:
                started = bool(ENTRY_POINTS.search(word))
                continue
            _argument(word, number, env, source)
    source.raise_problems()
    return source


def _argument(word: str, number: int, env: dict[str, str | Unresolved], source: Source) -> None:
    if word in ("$@", "${@}") or word.startswith("${") and word.endswith("[@]}"):
        source.keys[word] = (word, number)
        source.drop(word, "arguments passed to the script itself; pass them to this engine as overrides")
        return
    key, eq, raw = word.lstrip("+").partition("=")
    if not eq or word.startswith(("-", "~")):
        source.keys[word] = (word, number)
        source.drop(word, "a Hydra option, not a key=value override" if word.startswith("-") else "a key removal")
        return
    try:
        text = expand(raw, env)
    except Unresolved as exc:
        source.keys[key] = (raw, number)
        source.drop(key, str(exc))
        return
    try:
        value = yaml.load(text, Loader=LimitedLoader) if text else ""  # typed as overrides are (1e-6 a float)
    except yaml.YAMLError:
        value = text
    source.keys[key] = (value, number)
