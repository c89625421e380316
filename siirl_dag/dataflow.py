"""What each node reads, and from whom, decided once at load.

- The producer of every key a node consumes: its binding in `inputs` (KEY: NODE.KEY), else the first
  of its `from` nodes holding the key, else the latest upstream node holding it, else the data loader
  (`SOURCE`). A node that expands rows
  (n samples per prompt) holds its inputs too, re-emitted in its own row space.
- The rows per prompt each node sees: the producers of its inputs must agree (rows stay aligned
  across branches and agents), and an expanding node multiplies them by its n.
- The policy each node serves: a pipeline that trains several policies prefixes each node's
  metrics with it (`<policy>/actor/pg_loss`); with one, verl's names stay as they are.

The runtime follows the same decisions (`reads`, kept as `Pipeline.reads`), so what `validate`
accepts is what a step reads.
"""

from __future__ import annotations

import networkx as nx

from siirl_dag.errors import Problem
from siirl_dag.graph import hint, parse_binding

# Keys every batch starts with: what the data loader yields per prompt.
SOURCE_KEYS = ("raw_prompt", "uid", "data_source", "ground_truth", "extra_info")
SOURCE = "__source__"  # the data loader, as a producer


def holds(pipe, node: str) -> set[str]:
    """The keys `node`'s output holds: what it produces, and, when it expands rows, its inputs."""
    keys = set(pipe.produces(node))
    if pipe.kinds[node].expands:
        keys |= set(pipe.consumes(node)) | set(SOURCE_KEYS)
    return keys


def _ancestors_latest_first(pipe, node: str) -> list[str]:
    ancestors = nx.ancestors(pipe.graph, node)
    return [n for n in reversed(pipe.nodes) if n in ancestors]


def named(pipe, node: str, key: str) -> tuple[str, str] | None:
    """Where `node` says `key` comes from: its binding in `inputs`, else the first of its `from` nodes
    holding the key; None where it says nothing."""
    spec = pipe.nodes[node]
    return spec.inputs.get(key) or next(((src, key) for src in spec.reads_from if key in holds(pipe, src)), None)


def producer(pipe, node: str, key: str) -> tuple[str, str]:
    """(the node whose output `node` reads `key` from, the key's name there); SOURCE: the data loader."""
    return named(pipe, node, key) or next(
        ((up, key) for up in _ancestors_latest_first(pipe, node) if key in holds(pipe, up)), (SOURCE, key))


def read_via_from(pipe, node: str) -> dict[str, list[str]]:
    """Per `from` node of `node`, the consumed keys read from it (the ones `inputs` does not bind)."""
    spec, out = pipe.nodes[node], {src: [] for src in pipe.nodes[node].reads_from}
    for key in pipe.consumes(node):
        found = named(pipe, node, key)
        if found and key not in spec.inputs:
            out[found[0]].append(key)
    return out


def reads(pipe) -> dict[str, dict[str, tuple[str, str]]]:
    """Per node, every key it reads (by the name it reads it under) -> `producer`'s answer: the keys it
    consumes, then the data loader's per-prompt keys, which a node that expands rows re-emits so that
    later nodes read them in their own row space, then the keys it reads if an upstream node holds them."""
    out = {}
    for n in pipe.nodes:
        consumed = pipe.consumes(n)
        out[n] = {key: producer(pipe, n, key) for key in (*consumed, *(k for k in SOURCE_KEYS if k not in consumed))}
        held = {key: producer(pipe, n, key) for key in pipe.kinds[n].reads_if_held if key not in out[n]}
        out[n].update({key: found for key, found in held.items() if found[0] != SOURCE})
    return out


def _from_problems(pipe, n: str) -> list[Problem]:
    """Each `from` node holds a key `n` consumes (else it reads nothing there: a slip)."""
    problems, consumed = [], pipe.consumes(n)
    entries = pipe.nodes[n].reads_from
    for j, src in enumerate(entries):
        if set(consumed) & holds(pipe, src):
            continue
        where = pipe.node_path(n) + (("from",) if len(entries) == 1 else ("from", j))
        makers = [m for m in _ancestors_latest_first(pipe, n) if set(consumed) & set(pipe.produces(m))]
        instead = f"; did you mean from: {makers[0]}?" if makers else ""
        problems.append(Problem(where, f"'{src}' produces none of the keys '{n}' reads ({', '.join(consumed) or 'none'})"
                                       f"{instead}; expected a node whose output holds one of them"))
    return problems


def binding_problems(pipe) -> list[Problem]:
    """Every binding names a key its node consumes and its producer holds, every `from` node holds a key
    it reads; every key neither names has exactly one producer upstream (or comes from the data loader)."""
    problems = []
    producers_of: dict[str, list[str]] = {}
    for n in pipe.nodes:
        for key in pipe.produces(n):
            producers_of.setdefault(key, []).append(n)
    for n, spec in pipe.nodes.items():
        base, consumed, ancestors = pipe.node_path(n), pipe.consumes(n), nx.ancestors(pipe.graph, n)
        problems += _from_problems(pipe, n)
        for key, (src, src_key) in spec.inputs.items():
            if key not in consumed:
                problems.append(Problem(base + ("inputs", key), f"'{n}' does not consume '{key}'{hint(key, consumed)}; "
                                        f"expected one of the keys kind '{spec.kind}' consumes: {', '.join(consumed)}"))
            elif src_key not in holds(pipe, src):
                held = sorted(holds(pipe, src))
                problems.append(Problem(base + ("inputs", key), f"'{src}' does not produce '{src_key}'{hint(src_key, held)}; "
                                        f"expected one of: {', '.join(held)}"))
        for key in consumed:
            if named(pipe, n, key):
                continue
            upstream = [p for p in producers_of.get(key, []) if p in ancestors]
            if len(upstream) > 1:
                fix = "inputs: {" + f"{key}: {upstream[-1]}.{key}" + "}"
                problems.append(Problem(base, f"'{n}' consumes '{key}', produced by several upstream nodes "
                                        f"({', '.join(sorted(upstream))}); expected exactly one: say which with "
                                        f"`from: {upstream[-1]}` (every key it reads that {upstream[-1]} holds) "
                                        f"or `{fix}`"))
            elif not upstream and key not in SOURCE_KEYS:
                elsewhere = [p for p in producers_of.get(key, []) if p != n]
                fix = (f"add '{elsewhere[0]}' to its deps, or bind it: inputs: {{{key}: {elsewhere[0]}.{key}}}"
                       if elsewhere else f"add a node that produces '{key}', or bind it: inputs: {{{key}: NODE.KEY}}")
                problems.append(Problem(base + ("deps",), f"'{n}' consumes '{key}' but no upstream node produces it; {fix}"))
    return problems


def rows_per_prompt(pipe) -> tuple[dict[str, int], list[Problem]]:
    """Rows per prompt of each node's input, and the nodes whose inputs do not align."""
    out, seen, problems = {SOURCE: 1}, {}, []
    for n in pipe.nodes:
        sources = {key: producer(pipe, n, key)[0] for key in pipe.consumes(n)}
        if not sources:  # it consumes nothing: the rows of its nearest upstream node
            nearest = next(iter(_ancestors_latest_first(pipe, n)), SOURCE)
            sources = {"": nearest}
        sizes = {src: out[src] for src in sources.values()}
        if len(set(sizes.values())) > 1:
            shown = ", ".join(f"'{key}' from {'the data' if src == SOURCE else repr(src)} ({sizes[src]})"
                              for key, src in sources.items())
            problems.append(Problem(pipe.node_path(n), f"'{n}' reads rows that do not align (rows per prompt: {shown}); "
                                    "expected one row space: a rollout that answers another's samples keeps their rows "
                                    "with n: 1, and bindings name nodes of the same rows"))
        seen[n] = max(sizes.values())
        out[n] = seen[n] * expansion(pipe, n)
    return seen, problems


def expansion(pipe, node: str) -> int:
    """Rows a node returns per row it reads: a kind that expands rows makes its `n` of each."""
    return int(pipe.nodes[node].options.get("n", 1)) if pipe.kinds[node].expands else 1


def policies(pipe) -> list[str]:
    """The models a rollout samples from and a node trains (`weights_from` names that node), in node order."""
    trained = {pipe.nodes[n.weights_from].model for n in pipe.nodes.values() if n.weights_from in pipe.nodes}
    return [m for m in pipe.models if m in trained]


def served_policies(pipe) -> dict[str, str | None]:
    """The policy each node works for: its own model if a policy; else the one policy its descendants
    train; else the policy of the samples it reads (`responses`); else none."""
    chosen, known = {}, set(policies(pipe))
    for n, spec in pipe.nodes.items():
        downstream = {pipe.nodes[d].model for d in nx.descendants(pipe.graph, n) if pipe.kinds[d].trains} & known
        src = producer(pipe, n, "responses")[0] if "responses" in pipe.consumes(n) else SOURCE
        chosen[n] = (spec.model if spec.model in known else next(iter(downstream)) if len(downstream) == 1
                     else chosen.get(src))
    return chosen


def scorers(pipe) -> tuple[list[tuple[str, str]], list[Problem]]:
    """What validation scores: (node, key) per entry of trainer.val_score_key, a KEY (its producers)
    or NODE.KEY; one per policy (with one policy, one in all)."""
    written = pipe.trainer.val_score_key
    entries = [written] if isinstance(written, str) else list(written)
    where = ("trainer", "val_score_key")
    chosen, problems = [], []
    for i, entry in enumerate(entries):
        path = where if isinstance(written, str) else where + (i,)
        bound = parse_binding(entry)
        if bound and bound[0] not in pipe.nodes:
            problems.append(Problem(path, f"unknown node '{bound[0]}' in '{entry}'{hint(bound[0], pipe.nodes)}; "
                                          "expected KEY or NODE.KEY"))
        elif bound and bound[1] not in pipe.produces(bound[0]):
            made = pipe.produces(bound[0])
            problems.append(Problem(path, f"'{bound[0]}' does not produce '{bound[1]}'{hint(bound[1], made)}; "
                                          f"expected one of: {', '.join(made) or 'nothing it produces'}"))
        else:
            chosen += [bound] if bound else [(n, entry) for n in pipe.nodes if entry in pipe.produces(n)]
    by_policy: dict = {}
    for node, key in chosen:
        by_policy.setdefault(pipe.serves.get(node) if len(pipe.policies) > 1 else None, []).append(f"{node}.{key}")
    for policy, found in by_policy.items():
        if len(found) > 1:
            whose = f" for policy '{policy}'" if policy else ""
            problems.append(Problem(where, f"validation would score{whose} with each of {', '.join(found)}; expected one: "
                                           f"name it, e.g. val_score_key: {found[0]}"))
    return chosen, problems
