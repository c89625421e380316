"""The shell reader's structure (commands, words, their lines) against tree-sitter-bash's, on the same scripts.

    python scripts/bench_shell_reader.py [--json] [--repeat N] [EXTRA_DIR_OR_SCRIPT ...]

Reads every .sh under tests/fixtures and under the paths given (the peers' checkouts, say), with
`importers.shell_words.commands` and with tree-sitter-bash walked into the same shape: each simple
command as its raw words with their lines (assignments whole, redirections and here-documents left
out). Per script: whether the two agree, tree-sitter's own parse errors, and the time of each (best of
N). Where they differ the first difference is printed, to be judged by reading the script.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from siirl_dag.importers.shell_words import commands  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOT_COMMANDS = {"command_substitution", "process_substitution", "arithmetic_expansion", "c_style_for_statement"}
HEADS = {"for_statement", "select_statement", "case_statement"}  # their words are no command (ours leaves them out too)
SKIP = {"file_redirect", "heredoc_redirect", "herestring_redirect", "comment"}
WORDS = {"word", "string", "raw_string", "concatenation", "simple_expansion", "expansion", "command_substitution",
         "arithmetic_expansion", "number", "ansi_c_string", "translated_string", "process_substitution"}


KEYWORDS = {"if", "then", "else", "elif", "fi", "do", "done", "while", "until", "!", "{", "}", "time", "esac"}
LOOPS = {"for", "select", "case", "function"}  # a loop's or a function's head: its words are not a command


def ours(text: str) -> list[list[tuple[str, int]]]:
    """Simple commands as the importers read them: compound keywords before a command left out."""
    out = []
    for command in commands(text):
        words = [(w.raw, w.line) for w in command]
        while words and words[0][0] in KEYWORDS:
            words = words[1:]
        if words and words[0][0] not in LOOPS and not (len(words) == 1 and words[0][0] in (";;", "in")):
            out.append(words)
    return out


def tree_sitter_reader():
    """A function reading text into the same shape with tree-sitter-bash, or None where it is not installed."""
    try:
        import tree_sitter_bash
        from tree_sitter import Language, Parser
    except ImportError:
        return None
    parser = Parser(Language(tree_sitter_bash.language()))

    def words_of(node, out: list) -> None:
        for child in node.children:
            if child.type in SKIP:
                continue
            if child.type in WORDS or child.type == "variable_assignment" or not child.is_named and child.type not in (
                    "(", ")"):  # keywords and test operators are words too
                out.append((child.text.decode(), child.start_point[0] + 1))
            elif child.type in ("test_operator", "variable_name") or (child.type == "regex"):
                out.append((child.text.decode(), child.start_point[0] + 1))
            elif child.type in ("command_name", "unary_expression", "binary_expression", "parenthesized_expression"):
                words_of(child, out)

    def read(text: str):
        tree = parser.parse(text.encode())
        found: list[list[tuple[str, int]]] = []

        def walk(node) -> None:
            if node.type in ("command", "declaration_command", "test_command", "variable_assignment", "unset_command",
                             "negated_command"):
                words: list = []
                if node.type == "variable_assignment":
                    words = [(node.text.decode(), node.start_point[0] + 1)]
                else:
                    words_of(node, words)
                if words:
                    found.append(words)
                if node.type == "command":  # $(...) inside a word holds commands too, read as words here
                    return
                return
            if node.type == "function_definition":  # `name() {`: ours reads the name as a command of its own
                found.append([(node.child_by_field_name("name").text.decode(), node.start_point[0] + 1)])
            for child in node.children:
                if child.type not in NOT_COMMANDS and not (node.type in HEADS and child.type != "do_group"):
                    walk(child)

        walk(tree.root_node)
        return found, tree.root_node.has_error

    return read


def best_time(fn, text: str, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn(text)
        best = min(best, time.perf_counter() - t0)
    return best


def first_difference(a: list, b: list) -> str:
    flat_a = [(w, line) for command in a for w, line in command]
    flat_b = [(w, line) for command in b for w, line in command]
    for i, (x, y) in enumerate(zip(flat_a, flat_b)):
        if x != y:
            return f"word {i}: ours {x!r} / tree-sitter {y!r}"
    if len(flat_a) != len(flat_b):
        return f"ours {len(flat_a)} words / tree-sitter {len(flat_b)}"
    return f"the same words, split into commands differently ({len(a)} / {len(b)} commands)"


def scripts(extra: list[str]) -> list[Path]:
    found = sorted((ROOT / "tests" / "fixtures").rglob("*.sh"))
    for item in map(Path, extra):
        found += sorted(item.rglob("*.sh")) if item.is_dir() else [item]
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", help="more scripts, or folders to search for .sh files")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    ts = tree_sitter_reader()
    rows = []
    for path in scripts(args.paths):
        text = path.read_text(encoding="utf-8", errors="replace")
        mine = ours(text)
        row = {"script": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
               "lines": text.count("\n") + 1, "commands": len(mine), "ours_ms": 1e3 * best_time(ours, text, args.repeat)}
        if ts is not None:
            theirs, error = ts(text)
            row |= {"tree_sitter_ms": 1e3 * best_time(ts, text, args.repeat), "tree_sitter_error": error,
                    "agree": mine == theirs, "difference": None if mine == theirs else first_difference(mine, theirs)}
        rows.append(row)
    total = {"scripts": len(rows), "lines": sum(r["lines"] for r in rows),
             "ours_ms": round(sum(r["ours_ms"] for r in rows), 2)}
    if ts is not None:
        total |= {"tree_sitter_ms": round(sum(r["tree_sitter_ms"] for r in rows), 2),
                  "agree": sum(r["agree"] for r in rows), "tree_sitter_errors": sum(r["tree_sitter_error"] for r in rows)}
    if args.json:
        print(json.dumps({"total": total, "scripts": rows}, indent=2))
        return 0
    for r in rows:
        if ts is None or not r["agree"] or r["tree_sitter_error"]:
            print(f"{r['script']}: {r.get('difference') or ''}{' (tree-sitter: parse error)' if r.get('tree_sitter_error') else ''}")
    print(json.dumps(total))
    return 0


if __name__ == "__main__":
    sys.exit(main())
