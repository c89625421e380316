"""The Hydra overrides of a run script (siiRL, verl), read without running anything.

A script such as siiRL's `run_qwen3-8b-megatron.sh` sets variables (`export TP=2`,
`N=${N:-8}`, `B=$((A * N))`, `ARGS=(a=1 b=2)`) and then passes `key=value` arguments to `python3
-m siirl.main_dag` / `verl.trainer.main_ppo` (or a recipe's entry point), on continued lines or
from a bash array. The script is read as bash words (`shell_words`), in order; the first training
command's overrides become a `Source`, each argument with its line and typed as Hydra types it
(`off` stays a string). A variable the script does not assign but gives one default elsewhere
(`${N:-8}` in an echo, say) takes that default, and the key says so. A value only running the
script would give (`$(date)`, `$1`, a variable with no default) is not guessed: the key is kept as
written and marked unresolved, so the importer lists it or uses the engine's default, and says which.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from siirl_dag.config.yaml_loader import LimitedLoader, read_input
from siirl_dag.errors import ConfigError, Problem
from siirl_dag.importers.shell_words import Unresolved, Word, commands, expand, expand_one
from siirl_dag.importers.source import Source

ENTRY_POINTS = re.compile(r"(siirl\.main_dag|\bmain_(?:dag|ppo|dapo|grpo|spin|prime|\w*ppo)\b|fully_async_main|"
                          r"one_step_off_policy\.main\w*)")
NOT_RL = re.compile(r"\b(main_generation\w*|main_eval|\w*sft_trainer|main_sft)\b")
_ASSIGN = re.compile(r"([A-Za-z_]\w*)(\+?)=(.*)", re.S)
_ARRAY_USE = re.compile(r'"?\$\{([A-Za-z_]\w*)\[[@*]\]\}"?')
_KEYWORDS = {"then", "else", "do", "{", "}", "!", "time", "nohup", "exec", "if", "elif", "while", "until"}
_DECLARE = {"export", "declare", "local", "readonly", "typeset"}
_HYDRA_STRINGS = {"on", "off", "yes", "no", "y", "n"}  # YAML 1.1 booleans that Hydra reads as strings
_DEFAULT = re.compile(r"\$\{([A-Za-z_]\w*):?[-=]([^{}$`]*)\}")  # ${X:-d}, ${X:=d} with a literal default


def read_script(path: str | Path) -> Source:
    """The overrides that the script's training command passes, as a Source (keys dotted)."""
    path = str(path)
    text = read_input(path, "a readable shell script")  # a regular file of bounded size: a FIFO is never read
    env: dict = {}
    arrays: dict[str, list[tuple[list[str] | Unresolved, str, int]]] = {}
    for words in commands(text):
        while words and words[0].raw in _KEYWORDS:
            words = words[1:]
        entry = _entry(words, env)
        if entry is not None:
            source, twice = Source(path, {}), False
            m = _ASSIGN.fullmatch(words[entry].raw)
            if m and m.group(3).startswith("(") and m.group(3).endswith(")"):  # CMD=(python3 -m ... k=v): run by eval
                inner = [Word(w.raw, words[entry].line + w.line - 1) for c in commands(m.group(3)[1:-1]) for w in c]
                words, entry, twice = inner, _entry(inner, env) or 0, True
            _arguments(words[entry + 1:], env, arrays, source, twice, _defaults(text))
            source.raise_problems()
            return source.resolve()
        _assignments(words, env, arrays)
    refused = NOT_RL.search(text)
    if refused:
        raise ConfigError(Problem((), f"this script runs {refused.group(1)}, which is not RL training; expected a script "
                                      "running `python3 -m verl.trainer.main_ppo` or `siirl.main_dag`", file=path, line=1))
    raise ConfigError(Problem((), "no training command found; expected a line running `python3 -m siirl.main_dag` or "
                                  "`verl.trainer.main_ppo` with key=value arguments", file=path, line=1))


def _entry(words: list[Word], env: dict) -> int | None:
    """Index of the word naming the training entry point (as written, or once expanded)."""
    for i, word in enumerate(words):
        if ENTRY_POINTS.search(word.raw):
            return i
        if "$" in word.raw:
            try:
                if ENTRY_POINTS.search(expand_one(word.raw, env)):
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
    """The variables the script gives one literal default somewhere (`${X:-d}`, `${X:=d}`, in any
    command): what its author means by a plain `$X` the script does not assign."""
    found: dict[str, set[str]] = {}
    for m in _DEFAULT.finditer(text):
        found.setdefault(m.group(1), set()).add(m.group(2))
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
            env = env | {exc.unassigned: expand_one(defaults[exc.unassigned], {})}


def _arguments(words: list[Word], env: dict, arrays: dict, source: Source, twice: bool = False,
               defaults: dict | None = None) -> None:
    """Each argument after the entry point as a key of `source` (arrays spliced in, element by element);
    `twice`: the words of a command kept in an array and run by `eval`, so expanded again (`\\$X`);
    `defaults`: `_defaults`, for the variables the script does not assign."""
    items: list[tuple[list[str] | Unresolved, str, int, list[str]]] = []
    for word in words:
        use = _ARRAY_USE.fullmatch(word.raw)
        if use and use.group(1) in arrays:
            items += [(*item, []) for item in arrays[use.group(1)]]
            continue
        try:
            values, used = _expanded(word.raw, env, twice, defaults or {})
            items.append((values, word.raw, word.line, used))
        except Unresolved as exc:
            items.append((exc, word.raw, word.line, []))
    pending_option = None
    for values, raw, line, used in items:
        if isinstance(values, Unresolved):
            _unresolved(raw, line, values, source)
            continue
        for text in values:
            if pending_option is not None:
                source.keys[pending_option] = (text, line)
                pending_option = None
            elif text in ("--config-name", "--config-path", "-cn", "-cp"):
                pending_option = "--config-name" if text in ("--config-name", "-cn") else "--config-path"
            elif text:
                _argument(text, line, source)
                if used:
                    source.remark(text.lstrip("+").partition("=")[0], f"{', '.join('$' + n for n in used)} is not "
                                  f"assigned in the script; the default it gives elsewhere is used "
                                  f"({', '.join(n + '=' + defaults[n] for n in used)})")


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
