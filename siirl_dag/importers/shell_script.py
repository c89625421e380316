"""The Hydra overrides of a run script (siiRL, verl), read without running anything.

A script such as siiRL's `run_qwen3-8b-megatron.sh` sets variables (`export TP=2`,
`N=${N:-8}`, `B=$((A * N))`, `ARGS=(a=1 b=2)`) and then passes `key=value` arguments to `python3
-m siirl.main_dag` / `verl.trainer.main_ppo` (or a recipe's entry point), on continued lines or
from a bash array. The script is read as bash words (`shell_words`), in order; the first training
command's overrides become a `Source`, each argument with its line and typed as Hydra types it
(`off` stays a string). `: ${N:=8}` (or `:=` in any command) assigns, as in bash; a variable the
script does not assign but gives one default elsewhere (`${N:-8}` in an echo, or `${N:-$BASE}` after
the command, expanded with what the script assigns) takes that default, and the key says so.
`command_arguments` gives the expanded words of any program's command line (slime's and OpenRLHF's
`--flag value` arguments are read from it by `shell_flags`). A value only running the
script would give (`$(date)`, `$1`, a variable with no default) is not guessed: the key is kept as
written and marked unresolved, so the importer lists it or uses the engine's default, and says which.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from siirl_dag.config.yaml_loader import LimitedLoader, read_input
from siirl_dag.errors import ConfigError, Problem
from siirl_dag.importers.shell_words import Unresolved, Word, commands, expand, expand_one, group_end
from siirl_dag.importers.source import Source

ENTRY_POINTS = re.compile(r"(siirl\.main_dag|\bmain_(?:dag|ppo|dapo|grpo|spin|prime|\w*ppo)\b|fully_async_main|"
                          r"one_step_off_policy\.main\w*)")
NOT_RL = re.compile(r"\b(main_generation\w*|main_eval|\w*sft_trainer|main_sft)\b")
_ASSIGN = re.compile(r"([A-Za-z_]\w*)(\+?)=(.*)", re.S)
_ARRAY_USE = re.compile(r'"?\$\{([A-Za-z_]\w*)\[[@*]\]\}"?')
_KEYWORDS = {"then", "else", "do", "{", "}", "!", "time", "nohup", "exec", "if", "elif", "while", "until"}
_DECLARE = {"export", "declare", "local", "readonly", "typeset"}
_HYDRA_STRINGS = {"on", "off", "yes", "no", "y", "n"}  # YAML 1.1 booleans that Hydra reads as strings
_DEFAULT = re.compile(r"\$\{([A-Za-z_]\w*):?[-=]")  # the head of ${X:-d}, ${X:=d}, ${X-d}, ${X=d}


def read_script(path: str | Path) -> Source:
    """The overrides that the script's training command passes, as a Source (keys dotted)."""
    arguments, defaults = command_arguments(path, ENTRY_POINTS, NOT_RL, "`python3 -m verl.trainer.main_ppo` or "
                                            "`siirl.main_dag` with key=value arguments")
    source = Source(str(path), {})
    _overrides(arguments, source, defaults)
    source.raise_problems()
    return source.resolve()


@dataclass
class Argument:
    """One word after the entry point, expanded: its values (or why they are not known), as written, its
    line, and the variables the script does not assign whose default given elsewhere it took."""

    values: list[str] | Unresolved
    raw: str
    line: int
    used: list[str] = field(default_factory=list)


def command_arguments(path: str | Path, entry: re.Pattern, not_rl: re.Pattern,
                      expected: str) -> tuple[list[Argument], dict[str, str]]:
    """The expanded arguments of the script's first command naming `entry` (arrays spliced in, element by
    element), and the defaults the script gives elsewhere; a script without one is refused, naming the
    program it runs where `not_rl` finds one, else saying `expected`."""
    path = str(path)
    text = read_input(path, "a readable shell script")  # a regular file of bounded size: a FIFO is never read
    env: dict = {}
    arrays: dict[str, list[tuple[list[str] | Unresolved, str, int]]] = {}
    for words in commands(text):
        while words and words[0].raw in _KEYWORDS:
            words = words[1:]
        found = _entry(words, env, entry)  # expanding words also assigns ${X:=d}, as bash does
        if found is not None:
            twice = False
            m = _ASSIGN.fullmatch(words[found].raw)
            if m and m.group(3).startswith("(") and m.group(3).endswith(")"):  # CMD=(python3 -m ... k=v): run by eval
                inner = [Word(w.raw, words[found].line + w.line - 1) for c in commands(m.group(3)[1:-1]) for w in c]
                words, found, twice = inner, _entry(inner, env, entry) or 0, True
            defaults = _defaults(text)
            return _arguments(words[found + 1:], env, arrays, twice, defaults), defaults
        _assignments(words, env, arrays)
    refused = not_rl.search(text)
    if refused:
        raise ConfigError(Problem((), f"this script runs {refused.group(1)}, which is not RL training; expected a script "
                                      f"running {expected}", file=path, line=1))
    raise ConfigError(Problem((), f"no training command found; expected a line running {expected}", file=path, line=1))


def default_remark(source: Source, key: str, argument: Argument, defaults: dict[str, str]) -> None:
    """Say that `key` took the default its variables are given elsewhere (they are not assigned)."""
    if argument.used:
        source.remark(key, f"{', '.join('$' + n for n in argument.used)} is not assigned in the script; the default it "
                           f"gives elsewhere is used ({', '.join(n + '=' + defaults[n] for n in argument.used)})")


def _entry(words: list[Word], env: dict, entry: re.Pattern) -> int | None:
    """Index of the word naming the training entry point (as written, or once expanded)."""
    for i, word in enumerate(words):
        if entry.search(word.raw):
            return i
        if "$" in word.raw:
            try:
                if entry.search(expand_one(word.raw, env)):
                    return i
            except Unresolved:
                pass
    return None


def _assignments(words: list[Word], env: dict, arrays: dict) -> None:
    """`[export] A=1 B=(x y)` sets variables in order; `A=1 cmd` (an environment for one command) does not."""
    declared = bool(words) and words[0].raw in _DECLARE
    if declared:
        words = [w for w in words[1:] if not w.raw.startswith("-")]
    matches = [_ASSIGN.fullmatch(w.raw) for w in words]
    if not words or not all(matches) or (not declared and len(words) != len(matches)):
        return
    for word, m in zip(words, matches):
        name, append, value = m.groups()
        if value.startswith("(") and value.endswith(")"):
            elements = _array(value[1:-1], word.line, env)
            arrays[name] = (arrays.get(name, []) if append else []) + elements
            env[name] = [w for values, _, _ in arrays[name] if isinstance(values, list) for w in values]
            continue
        try:
            new = expand_one(value, env)
            env[name] = (env.get(name, "") if append and isinstance(env.get(name), str) else "") + new
        except Unresolved as exc:
            env[name] = exc
        arrays.pop(name, None)


def _array(inner: str, first_line: int, env: dict) -> list[tuple[list[str] | Unresolved, str, int]]:
    """A bash array's elements, each expanded now (as bash does) with its raw text and line."""
    out = []
    for command in commands(inner):
        for word in command:
            try:
                out.append((expand(word.raw, env), word.raw, first_line + word.line - 1))
            except Unresolved as exc:
                out.append((exc, word.raw, first_line + word.line - 1))
    return out


def _defaults(text: str) -> dict[str, str]:
    """The variables the script gives one default somewhere (`${X:-d}`, `${X:=d}`, in any command, `d`
    as written, expanded where it is used): what its author means by a `$X` the script does not assign."""
    found: dict[str, set[str]] = {}
    for m in _DEFAULT.finditer(text):
        end = group_end(text, m.start())
        if text[end - 1:end] == "}":
            found.setdefault(m.group(1), set()).add(text[m.end():end - 1])
    return {name: next(iter(values)) for name, values in found.items() if len(values) == 1}


def _expanded(raw: str, env: dict, twice: bool, defaults: dict) -> tuple[list[str], list[str]]:
    """A word's values, and the unassigned variables it took the script's default of."""
    used: list[str] = []
    while True:
        try:
            values = expand(raw, env)
            return ([w for v in values for w in expand(v, env)] if twice else values), used
        except Unresolved as exc:
            if exc.unassigned not in defaults or exc.unassigned in used:
                raise
            used.append(exc.unassigned)
            env = env | {exc.unassigned: expand_one(defaults[exc.unassigned], env)}


def _arguments(words: list[Word], env: dict, arrays: dict, twice: bool, defaults: dict) -> list[Argument]:
    """Each word after the entry point expanded, arrays spliced in element by element; `twice`: the words
    of a command kept in an array and run by `eval`, so expanded again (`\\$X`); `defaults`: `_defaults`,
    for the variables the script does not assign."""
    out: list[Argument] = []
    for word in words:
        use = _ARRAY_USE.fullmatch(word.raw)
        if use and use.group(1) in arrays:
            out += [Argument(*item) for item in arrays[use.group(1)]]
            continue
        try:
            values, used = _expanded(word.raw, env, twice, defaults)
            out.append(Argument(values, word.raw, word.line, used))
        except Unresolved as exc:
            out.append(Argument(exc, word.raw, word.line))
    return out


def _overrides(arguments: list[Argument], source: Source, defaults: dict) -> None:
    """Hydra's `key=value` overrides (and its --config-name / --config-path options) as keys of `source`."""
    pending_option = None
    for argument in arguments:
        if isinstance(argument.values, Unresolved):
            _unresolved(argument.raw, argument.line, argument.values, source)
            continue
        for text in argument.values:
            if pending_option is not None:
                source.keys[pending_option] = (text, argument.line)
                pending_option = None
            elif text in ("--config-name", "--config-path", "-cn", "-cp"):
                pending_option = "--config-name" if text in ("--config-name", "-cn") else "--config-path"
            elif text:
                _argument(text, argument.line, source)
                default_remark(source, text.lstrip("+").partition("=")[0], argument, defaults)


def _unresolved(raw: str, line: int, why: Unresolved, source: Source) -> None:
    """A word whose value only running the script gives: kept as written, marked unresolved."""
    if raw.strip('"') in ("$@", "${@}", "$*", "${*}"):
        source.keys[raw.strip('"')] = (raw, line)
        source.drop(raw.strip('"'), "arguments passed to the script itself; pass them to this engine as overrides")
        return
    key, eq, value = raw.strip("'\"").lstrip("+").partition("=")
    if not eq or not re.fullmatch(r"[\w.@/-]+", key):
        key, value = raw, raw
    source.keys[key] = (value, line)
    source.unresolved[key] = str(why)


def _argument(word: str, line: int, source: Source) -> None:
    if word.startswith("--config-name=") or word.startswith("--config-path="):
        option, _, value = word.partition("=")
        source.keys[option] = (value, line)
        return
    key, eq, raw = word.lstrip("+").partition("=")
    if not eq or word.startswith(("-", "~")):
        source.keys[word] = (word, line)
        source.drop(word, "a Hydra option, not a key=value override" if word.startswith("-") else "a key removal")
        return
    source.keys[key] = (hydra_value(raw), line)


def hydra_value(text: str):
    """A Hydra override's value, typed as Hydra types it (1e-6 a float, [a,b] a list, off a string)."""
    if not text or text.strip().lower() in _HYDRA_STRINGS:
        return text
    try:
        return yaml.load(text, Loader=LimitedLoader)
    except (yaml.YAMLError, ValueError, RecursionError):
        return text
