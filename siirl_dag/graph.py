"""The DAG of a pipeline and its structural checks: ids, deps, cycles, reachability, data flow, and
the phases of a step with dynamic sampling.

Data flow is checked from the kinds' contracts: every key a node consumes must be produced by exactly
one of its ancestors (or come from the data loader), so a missing or ambiguous producer is found
before anything starts.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

import networkx as nx

from siirl_dag.errors import Problem

# Keys every batch starts with: what the data loader yields per prompt.
SOURCE_KEYS = ("raw_prompt", "uid", "data_source", "ground_truth", "extra_info")


def _hint(word: str, choices) -> str:
    close = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f"; did you mean '{close[0]}'?" if close else ""


def build_graph(nodes: list[dict]) -> tuple[nx.DiGraph, list[Problem]]:
    """Graph of dep -> node edges from raw node dicts (ids already schema-checked)."""
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
                problems.append(Problem(("nodes", i, "deps", j), f"unknown dependency '{dep}'{_hint(dep, graph.nodes)}; expected the id of another node"))
            else:
                graph.add_edge(dep, node["id"])
    return graph, problems


def check_structure(graph: nx.DiGraph) -> list[Problem]:
    """Cycles (each named), and nodes no source node reaches."""
    problems = []
    for cycle in list(nx.simple_cycles(graph))[:10]:
        start = min(cycle, key=lambda n: graph.nodes[n]["index"])
        k = cycle.index(start)
        ordered = cycle[k:] + cycle[:k]
        names = " -> ".join(ordered + [ordered[0]])
        problems.append(Problem(("nodes", graph.nodes[start]["index"], "deps"),
                                f"dependency cycle {names}; the graph must be acyclic (weights flow back with `weights_from`, not deps)"))
    sources = [n for n in graph if graph.in_degree(n) == 0]
    reached = set(sources).union(*(nx.descendants(graph, s) for s in sources)) if sources else set()
    for n in graph:
        if n not in reached:
            problems.append(Problem(("nodes", graph.nodes[n]["index"]), f"node '{n}' is not reachable from any source node (a node with no deps)"))
    return problems


def check_data_flow(graph: nx.DiGraph, consumes: Callable[[str], tuple], produces: Callable[[str], tuple]) -> list[Problem]:
    """Every consumed key has exactly one producer upstream (or comes from the data loader)."""
    problems = []
    producers_of: dict[str, list[str]] = {}
    for n in graph:
        for key in produces(n):
            producers_of.setdefault(key, []).append(n)
    for n in graph:
        ancestors = nx.ancestors(graph, n)
        index = graph.nodes[n]["index"]
        for key in consumes(n):
            upstream = [p for p in producers_of.get(key, []) if p in ancestors]
            if len(upstream) > 1:
                problems.append(Problem(("nodes", index), f"'{n}' consumes '{key}', produced by several upstream nodes "
                                        f"({', '.join(sorted(upstream))}); expected exactly one producer"))
            elif not upstream and key not in SOURCE_KEYS:
                elsewhere = [p for p in producers_of.get(key, []) if p != n]
                fix = (f"add '{elsewhere[0]}' to its deps" if elsewhere else f"add a node that produces '{key}'")
                problems.append(Problem(("nodes", index, "deps"), f"'{n}' consumes '{key}' but no upstream node produces it; {fix}"))
    return problems


def topological_order(graph: nx.DiGraph) -> list[str]:
    """Deterministic order: among ready nodes, the one written first in the YAML."""
    return list(nx.lexicographical_topological_sort(graph, key=lambda n: graph.nodes[n]["index"]))


@dataclass(frozen=True)
class Phases:
    """A pipeline with a node that filters rows (dynamic sampling, trainer/refill.py) runs in two phases."""

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
    return out
