"""The bash a run script is written in, read as words and expanded, never run.

`commands(text)` splits a script into simple commands (lists of raw words with their lines):
continued lines, quotes and `$(...)` / `${...}` / `NAME=(...)` groups spanning lines, comments,
`;` `&&` `||` `|` separators, redirections and here-documents are understood. `expand(raw, env)`
removes quotes and substitutes `$X`, `${X}`, `${X:-default}` (the default itself expanded, nested
as deep as written), `${X:+alt}`, `${X,,}`, `${#X}`, `${ARR[@]}` / `${ARR[i]}` (a quoted array
expands to one word per element) and integer `$((...))` (parsed, never evaluated). What only
running the script would give (`$(cmd)`, backquotes, `$1`, `$@`, a variable the script does not
assign, a pattern operation) raises `Unresolved` naming it. No input text makes either raise
anything else. The environment is not read: a default is taken as written.
"""

from __future__ import annotations

import ast
import operator
import re
from dataclasses import dataclass

_NAME = re.compile(r"[A-Za-z_]\w*")
_PARAM = re.compile(r"(#?)([A-Za-z_]\w*|[0-9@*#?$!-])(?:\[([^\]]*)\])?(.*)", re.S)
def _div(a: int, b: int) -> int:  # bash truncates toward zero
    return abs(a) // abs(b) * (1 if (a < 0) == (b < 0) else -1)


_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: _div, ast.FloorDiv: _div,
          ast.Mod: lambda a, b: a - b * _div(a, b)}
MAX_ARITH = 400  # characters of one $((...)): longer is not a run script's arithmetic

class Unresolved(ValueError):
    """A value only running the script would give; `unassigned`: the variable the script does not
    assign, where that is why."""

    def __init__(self, message: str, unassigned: str | None = None):
        super().__init__(message)
        self.unassigned = unassigned


@dataclass
class Word:
    raw: str  # as written, quotes and all
    line: int


def group_end(s: str, i: int) -> int:
    """Index just past the quoted string or group opening at s[i] (', ", `, $(, ${, or '('); the
    end of the text when it is not closed. Iterative, so no nesting depth makes it fail."""
    stack: list[str] = []
    j = i
    while j < len(s):
        c, top = s[j], stack[-1] if stack else None
        if top == "'":
            j += 1
            if c == "'":
                stack.pop()
        elif c == "\\":
            j += 2
        elif top is not None and c == top:
            stack.pop()
            j += 1
        elif top in ('"', "`") and not s.startswith(("$(", "${"), j):
            j += 1
        elif top == ")" and c == "#" and s[j - 1] in " \t\n(":  # a comment in an array or $(...): its quotes are text
            end = s.find("\n", j)
            j = len(s) if end < 0 else end
        elif c in "'\"`":
            stack.append(c)
            j += 1
        elif s.startswith(("$(", "${"), j):
            stack.append(")" if s[j + 1] == "(" else "}")
            j += 2
        elif c == "(" and top != "}":
            stack.append(")")
            j += 1
        else:
            j += 1
        if not stack:
            return min(j, len(s))
    return len(s)


def commands(text: str) -> list[list[Word]]:
    """The script's simple commands, each a list of raw words (comments, redirections and
    here-documents left out)."""
    out: list[list[Word]] = []
    words: list[Word] = []
    cur: list[str] = []
    start, line, i, n = 0, 1, 0, len(text)
    skip_next, heredoc = False, None

    def flush_word() -> None:
        nonlocal cur, skip_next
        if cur:
            if not skip_next:
                words.append(Word("".join(cur), start))
            skip_next = False
        cur = []

    def flush_command() -> None:
        nonlocal words
        flush_word()
        if words:
            out.append(words)
        words = []

    while i < n:
        c = text[i]
        if c == "\n":
            flush_command()
            line += 1
            i += 1
            if heredoc is not None:  # skip the document, up to its delimiter line
                while i < n:
                    end = text.find("\n", i)
                    end = n if end < 0 else end
                    done = text[i:end].strip() == heredoc
                    line, i = line + 1, end + 1
                    if done:
                        break
                heredoc = None
            continue
        if not cur:
            start = line
        if c == "\\":
            if text[i + 1:i + 2] == "\n":  # a continued line
                flush_word()
                line += 1
            else:
                cur.append(text[i:i + 2])
            i += 2
        elif c in " \t\r":
            flush_word()
            i += 1
        elif c == "#" and not cur:
            end = text.find("\n", i)
            i = n if end < 0 else end
        elif c in "'\"`" or text.startswith(("$(", "${"), i) or (c == "(" and cur and cur[-1].endswith("=")):
            j = group_end(text, i)
            cur.append(text[i:j])
            line += text.count("\n", i, j)
            i = j
        elif c in ";&|()":
            flush_command()
            i += 1
        elif c in "<>":
            if cur and "".join(cur).isdigit():  # 2> : the descriptor, not a word
                cur = []
            op = re.match(r"<<<|<<-?|[<>]{1,2}&?-?|&>", text[i:]).group(0)  # a here-string is not a document
            i += len(op)
            if op.startswith("<<") and op != "<<<":
                m = re.match(r"\s*(['\"]?)([^\s'\"]+)\1", text[i:])
                heredoc = m.group(2) if m else ""
                i += m.end() if m else 0
            elif op.endswith("&") and re.match(r"\d+|-", text[i:]):  # >&2: a descriptor, not a file
                i += re.match(r"\d+|-", text[i:]).end()
            else:
                flush_word()
                skip_next = True  # the redirection's target
        else:
            cur.append(c)
            i += 1
    flush_command()
    return out


def expand(raw: str, env: dict) -> list[str]:
    """The words `raw` becomes once quotes are removed and expansions substituted."""
    words = [""]
    i = 0
    while i < len(raw):
        c = raw[i]
        if c == "\\":
            words[-1] += raw[i + 1:i + 2]
            i += 2
        elif c == "'":
            j = group_end(raw, i)
            words[-1] += raw[i + 1:j - 1 if j - 1 > i and raw[j - 1] == "'" else j]
            i = j
        elif c == '"':
            j = group_end(raw, i)
            _join(words, _expand_quoted(raw[i + 1:j - 1 if j - 1 > i and raw[j - 1] == '"' else j], env))
            i = j
        elif c == "`":
            raise Unresolved("a command substitution `...`, which is not run")
        elif c == "$":
            value, i = _dollar(raw, i, env)
            _join(words, value if isinstance(value, list) else value.split(" ") if value.strip() else [value])
        else:
            words[-1] += c
            i += 1
    return words


def expand_one(raw: str, env: dict) -> str:
    """`raw` expanded as one word (an assignment's value, a default): words joined by spaces."""
    return " ".join(expand(raw, env))


def _join(words: list[str], pieces: list[str]) -> None:
    """Append pieces to the word being built: the first continues it, each other starts a word."""
    if pieces:
        words[-1] += pieces[0]
        words.extend(pieces[1:])


def _expand_quoted(inner: str, env: dict) -> list[str]:
    """The inside of "...": expansions but no splitting (except "${ARR[@]}", one word per element)."""
    words = [""]
    i = 0
    while i < len(inner):
        c = inner[i]
        if c == "\\" and inner[i + 1:i + 2] in ("$", "`", '"', "\\"):
            words[-1] += inner[i + 1]
            i += 2
        elif c == "`":
            raise Unresolved("a command substitution `...`, which is not run")
        elif c == "$":
            value, i = _dollar(inner, i, env)
            _join(words, value if isinstance(value, list) else [value])
        else:
            words[-1] += c
            i += 1
    return words


def _dollar(s: str, i: int, env: dict) -> tuple[str | list[str], int]:
    """The expansion starting at s[i] == '$', and the index after it."""
    if s.startswith("$((", i):
        j = group_end(s, i)
        if s[j - 2:j] == "))" and j - 2 >= i + 3:
            return str(arithmetic(s[i + 3:j - 2], env)), j
        raise Unresolved(f"a command substitution {_short(s[i:j])}, which is not run")
    if s.startswith("$(", i):
        raise Unresolved(f"a command substitution {_short(s[i:group_end(s, i)])}, which is not run")
    if s.startswith("${", i):
        j = group_end(s, i)
        if s[j - 1:j] != "}":
            raise Unresolved(f"{_short(s[i:j])} is not closed")
        return _parameter(s[i + 2:j - 1], env), j
    m = _NAME.match(s, i + 1)
    if m:
        return _scalar(m.group(0), env), m.end()
    if s[i + 1:i + 2] and s[i + 1] in "0123456789@*#?$!-":
        raise Unresolved(f"${s[i + 1]} is the script's arguments or the shell's state, not known before it runs")
    return "$", i + 1


def _short(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def _lookup(name: str, env: dict):
    value = env.get(name)
    if isinstance(value, Unresolved):
        raise value
    return value


def _scalar(name: str, env: dict) -> str:
    value = _lookup(name, env)
    if value is None:
        raise Unresolved(f"${name} is not assigned in the script", name)
    return value[0] if isinstance(value, list) and value else "" if isinstance(value, list) else value


def _parameter(body: str, env: dict) -> str | list[str]:
    """${body}: the forms a run script uses; any other raises Unresolved naming it."""
    m = _PARAM.fullmatch(body)
    if not m:
        raise Unresolved(f"${{{_short(body)}}} is not a parameter expansion this reader knows")
    length, name, index, op = m.groups()
    if not _NAME.fullmatch(name):
        raise Unresolved(f"${{{_short(body)}}} reads the script's arguments or the shell's state, not known before it runs")
    value = _lookup(name, env)
    if index is not None and value is not None:
        items = value if isinstance(value, list) else [value]
        if index in ("@", "*"):
            value = items if index == "@" else " ".join(items)
        elif index.strip().isdigit():
            value = items[int(index)] if int(index) < len(items) else ""
        else:
            raise Unresolved(f"${{{_short(body)}}}: the index {index!r} is not a number")
    if length:
        if op or value is None:
            raise Unresolved(f"${{{_short(body)}}} is not a length this reader can tell")
        return str(len(value))
    empty = value is None or value == "" or value == []
    for form, when in ((":-", empty), ("-", value is None), (":=", empty), ("=", value is None)):
        if op.startswith(form):
            if not when:
                return value
            default = expand_one(op[len(form):], env)
            if "=" in form:
                env[name] = default
            return default
    for form, when in ((":+", not empty), ("+", value is not None)):
        if op.startswith(form):
            return expand_one(op[len(form):], env) if when else ""
    if op.startswith((":?", "?")) and not empty:
        return value
    if value is None:
        raise Unresolved(f"${name} is not assigned in the script", name)
    if op in (",,", "^^", ",", "^"):
        case = str.lower if op[0] == "," else str.upper
        text = value if isinstance(value, str) else " ".join(value)
        return case(text) if len(op) == 2 else case(text[:1]) + text[1:]
    if op:
        raise Unresolved(f"${{{_short(body)}}}: the operation {op[:2]!r} is not evaluated here")
    return value


def arithmetic(text: str, env: dict) -> int:
    """Shell integer arithmetic (+ - * / %, parentheses, variables), parsed with `ast`, never evaluated."""
    if len(text) > MAX_ARITH:
        raise Unresolved("$((...)) is longer than a run script's arithmetic")
    code = re.sub(r"\$\{?([A-Za-z_]\w*)\}?", r"\1", text).strip()
    try:
        tree = ast.parse(code, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        raise Unresolved(f"$(({_short(text)})) is not integer arithmetic") from None

    def value(node, depth: int = 0) -> int:
        if depth > 50:
            raise Unresolved(f"$(({_short(text)})) nests too deep")
        if isinstance(node, ast.Constant) and type(node.value) is int:
            return node.value
        if isinstance(node, ast.Name):
            raw = _scalar(node.id, env)
            if not re.fullmatch(r"\s*-?\d+\s*", raw):
                raise Unresolved(f"${node.id} is {raw!r}, not an integer")
            return int(raw)
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = value(node.operand, depth + 1)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
            left, right = value(node.left, depth + 1), value(node.right, depth + 1)
            if right == 0 and type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod):
                raise Unresolved(f"$(({_short(text)})) divides by zero")
            if abs(left) > 1 << 62 or abs(right) > 1 << 62:
                raise Unresolved(f"$(({_short(text)})) is out of a shell integer's range")
            return int(_ARITH[type(node.op)](left, right))
        raise Unresolved(f"$(({_short(text)})) is not integer arithmetic")

    return value(tree)
