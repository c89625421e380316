"""`load_pipeline`: YAML + overrides -> a checked, typed, placed `Pipeline`, or every problem at once.

Order: parse (line numbers kept) -> overrides -> ROLL spellings -> JSON Schema (defaults filled) ->
kinds, strategies and their schemas -> graph -> placement -> memory plan -> batch arithmetic. Later stages run only
when the earlier ones leave data of the expected shape, so one mistake yields one message.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from siirl_dag.config import door, roll_compat, schedule, schema
from siirl_dag.models import lora
from siirl_dag.config.overrides import apply_overrides
from siirl_dag.config.pipeline import (DataSpec, MeshSpec, ModelSpec, NodeSpec, Pipeline, RuntimeSpec, TrainerSpec,
                                      WeightSyncSpec, vocabulary_differs)
from siirl_dag.config.yaml_loader import load_yaml, locate
from siirl_dag.errors import ConfigError, Problem
from siirl_dag import dataflow
from siirl_dag.graph import build_graph, check_structure, parse_binding, phase_problems, read_from, topological_order
from siirl_dag.placement import ClusterSpec, MeshRequest, check_backend_supported, parse_allocation
from siirl_dag.placement import place as place_meshes
from siirl_dag.placement.memory import plan_memory
from siirl_dag.kinds import resolve_kind
from siirl_dag.registry import STRATEGIES, NodeKind
from siirl_dag.trainer.trackers import door_problems as tracker_problems
from siirl_dag.weight_sync.routes import problems as sync_route_problems


def _errors(problems: list[Problem]) -> list[Problem]:
    return [p for p in problems if p.severity == "error"]


def _read_meshes(raw, problems: list[Problem]) -> tuple[dict[str, MeshSpec], dict]:
    """Mesh specs plus their parsed components; a one-string `meshes` is split into named meshes."""
    specs, components = {}, {}
    if isinstance(raw, str):
        try:
            parsed = parse_allocation(raw, ("meshes",))
        except ConfigError as exc:
            problems.extend(exc.problems)
            return specs, components
        for i, c in enumerate(parsed):
            name = c.name or f"mesh{i}"
            specs[name] = MeshSpec(name, c.text or raw, None, c.colocated_with)
            components[name] = c
        return specs, components
    for name, mesh in raw.items():
        mesh = {"alloc": mesh} if isinstance(mesh, str) else mesh
        path = ("meshes", name) + (("alloc",) if "devices" in mesh or "colocate_with" in mesh else ())
        try:
            parsed = parse_allocation(mesh["alloc"], path)
        except ConfigError as exc:
            problems.extend(exc.problems)
            continue
        if len(parsed) != 1:
            problems.append(Problem(path, f"mesh '{name}' has {len(parsed)} components; expected one (name each "
                                          f"component of a multi-part string by writing `meshes:` as that one string)"))
            continue
        specs[name] = MeshSpec(name, mesh["alloc"], tuple(mesh["devices"]) if "devices" in mesh else None,
                               mesh.get("colocate_with"), mesh.get("allow_tp_across_machines", False))
        components[name] = parsed[0]
    for name, spec in specs.items():
        if spec.colocate_with and spec.colocate_with not in specs:
            problems.append(Problem(("meshes", name, "colocate_with"), f"unknown mesh '{spec.colocate_with}'; "
                                    f"expected one of: {', '.join(specs)}"))
    return specs, components


def _read_node(i: int, raw: dict, doc: dict, meshes: dict, components: dict, problems: list[Problem]) -> NodeKind | None:
    """Resolve the kind, check strategy/mesh/model binding, validate params and options in place."""
    base = ("nodes", i)
    try:
        kind = resolve_kind(raw["kind"])
    except LookupError as exc:
        problems.append(Problem(base + ("kind",), str(exc)))
        return None
    params_problems = schema.validate(raw["params"], f"nodes/{kind.params_schema}.schema.json", base + ("params",)) \
        if kind.params_schema else []
    problems += params_problems
    if not kind.is_model_node:
        for key in ("strategy", "mesh", "model", "options", "weights_from"):
            if key in raw:
                problems.append(Problem(base + (key,), f"kind '{kind.name}' is a compute node and runs on CPU beside the "
                                        f"driver; it takes no '{key}'"))
    else:
        strategy = raw.setdefault("strategy", kind.strategies[0])
        if strategy not in kind.strategies:
            problems.append(Problem(base + ("strategy",), f"kind '{kind.name}' cannot use strategy '{strategy}'; "
                                    f"expected one of: {', '.join(kind.strategies)}"))
        elif strategy not in STRATEGIES:
            problems.append(Problem(base + ("strategy",), f"no strategy '{strategy}'; expected one of: {', '.join(STRATEGIES)}"))
        else:
            raw.setdefault("options", {})
            if kind.engine_options and not params_problems:
                raw["options"].update(kind.engine_options(raw["params"]))
            raw["__explicit__"] = set(raw["options"])  # before defaults: what the user wrote
            options_schema = STRATEGIES[strategy].options_schema
            if schema.schema_exists(options_schema):
                found = schema.validate(raw["options"], options_schema, base + ("options",))
                found = found or _model_dtype(strategy, raw, doc["models"])
                problems += found or _option_rules(strategy, raw["options"], base)
        for key, pool in (("mesh", meshes), ("model", doc["models"])):
            if key not in raw:
                problems.append(Problem(base, f"model node '{raw['id']}' needs '{key}'; expected one of: {', '.join(pool)}"))
            elif raw[key] not in pool:
                problems.append(Problem(base + (key,), f"unknown {key} '{raw[key]}'; expected one of: {', '.join(pool)}"))
        if raw.get("mesh") in components and strategy in kind.strategies:
            comp = components[raw["mesh"]]
            try:
                check_backend_supported(comp, path=base + ("mesh",))
                if comp.backend != strategy:
                    raise ConfigError(f"mesh '{raw['mesh']}' is a {comp.backend} mesh but the node uses strategy "
                                      f"'{strategy}'; expected a {strategy}:... allocation", base + ("mesh",))
            except ConfigError as exc:
                problems.extend(exc.problems)
    if not kind.name.count(":") and ("consumes" in raw or "produces" in raw):
        problems.append(Problem(base, f"'consumes'/'produces' are declared by kind '{kind.name}' itself; "
                                      "they may only be given for module:function kinds"))
    return kind


def _model_dtype(strategy: str, raw: dict, models: dict) -> list[Problem]:
    """The model's dtype sets the engine's precision options the node did not write itself."""
    model = models.get(raw.get("model"))
    if not isinstance(model, dict):
        return []
    written = {k: raw["options"][k] for k in raw["__explicit__"]}
    try:
        raw["options"].update(STRATEGIES[strategy].options_for_dtype(model["dtype"], written))
    except ValueError as exc:
        return [Problem(("models", raw["model"], "dtype"), f"node '{raw['id']}': {exc}")]
    return []


def _option_rules(strategy: str, options: dict, base: tuple) -> list[Problem]:
    """The strategy's own rules across option keys (min_lr <= lr, ...), at the door."""
    try:
        STRATEGIES[strategy].check_options(dict(options))
    except ConfigError as exc:
        return [Problem(base + tuple(p.path), p.message) for p in exc.problems]
    return []


def _user_contract(kind: NodeKind, raw: dict) -> NodeKind:
    """A module:function kind takes its data contract from the node's consumes/produces."""
    if ":" in kind.name and ("consumes" in raw or "produces" in raw):
        from dataclasses import replace

        return replace(kind, consumes=tuple(raw.get("consumes", kind.consumed({}))),
                       produces=tuple(raw.get("produces", kind.produced({}))))
    return kind


def _merge_engine_options(nodes: list[dict]) -> list[Problem]:
    """Nodes on the same mesh, model and strategy share one engine, so one set of options: the
    values written on any of them (defaults elsewhere); the same key written twice must agree."""
    problems, groups = [], {}
    for i, raw in enumerate(nodes):
        if "__explicit__" in raw:
            groups.setdefault((raw.get("mesh"), raw.get("model"), raw["strategy"]), []).append(i)
    for (mesh, model, _), members in groups.items():
        chosen: dict[str, tuple[int, object]] = {}
        for i in members:
            for key in sorted(nodes[i]["__explicit__"]):
                value = nodes[i]["options"][key]
                if key in chosen and chosen[key][1] != value:
                    j, other = chosen[key]
                    problems.append(Problem(("nodes", i, "options", key), f"{value!r} conflicts with {other!r} on "
                                            f"'{nodes[j]['id']}', which shares its engine (mesh '{mesh}', model '{model}'); "
                                            "expected one value: write it once"))
                chosen.setdefault(key, (i, value))
        for i in members:
            nodes[i]["options"].update({k: v for k, (_, v) in chosen.items()})
    for raw in nodes:
        raw.pop("__explicit__", None)
    return problems


def _check_weights_from(nodes: dict[str, NodeSpec], kinds: dict[str, NodeKind]) -> list[Problem]:
    problems = []
    for node in nodes.values():
        src = node.weights_from
        if src is None:
            continue
        path = ("nodes", node.index, "weights_from")
        trainers = [n.id for n in nodes.values() if kinds[n.id].trains and n.model == node.model]
        if src not in nodes or not kinds[src].trains or nodes[src].model != node.model:
            why = ("no such node" if src not in nodes else f"'{src}' does not train" if not kinds[src].trains
                   else f"'{src}' trains model '{nodes[src].model}', not '{node.model}'")
            problems.append(Problem(path, f"weights_from '{src}': {why}; expected a training node of model "
                                          f"'{node.model}'" + (f" ({', '.join(trainers)})" if trainers else "")))
    return problems


def _mesh_requests(pipe: Pipeline, components: dict) -> list[MeshRequest]:
    requests = []
    for name, spec in pipe.meshes.items():
        bound = [n for n in pipe.nodes.values() if n.mesh == name]
        options: dict = {}
        for n in bound:
            options.update(n.options)
        model_info = None
        for n in bound:
            cfg = pipe.models[n.model].hf_config()
            if cfg:  # a whole config (with its heads) says a dense model has 0 experts; a partial one, nothing
                dense = 0 if "num_attention_heads" in cfg else None
                model_info = {"num_layers": cfg.get("num_hidden_layers"), "num_heads": cfg.get("num_attention_heads"),
                              "num_kv_heads": cfg.get("num_key_value_heads") or cfg.get("num_attention_heads"),
                              "num_experts": cfg.get("num_experts") or cfg.get("num_local_experts") or dense}
        path = ("meshes", name) if name in (pipe.meshes or {}) else ("meshes",)
        requests.append(MeshRequest(name, [components[name]], list(spec.devices) if spec.devices else None,
                                    spec.colocate_with, options, model_info, spec.allow_tp_across_machines,
                                    path=path, options_path=("nodes", bound[0].index, "options") if bound else None))
    return requests


def _model_files_problem(spec: ModelSpec) -> Problem | None:
    """What is missing from a model's folders for a run to load it, if anything."""
    folder = Path(spec.path)
    if not (folder / "config.json").is_file():
        return Problem(("models", spec.name, "path"), f"model directory '{spec.path}' not found (no config.json); "
                       "expected a local Hugging Face model folder")
    if not any(next(folder.glob(pattern), None) for pattern in ("*.safetensors", "*.bin", "*.index.json")):
        return Problem(("models", spec.name, "path"), f"model directory '{spec.path}' has no weights; expected "
                       "*.safetensors or *.bin files (or their *.index.json) beside config.json")
    if spec.tokenizer is not None and not Path(spec.tokenizer).is_dir():
        return Problem(("models", spec.name, "tokenizer"), f"tokenizer directory '{spec.tokenizer}' not found; "
                       "expected a local folder with the tokenizer files, or no key (the model's folder)")
    return None


def _data_warnings(pipe: Pipeline) -> list[Problem]:
    """`validate` names data files that are not there (a run reads them all, and refuses what is wrong)."""
    files = [("train_files", f) for f in pipe.data.train_files] + [("val_files", f) for f in pipe.data.val_files]
    return [Problem(("data", key), f"data file '{f}' does not exist; expected a parquet file (a run refuses it)",
                    severity="warning") for key, f in files if not Path(f).is_file()]


def _read_models(raw: dict, problems: list[Problem]) -> dict[str, ModelSpec]:
    """Model specs, each `lora:` block checked against its model's HF config (models.lora)."""
    models = {}
    for name, fields in raw.items():
        model = ModelSpec(name, **{**fields, "lora": None})
        if fields.get("lora"):
            try:
                spec, found = lora.resolve(fields["lora"], model.hf_config(), ("models", name, "lora"))
            except ConfigError as exc:  # an unreadable config.json
                spec, found = None, exc.problems
            problems += found
            model = replace(model, lora=spec)
        models[name] = model
    return models


def _lora_problems(pipe: Pipeline) -> list[Problem]:
    """What the adapters of a model need of every node that runs it (after placement: the meshes' sizes)."""
    problems, engines = [], set()
    for node in pipe.nodes.values():
        spec = pipe.models[node.model].lora if node.model else None
        if spec is None or (node.mesh, node.model, node.strategy) in engines:
            continue  # nodes on one mesh and model share an engine and its options: checked once
        engines.add((node.mesh, node.model, node.strategy))
        where, options = pipe.node_path(node.id), node.options
        if not STRATEGIES[node.strategy].lora:
            able = sorted(name for name, s in STRATEGIES.items() if s.lora)
            problems.append(Problem(where + ("strategy",), f"model '{node.model}' has LoRA adapters, which strategy "
                                    f"'{node.strategy}' cannot run; expected one of {able}"))
        if node.strategy == "vllm" and options.get("load_format") == "dummy" \
                and lora.payload(spec, pipe.cluster.device)[0] == "adapters":
            problems.append(Problem(where + ("options", "load_format"), "a rollout that applies adapters to its base "
                                    "loads that base from the model folder; expected load_format auto"))
        if node.strategy == "vllm" and pipe.cluster.device == "cuda" and options.get("dtype") == "float32" \
                and lora.payload(spec, "cuda")[0] == "adapters":
            at = ("models", node.model, "dtype") if pipe.models[node.model].dtype == "float32" else where + ("options", "dtype")
            problems.append(Problem(at, "vLLM applies adapters on CUDA with Triton kernels that take 16-bit weights; "
                                    "expected dtype bfloat16 (or float16) for this rollout"))
        if node.strategy != "megatron":
            continue
        dims = pipe.plan.meshes[node.mesh].dims
        if dims.cp > 1:
            problems.append(Problem(("meshes", node.mesh), f"LoRA with context parallel (c{dims.cp}) is not supported: it "
                                    "needs Transformer Engine's layers, and adapters take megatron's own; expected c1"))
        if spec.on_experts and options.get("moe_grouped_gemm"):
            problems.append(Problem(where + ("options", "moe_grouped_gemm"), "adapters on routed experts sit on "
                                    "megatron's per-expert layers; expected moe_grouped_gemm: false"))
    return problems


def _token_problems(pipe: Pipeline) -> list[Problem]:
    """A model node reading token ids (`input_ids`) another model wrote needs that model's vocabulary
    (a teacher scoring a student's samples, say); a judge or a second agent reads them as text."""
    problems = []
    for node in pipe.nodes.values():
        writer = dataflow.producer(pipe, node.id, "input_ids")[0] if "input_ids" in pipe.consumes(node.id) else None
        model = pipe.nodes[writer].model if writer in pipe.nodes else None
        if not (node.model and model and model != node.model):
            continue
        try:
            why = vocabulary_differs(pipe.models[model], pipe.models[node.model])
        except ConfigError as exc:
            problems += exc.problems
            continue
        if why:
            problems.append(Problem(pipe.node_path(node.id) + ("model",), f"'{node.id}' computes on the token ids "
                                    f"'{writer}' sampled with model '{model}', but the tokenizers of '{model}' and "
                                    f"'{node.model}' differ ({why}); expected models with the same tokenizer"))
    return problems


def _model_problems(pipe: Pipeline, for_run: bool) -> list[Problem]:
    """Models the nodes use must be on disk to run; `validate` only warns (a plan needs no weights)."""
    problems = []
    for name in sorted({n.model for n in pipe.nodes.values() if n.model}):
        problem = _model_files_problem(pipe.models[name])
        if problem:
            problem.severity = "error" if for_run else "warning"
            problems.append(problem)
    return problems


def load_pipeline(path: str | Path, overrides: list[str] = (), *, for_run: bool = False, place: bool = True,
                  address: str | None = None) -> Pipeline:
    """Read, check and (unless place=False) place a pipeline. Raises ConfigError with every problem, located.
    `for_run`: also what a run needs here (model files, CUDA unless `address` names a Ray cluster, output folders)."""
    file = str(path)
    doc, positions = load_yaml(path)
    touched: dict = {}
    located = lambda probs: locate(probs, file, positions, touched)  # noqa: E731
    try:
        touched = apply_overrides(doc, list(overrides), positions) if isinstance(doc, dict) else {}
    except ConfigError as exc:
        raise ConfigError(exc.problems) from None
    if not isinstance(doc, dict):
        raise ConfigError(located([Problem((), "the document is not a mapping; expected keys name, cluster, models, data, nodes")]))

    problems = roll_compat.normalize(doc, positions)
    problems += schema.validate(doc, "pipeline.schema.json")
    if _errors(problems):
        raise ConfigError(located(problems))

    meshes, components = _read_meshes(doc["meshes"], problems)
    problems += door.mesh_name_problems(meshes)
    kinds: dict[str, NodeKind] = {}
    for i, raw in enumerate(doc["nodes"]):
        kind = _read_node(i, raw, doc, meshes, components, problems)
        if kind is not None:
            kinds[raw["id"]] = _user_contract(kind, raw)
    problems += _merge_engine_options(doc["nodes"])
    graph, graph_problems = build_graph(doc["nodes"])
    problems += graph_problems
    if not graph_problems:
        problems += check_structure(graph)
    if _errors(problems):
        raise ConfigError(located(problems))

    raw_nodes = {raw["id"]: (i, raw) for i, raw in enumerate(doc["nodes"])}
    nodes = {}
    for node_id in topological_order(graph):
        i, raw = raw_nodes[node_id]
        bound = {k: parse_binding(v) for k, v in raw.get("inputs", {}).items()}
        named = tuple(src for src, _ in read_from(raw))
        deps = tuple(dict.fromkeys([*raw["deps"], *named, *(src for src, _ in bound.values())]))  # each a dependency
        nodes[node_id] = NodeSpec(node_id, raw["kind"], i, deps, raw.get("strategy"), raw.get("mesh"), raw.get("model"),
                                  raw.get("options", {}), raw["params"], raw.get("weights_from"), raw["retry_limit"], bound,
                                  named)
    data = doc["data"]
    files = lambda v: tuple([v] if isinstance(v, str) else v or [])  # noqa: E731
    pipe = Pipeline(
        name=doc["name"], file=file, cluster=ClusterSpec(**doc["cluster"]),
        models=_read_models(doc["models"], problems),
        data=DataSpec(**{**data, "train_files": files(data["train_files"]), "val_files": files(data.get("val_files"))}),
        meshes=meshes, nodes=nodes, kinds={k: kinds[k] for k in nodes}, graph=graph,
        trainer=TrainerSpec(**{**doc["trainer"], "logger": tuple(doc["trainer"]["logger"])}),
        runtime=RuntimeSpec(**doc["runtime"]),
        weight_sync=WeightSyncSpec(**doc["weight_sync"]), positions=positions, touched=touched,
    )
    if _errors(problems):  # a LoRA block that does not fit its model
        raise ConfigError(located(problems))
    problems += dataflow.binding_problems(pipe)
    if not _errors(problems):
        pipe.reads = dataflow.reads(pipe)
        pipe.rows, found = dataflow.rows_per_prompt(pipe)
        pipe.policies, pipe.serves = tuple(dataflow.policies(pipe)), dataflow.served_policies(pipe)
        pipe.scorers, more = dataflow.scorers(pipe)
        problems += found + more
    problems += _check_weights_from(nodes, pipe.kinds)
    if place and not _errors(problems):
        try:
            pipe.plan = place_meshes(pipe.cluster, _mesh_requests(pipe, components))
            problems += pipe.plan.warnings + sync_route_problems(pipe) + _lora_problems(pipe)
        except ConfigError as exc:
            problems += exc.problems
    if pipe.plan is not None and not _errors(problems):  # what every device must hold, summed where meshes share
        pipe.memory, found = plan_memory(pipe)
        problems += found
    if not _errors(problems):
        for node in nodes.values():
            if pipe.kinds[node.id].check:
                problems += pipe.kinds[node.id].check(node, pipe)
        problems += phase_problems(pipe) + schedule.problems(pipe) + _token_problems(pipe) + door.problems(pipe)
    problems += _model_problems(pipe, for_run and pipe.runtime.backend != "simulated") + (door.run_problems(pipe, address) if for_run else _data_warnings(pipe))
    problems += tracker_problems(pipe.trainer.logger, for_run)  # trainer.logger's packages installed
    located(problems)
    if _errors(problems):
        raise ConfigError(problems)
    pipe.warnings = problems
    return pipe
