"""The typed pipeline: what `load_pipeline` returns once everything is checked.

Everything downstream (placement, runtime, visualize) reads these objects and trusts them.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import networkx as nx

from siirl_dag.models.lora import LoraSpec
from siirl_dag.config.schema import describe, validate
from siirl_dag.config.yaml_loader import locate
from siirl_dag.errors import ConfigError, Problem, format_path
from siirl_dag.graph import phases_of
from siirl_dag.placement.memory import MemoryPlan
from siirl_dag.placement.plan import ClusterSpec, Plan
from siirl_dag.registry import NodeKind
from siirl_dag.weight_sync.routes import routes_json


@dataclass(frozen=True)
class ModelSpec:
    name: str
    path: str
    tokenizer: str | None
    dtype: str
    trust_remote_code: bool
    override_config: dict
    lora: LoraSpec | None = None  # models.lora: checked against the model at the door

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    def load_tokenizer(self):
        """The model's HF tokenizer, loaded once per process; one that does not load is a ConfigError
        at models.<name>.tokenizer (or .path)."""
        where, expected = ("models", self.name, "tokenizer" if self.tokenizer else "path"), \
            "expected a Hugging Face tokenizer folder"
        try:
            tokenizer = _tokenizer(self.tokenizer_path, self.trust_remote_code)
        except Exception as exc:  # transformers and tokenizers raise many kinds for a bad folder
            raise ConfigError(f"the tokenizer in '{self.tokenizer_path}' does not load ({type(exc).__name__}: "
                              f"{str(exc)[:300]}); {expected}", where) from None
        if len(tokenizer) < 2:  # transformers makes an empty one from a folder without tokenizer files
            raise ConfigError(f"'{self.tokenizer_path}' holds no tokenizer (no vocabulary); {expected}", where)
        return tokenizer

    def hf_config(self) -> dict | None:
        """The HF config.json merged with override_config, or None when the model is not on disk.

        Raises ConfigError at models.<name>.path for a config.json placement could not read.
        """
        cfg_file = Path(self.path) / "config.json"
        base = self._read_config(cfg_file) if cfg_file.is_file() else None
        if base is None and not self.override_config:
            return None
        return {**(base or {}), **self.override_config}

    def _read_config(self, cfg_file: Path) -> dict:
        path = ("models", self.name, "path")
        try:
            base = json.loads(cfg_file.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise ConfigError(f"{cfg_file} is unreadable ({exc}); expected the model's Hugging Face config.json",
                              path) from None
        if not isinstance(base, dict):
            raise ConfigError(f"{cfg_file} holds {describe(base)}; expected the model's Hugging Face config.json "
                              "(a JSON object)", path)
        problems = validate(base, "pipeline.schema.json#/$defs/hf_config", path)
        for p in problems:
            p.message = f"{cfg_file}: {format_path(p.path[len(path):])}: {p.message}"
            p.path = path
        if problems:
            raise ConfigError(problems)
        return base


def vocabulary_differs(a: ModelSpec, b: ModelSpec) -> str | None:
    """How the token ids of `a`'s tokenizer mean other things to `b`'s, or None (the same, or a
    tokenizer not on disk: the model files check names that)."""
    if a.tokenizer_path == b.tokenizer_path or not all(Path(m.tokenizer_path).is_dir() for m in (a, b)):
        return None
    ta, tb = a.load_tokenizer(), b.load_tokenizer()
    va, vb = ta.get_vocab(), tb.get_vocab()
    if va != vb:
        other = sum(1 for tok, i in va.items() if vb.get(tok) != i)
        return f"{other} of {len(va)} tokens have other ids or none ({len(va)} vs {len(vb)} tokens)"
    special = [name for name in ("eos_token_id", "pad_token_id", "bos_token_id")
               if getattr(ta, name, None) != getattr(tb, name, None)]
    return f"their {', '.join(special)} differ" if special else None


@functools.lru_cache(maxsize=8)
def _tokenizer(path: str, trust_remote_code: bool):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)


@dataclass(frozen=True)
class DataSpec:
    train_files: tuple[str, ...]
    val_files: tuple[str, ...]
    prompt_key: str
    train_batch_size: int
    val_batch_size: int | None
    max_prompt_length: int
    max_response_length: int
    filter_overlong_prompts: bool
    shuffle: bool
    seed: int


@dataclass(frozen=True)
class MeshSpec:
    name: str
    alloc: str
    devices: tuple[int, ...] | None = None
    colocate_with: str | None = None
    allow_tp_across_machines: bool = False


@dataclass(frozen=True)
class NodeSpec:
    id: str
    kind: str
    index: int  # position in the YAML list
    deps: tuple[str, ...] = ()  # the nodes it runs after: its `deps`, `from` and the nodes its `inputs` bind
    strategy: str | None = None
    mesh: str | None = None
    model: str | None = None
    options: dict = field(default_factory=dict)
    params: dict = field(default_factory=dict)
    weights_from: str | None = None
    retry_limit: int = 0
    inputs: dict = field(default_factory=dict)  # consumed key -> (node, its key there): `inputs: {KEY: NODE.KEY}`
    reads_from: tuple[str, ...] = ()  # `from: NODE` or a list: what those nodes hold is read from them, in order


@dataclass(frozen=True)
class TrainerSpec:
    total_epochs: int
    total_steps: int | None
    seed: int
    val_before_train: bool
    test_freq: int
    save_freq: int
    max_ckpt_to_keep: int | None
    resume_mode: str
    resume_from_path: str | None
    default_local_dir: str | None
    output_dir: str | None
    logger: tuple[str, ...]
    project_name: str | None
    experiment_name: str | None
    tensorboard_dir: str | None
    log_dir: str | None
    export_hf: bool
    val_score_key: str | list
    trace: bool
    log_trajectories: int
    log_val_generations: int = 0
    val_only: bool = False  # validate once and stop (as resumed, if a checkpoint is read)


@dataclass(frozen=True)
class RuntimeSpec:
    backend: str
    address: str | None
    schedule: str  # sync | one_step_off | async (config.schedule)
    staleness: int
    partial_rollout: bool  # generate in segments; weights may change between them (trainer/schedules/overlapped.py)
    partial_rollout_tokens: int
    weight_sync_path: str  # auto, shared_memory or process_group (weight_sync.routes)
    verify_sync: bool
    verify_probe_every: int
    weight_sync_bucket_mb: float
    cpus_per_rank: float
    fan_out: int  # ranks per leader on a larger mesh (runtime.fan_out); 0: none
    stop_grace_s: float


@dataclass(frozen=True)
class WeightSyncSpec:
    mode: str  # full or delta, on the routes that move bytes (weight_sync.routes, weight_sync.delta)


@dataclass
class Pipeline:
    name: str
    file: str
    cluster: ClusterSpec
    models: dict[str, ModelSpec]
    data: DataSpec
    meshes: dict[str, MeshSpec]
    nodes: dict[str, NodeSpec]  # in topological order
    kinds: dict[str, NodeKind]  # node id -> its kind
    graph: nx.DiGraph
    trainer: TrainerSpec
    runtime: RuntimeSpec
    weight_sync: WeightSyncSpec
    plan: Plan | None = None
    memory: MemoryPlan | None = None  # GiB per device (placement.memory); None without placement
    warnings: list[Problem] = field(default_factory=list)
    positions: dict = field(default_factory=dict, repr=False)  # key path -> (line, col) in `file`
    touched: dict = field(default_factory=dict, repr=False)  # key path -> the override that set it
    reads: dict = field(default_factory=dict)  # node id -> {key: (its producer, its name there)} (dataflow.reads)
    rows: dict = field(default_factory=dict)  # node id -> rows per prompt of its input (dataflow.rows_per_prompt)
    serves: dict = field(default_factory=dict)  # node id -> the policy it works for (dataflow.served_policies)
    policies: tuple = ()  # the models sampled from and trained (dataflow.policies)
    scorers: list = field(default_factory=list)  # (node, key) pairs validation scores (dataflow.scorers)

    def error(self, path: tuple, message: str) -> ConfigError:
        """A ConfigError located in the pipeline file, for checks made after loading (data, checkpoints)."""
        return self.located([Problem(tuple(path), message)])

    def located(self, problems: list[Problem]) -> ConfigError:
        return ConfigError(locate(problems, self.file, self.positions, self.touched))

    def node_path(self, node_id: str) -> tuple:
        return ("nodes", self.nodes[node_id].index)

    def consumes(self, node_id: str) -> tuple[str, ...]:
        return self.kinds[node_id].consumed(self.nodes[node_id].params)

    def produces(self, node_id: str) -> tuple[str, ...]:
        return self.kinds[node_id].produced(self.nodes[node_id].params)

    def does(self, node_id: str) -> str | None:
        """What the node's params make it do here, in a line, where its kind says (an agent's, say)."""
        describe = self.kinds[node_id].describe
        return describe(self.nodes[node_id].params, self) if describe else None

    def samples_per_prompt(self, node_id: str) -> int:
        """Rows per prompt in the batch this node sees (the n of the rollouts its rows come from)."""
        return self.rows.get(node_id, 1)

    @property
    def out_dir(self) -> Path:
        """The run's output folder (checkpoints, logs, tensorboard and timings by default): trainer.output_dir,
        else outputs/<project>/<experiment> under the working directory."""
        if self.trainer.output_dir:
            return Path(self.trainer.output_dir)
        return Path("outputs") / (self.trainer.project_name or self.name) / (self.trainer.experiment_name or "default")

    def metric_prefix(self, node_id: str) -> str:
        """'<policy>/' before a node's metrics when several policies train, else '' (verl's names)."""
        policy = self.serves.get(node_id)
        return f"{policy}/" if policy and len(self.policies) > 1 else ""

    def data_parallel_size(self, node_id: str) -> int:
        mesh = self.nodes[node_id].mesh
        if mesh is None or self.plan is None or mesh not in self.plan.meshes:
            return 1
        return self.plan.meshes[mesh].dims.dp

    def micro_batch_size(self, node_id: str) -> int | None:
        return self.nodes[node_id].options.get("micro_batch_size")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "file": self.file,
            "cluster": {"nodes": self.cluster.nodes, "devices_per_node": self.cluster.devices_per_node,
                        "device": self.cluster.device, "device_memory_gb": round(self.cluster.memory_gb, 2)},
            "meshes": {m.name: {"alloc": m.alloc, "devices": list(m.devices) if m.devices else None,
                                "colocate_with": m.colocate_with} for m in self.meshes.values()},
            "nodes": [{"id": n.id, "kind": n.kind, "deps": list(n.deps), "strategy": n.strategy, "mesh": n.mesh,
                       "inputs": {k: ".".join(v) for k, v in n.inputs.items()}, "from": list(n.reads_from),
                       "serves": self.serves.get(n.id),
                       "model": n.model, "weights_from": n.weights_from, "consumes": list(self.consumes(n.id)),
                       "produces": list(self.produces(n.id)), "options": n.options, "params": n.params}
                      for n in self.nodes.values()],
            "plan": self.plan.to_json() if self.plan else None,
            "memory": self.memory.to_json() if self.memory else None,
            "weight_sync": routes_json(self),
            "dynamic_sampling": phases.to_json(list(self.nodes)) if (phases := phases_of(self)) else None,
            "warnings": [w.to_json() for w in self.warnings],
        }
