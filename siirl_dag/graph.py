"""The DAG of a pipeline and its structural checks: ids, deps and bindings, cycles, reachability, and
the phases of a step with dynamic sampling. What flows along the edges: `dataflow`.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass

import networkx as nx

from siirl_dag.errors import Problem



def hint(word: str, choices) -> str:
    """'; did you mean X?' for the closest of `choices`, or ''."""
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def parse_binding(value) -> tuple[str, str] | None:
    """`NODE.KEY` -> (NODE, KEY); None for anything else (node ids hold no dot, keys may)."""
    if not isinstance(value, str):
        return None
    node, dot, key = value.partition(".")
    return (node, key) if dot and node and key and not key.startswith(".") else None


EXPECTED_BINDING = "expected NODE.KEY: the id of an upstream node, a dot, a key it produces (e.g. rollout.responses)"
EXPECTED_FROM = "expected the id of another node, whose output holds keys this node reads (e.g. from: rollout)"


def read_from(node: dict) -> list[tuple[str, tuple]]:
    """A raw node's `from` entries, each with its path under the node: `from: a` or `from: [a, b]`."""
    value = node.get("from", [])
    return [(value, ("from",))] if isinstance(value, str) else [(v, ("from", j)) for j, v in enumerate(value)]


def build_graph(nodes: list[dict]) -> tuple[nx.DiGraph, list[Problem]]:
    """Graph of dep -> node edges from raw node dicts (ids already schema-checked); a binding in
    `inputs` (KEY: NODE.KEY) and a `from: NODE` are dependencies on NODE too."""
    problems: list[Problem] = []
    graph = nx.DiGraph()
    for i, node in enumerate(nodes):
        if node["id"] in graph:
            first = graph.nodes[node["id"]]["index"]
            problems.append(Problem(("nodes", i, "id"), f"duplicate node id '{node['id']}' (also nodes[{first}]); ids must be unique"))
            continue
        graph.add_node(node["id"], index=i)
    for i, node in enumerate(nodes):
        for j, dep in enumerate(node.get("deps", [])):
            if dep == node["id"]:
                problems.append(Problem(("nodes", i, "deps", j), f"node '{dep}' depends on itself; a node cannot be its own dependency"))
            elif dep not in graph:
                problems.append(Problem(("nodes", i, "deps", j), f"unknown dependency '{dep}'{hint(dep, graph.nodes)}; expected the id of another node"))
            else:
                graph.add_edge(dep, node["id"])
        for src, where in read_from(node):
            if src == node["id"]:
                problems.append(Problem(("nodes", i) + where, f"node '{src}' reads from itself; {EXPECTED_FROM}"))
            elif src not in graph:
                problems.append(Problem(("nodes", i) + where, f"unknown node '{src}' in from{hint(src, graph.nodes)}; "
                                                              f"{EXPECTED_FROM}"))
            else:
                graph.add_edge(src, node["id"])
                graph.edges[src, node["id"]]["from"] = where
        for key, value in node.get("inputs", {}).items():
            where, bound = ("nodes", i, "inputs", key), parse_binding(value)
            if bound is None:
                problems.append(Problem(where, f"'{value}' is not a binding; {EXPECTED_BINDING}"))
            elif bound[0] == node["id"]:
                problems.append(Problem(where, f"'{value}' binds node '{bound[0]}' to its own output; {EXPECTED_BINDING}"))
            elif bound[0] not in graph:
                problems.append(Problem(where, f"unknown node '{bound[0]}' in '{value}'{hint(bound[0], graph.nodes)}; "
                                               f"{EXPECTED_BINDING}"))
            else:
                graph.add_edge(bound[0], node["id"])
                graph.edges[bound[0], node["id"]].setdefault("bound", []).append(key)
    return graph, problems


def check_structure(graph: nx.DiGraph) -> list[Problem]:
    """Cycles (each named), and nodes no source node reaches."""
    problems = []
    for cycle in list(nx.simple_cycles(graph))[:10]:
        start = min(cycle, key=lambda n: graph.nodes[n]["index"])
        k = cycle.index(start)
        ordered = cycle[k:] + cycle[:k]
        names = " -> ".join(ordered + [ordered[0]])
        into = graph.edges[ordered[-1], start]  # the edge that closes the loop at `start`
        where = ("inputs", into["bound"][0]) if "bound" in into else into.get("from", ("deps",))
        pairs = list(zip(ordered, ordered[1:] + ordered[:1]))
        bound = "; ".join([f"'{b}' binds {a}.{k}" for a, b in pairs for k in graph.edges[a, b].get("bound", [])]
                          + [f"'{b}' reads from {a}" for a, b in pairs if "from" in graph.edges[a, b]])
        problems.append(Problem(("nodes", graph.nodes[start]["index"]) + where,
                                f"dependency cycle {names}{f' ({bound})' if bound else ''}; the graph must be acyclic "
                                "(weights flow back with `weights_from`, not deps, inputs or from)"))
    sources = [n for n in graph if graph.in_degree(n) == 0]
    reached = set(sources).union(*(nx.descendants(graph, s) for s in sources)) if sources else set()
    for n in graph:
        if n not in reached:
            problems.append(Problem(("nodes", graph.nodes[n]["index"]), f"node '{n}' is not reachable from any source node (a node with no deps)"))
    return problems


def topological_order(graph: nx.DiGraph) -> list[str]:
    """Deterministic order: among ready nodes, the one written first in the YAML."""
    return list(nx.lexicographical_topological_sort(graph, key=lambda n: graph.nodes[n]["index"]))


@dataclass(frozen=True)
class Phases:
    """A pipeline with a node that filters rows (dynamic sampling, trainer/schedules/dynamic_sampling.py)
    runs in two phases, under every schedule."""

    filter: str
    first: frozenset  # the filter and its ancestors: run once per generation round
    rest: frozenset  # every other node: run once per step, on the kept rows
    max_rounds: int

    def to_json(self, order: list[str]) -> dict:
        return {"filter": self.filter, "rerun": [n for n in order if n in self.first],
                "then": [n for n in order if n in self.rest], "max_gen_batches": self.max_rounds}

    def describe(self, order: list[str], prompts: int) -> str:
        js = self.to_json(order)
        return (f"dynamic sampling: {', '.join(js['rerun'])} run again on more prompts until {prompts} are kept "
                f"(at most {self.max_rounds} rounds); then {', '.join(js['then'])} on those")


def phases_of(pipe) -> Phases | None:
    """The two phases of a pipeline with a filtering node (None without one); checked by `phase_problems`."""
    filters = [n for n in pipe.nodes if pipe.kinds[n].filters_rows]
    if not filters:
        return None
    first = frozenset({filters[0]} | nx.ancestors(pipe.graph, filters[0]))
    return Phases(filters[0], first, frozenset(pipe.nodes) - first, pipe.nodes[filters[0]].params["max_gen_batches"])


def phase_problems(pipe) -> list[Problem]:
    """One filtering node at most, and no training in the part that re-runs (weights would move per round)."""
    filters = [n for n in pipe.nodes if pipe.kinds[n].filters_rows]
    out = [Problem(pipe.node_path(n) + ("kind",), f"a second node that filters rows ('{filters[0]}' is the "
                   "first); expected one per pipeline") for n in filters[1:]]
    if filters:
        trainers = sorted(n for n in nx.ancestors(pipe.graph, filters[0]) if pipe.kinds[n].trains)
        out += [Problem(pipe.node_path(filters[0]) + ("deps",), f"'{filters[0]}' filters rows, so it and its "
                        f"ancestors run again until the batch is full, and '{t}' would train in each round; "
                        f"expected no training node upstream of '{filters[0]}'") for t in trainers]
        first = {filters[0]} | nx.ancestors(pipe.graph, filters[0])
        for n in [m for m in pipe.nodes if m not in first]:  # the kept rows reach the rest as one batch: a key by its name alone
            spec = pipe.nodes[n]
            for key, (src, src_key) in pipe.reads[n].items():
                where = ("inputs", key) if key in spec.inputs else ("from",) if src in spec.reads_from else None
                others = sorted(u for u in first - {src} if src_key in pipe.produces(u))
                if where and src in first and others:
                    out.append(Problem(pipe.node_path(n) + where, f"'{src}' runs before '{filters[0]}', which "
                                       f"hands its kept rows on as one batch, where '{src_key}' of '{src}' and of "
                                       f"{', '.join(others)} cannot both be kept; expected one producer of '{src_key}' "
                                       f"before '{filters[0]}'"))
    return out
