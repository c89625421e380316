"""The pipeline every importer writes: the RL step of verl, siiRL, ROLL and AReaL as one DAG.

rollout (or agent_rollout, multi-turn) -> reward -> (critic values) -> advantage, old and reference
log-probs beside them, then the (critic and) actor updates; weights flow actor_update -> rollout.
Importers fill a `Draft` with what the source says; `document()` lays it out as a pipeline YAML would
be written by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from siirl_dag.config import schema
from siirl_dag.importers.source import Source
from siirl_dag.placement.rules import option_sizes, parallel_sizes
from siirl_dag.registry import STRATEGIES

POLICY, CRITIC = "policy", "critic"


PARQUET_NOTE = "data files are read as parquet here: convert them (pyarrow, or the datasets library's to_parquet)"


def all_parquet(files: Any) -> bool:
    return all(str(f).endswith(".parquet") for f in ([files] if isinstance(files, str) else files or []))


def strategy_options(src: Source, prefix: str, strategy: str, exclude: tuple[str, ...] = ()) -> dict:
    """The keys under `prefix` that are options of `strategy` here, carried as written."""
    known = set(schema.load_schema(STRATEGIES[strategy].options_schema)["properties"]) - set(exclude)
    return {key: src.take(f"{prefix}.{key}") for key in sorted(known) if src.has(f"{prefix}.{key}")}


def megatron_sizes(src: Source, prefix: str, default: dict | None = None) -> dict[str, int]:
    """`parallel_sizes` of the Megatron keys under `prefix` (`default`: by ParallelDims' names)."""
    keys = option_sizes("megatron")
    return parallel_sizes("megatron", {key: src.take(f"{prefix}.{key}", (default or {}).get(size), kind=int)
                                       for key, size in keys.items()})


def drop_none(values: dict) -> dict:
    return {k: v for k, v in values.items() if v is not None}


@dataclass
class Draft:
    """The parts of an RL pipeline, as the importer read them (None / empty: the engine's default)."""

    name: str
    cluster: dict
    policy: dict
    data: dict
    meshes: dict[str, Any]  # gen, actor, and ref / critic when used
    rollout: dict = field(default_factory=dict)  # the rollout node's options
    agent: dict = field(default_factory=dict)  # agent_rollout params (`agentic`); empty: a plain rollout node
    reward: dict = field(default_factory=dict)
    advantage: dict = field(default_factory=dict)
    logprob: dict = field(default_factory=dict)  # old log-prob options (on the actor's mesh)
    ref: dict = field(default_factory=dict)
    actor: dict = field(default_factory=dict)  # actor_update options
    actor_params: dict = field(default_factory=dict)
    critic_model: dict | None = None
    critic: dict = field(default_factory=dict)
    critic_params: dict = field(default_factory=dict)
    trainer: dict = field(default_factory=dict)
    runtime: dict = field(default_factory=dict)
    filter_groups: dict = field(default_factory=dict)  # DAPO's dynamic sampling: a filter_groups node after the reward

    def one_micro_batch(self) -> int | None:
        """Old log-probs and the actor update share one engine and so one micro_batch_size (the
        training one); returns a different log-prob value the source gave, which is not carried."""
        mine = self.logprob.get("micro_batch_size")
        if mine is None or self.actor.get("micro_batch_size") in (None, mine):
            return None
        del self.logprob["micro_batch_size"]
        return mine

    def document(self) -> dict:
        """The pipeline as a plain document, keys in the order a person writes them."""
        uses_ref = "ref" in self.meshes
        uses_critic = self.critic_model is not None
        models = {POLICY: drop_none(self.policy)} | ({CRITIC: drop_none(self.critic_model)} if uses_critic else {})
        kl_in_reward = bool(self.reward.get("kl_coef"))  # the penalty needs both log-probs before the reward
        nodes = [_node("rollout", "agent_rollout" if self.agent else "rollout", [], mesh="gen", model=POLICY,
                       weights_from="actor_update", options=self.rollout, params=self.agent),
                 _node("reward", "reward", ["rollout"] + (["old_logprob", "ref_logprob"] if kl_in_reward and uses_ref else []),
                       params=self.reward)]
        if self.filter_groups:
            nodes.append(_node("filter", "filter_groups", ["reward"], params=self.filter_groups))
        if uses_critic:
            nodes.append(_node("values", "critic_value", ["rollout"], mesh="critic", model=CRITIC,
                               options=self.critic | {"value_head": True}))
        scored = "filter" if self.filter_groups else "reward"
        bypass = self.actor_params.get("old_logprobs") == "rollout"  # the rollout's log-probs are the old policy
        nodes.append(_node("advantage", "advantage", [scored] + (["values"] if uses_critic else []), params=self.advantage))
        if not bypass or (kl_in_reward and uses_ref):
            nodes.append(_node("old_logprob", "logprob", ["filter" if self.filter_groups else "rollout"], mesh="actor",
                               model=POLICY, options=self.logprob, params={"output": "old_logprobs"}))
        if uses_ref:
            nodes.append(_node("ref_logprob", "logprob", ["rollout"], mesh="ref", model=POLICY, options=self.ref,
                               params={"output": "ref_logprobs"}))
        if uses_critic:
            nodes.append(_node("critic_update", "critic_update", ["advantage"], mesh="critic", model=CRITIC,
                               params=self.critic_params))
        nodes.append(_node("actor_update", "actor_update",
                           ["advantage"] + ([] if bypass else ["old_logprob"]) + (["ref_logprob"] if uses_ref else []),
                           mesh="actor", model=POLICY, options=self.actor, params=self.actor_params))
        doc = {"name": self.name, "cluster": self.cluster, "models": models, "data": drop_none(self.data),
               "meshes": self.meshes, "nodes": nodes, "trainer": drop_none(self.trainer)}
        return doc | ({"runtime": self.runtime} if self.runtime else {})


def _node(node_id: str, kind: str, deps: list[str], **fields) -> dict:
    node = {"id": node_id, "kind": kind} | ({"deps": deps} if deps else {})
    for key, value in fields.items():
        value = drop_none(value) if isinstance(value, dict) else value
        if value:
            node[key] = value
    return node
