"""The pipeline language: every error class gets a broken pipeline and a precise, located message."""

from __future__ import annotations

import glob
import io
import json
import shutil
import subprocess
import sys
import textwrap
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import pytest

from siirl_dag.config import load_pipeline, schedule
from siirl_dag.importers.roll_keys import parse_device_list
from siirl_dag.errors import ConfigError, format_path
from siirl_dag.graph import phases_of

BASE = textwrap.dedent("""\
    name: t
    cluster: {nodes: 1, devices_per_node: 4, device: cpu}
    models:
      policy: {path: no/such/model, dtype: float32}
    data:
      train_files: train.parquet
      train_batch_size: 8
    meshes:
      gen: vllm:d1
      train: megatron:d2
    nodes:
      - {id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: actor_update, options: {n: 4}}
      - {id: reward, kind: reward, deps: [rollout]}
      - {id: advantage, kind: advantage, deps: [reward]}
      - {id: old_logprob, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {output: old_logprobs}}
      - id: actor_update
        kind: actor_update
        deps: [advantage, old_logprob]
        mesh: train
        model: policy
        params: {mini_batch_size: 4}
    trainer: {total_steps: 2}
    """)


def write(tmp_path, text, name="p.yaml"):
    f = tmp_path / name
    f.write_text(text)
    return f


def problems(tmp_path, text, overrides=()):
    with pytest.raises(ConfigError) as info:
        load_pipeline(write(tmp_path, text), list(overrides))
    return [p for p in info.value.problems if p.severity == "error"]


def line_of(text, needle):
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)


def test_base_is_valid_and_typed(tmp_path):
    pipe = load_pipeline(write(tmp_path, BASE))
    assert list(pipe.nodes) == ["rollout", "reward", "advantage", "old_logprob", "actor_update"]
    assert pipe.nodes["actor_update"].params["clip_ratio_low"] == 0.2  # default filled from the schema
    assert pipe.trainer.logger == ("console", "tensorboard")
    assert pipe.samples_per_prompt("actor_update") == 4
    assert pipe.data_parallel_size("actor_update") == 2
    assert pipe.produces("old_logprob") == ("old_logprobs",)
    # a missing model directory or data file is a warning at validate time and an error for a run
    assert [w.path for w in pipe.warnings] == [("models", "policy", "path"), ("data", "train_files")]
    with pytest.raises(ConfigError, match="model directory 'no/such/model' not found"):
        load_pipeline(write(tmp_path, BASE), for_run=True)


@pytest.mark.parametrize("path", sorted(glob.glob("graphs/*.yaml")))
def test_every_shipped_graph_validates(path):
    pipe = load_pipeline(path)
    assert pipe.plan is not None and pipe.nodes
    assert all(w.severity == "warning" for w in pipe.warnings)


def test_yaml_syntax_error_has_line(tmp_path):
    text = BASE.replace("train_batch_size: 8", "train_batch_size: [8")
    (p,) = problems(tmp_path, text)
    assert "YAML syntax error" in p.message and p.line is not None and p.file.endswith("p.yaml")


def test_duplicate_yaml_key(tmp_path):
    text = BASE.replace("  train_batch_size: 8\n", "  train_batch_size: 8\n  train_batch_size: 16\n")
    (p,) = problems(tmp_path, text)
    assert "duplicate key" in p.message and p.line == line_of(text, "train_batch_size: 16")


def test_tags_are_refused_not_constructed(tmp_path):
    text = BASE.replace("name: t", "name: !!python/object/apply:os.system ['echo hacked']")
    (p,) = problems(tmp_path, text)
    assert "no tags" in p.message


def test_unknown_key_did_you_mean_with_location(tmp_path):
    text = BASE.replace("trainer: {total_steps: 2}", "trainer: {totl_steps: 2}")
    (p,) = problems(tmp_path, text)
    assert p.path == ("trainer", "totl_steps")
    assert "did you mean 'total_steps'" in p.message
    assert (p.line, p.col) == (line_of(text, "totl_steps"), 11)
    assert str(p).startswith(f"{p.file}:{p.line}:11: trainer.totl_steps: unknown key")


def test_type_enum_and_required_errors_all_at_once(tmp_path):
    text = BASE.replace("train_batch_size: 8", "train_batch_size: many").replace("device: cpu", "device: gpu")
    text = text.replace("name: t\n", "")
    found = {p.path: p.message for p in problems(tmp_path, text)}
    assert "missing required key 'name'" in found[()]
    assert "expected integer" in found[("data", "train_batch_size")]
    assert "expected one of: 'cuda', 'cpu'" in found[("cluster", "device")]


def test_kind_params_are_checked(tmp_path):
    text = BASE.replace("params: {mini_batch_size: 4}", "params: {mini_batch_size: 4, clip_ratio_lo: 0.1}")
    (p,) = problems(tmp_path, text)
    assert p.path == ("nodes", 4, "params", "clip_ratio_lo") and "did you mean 'clip_ratio_low'" in p.message


def test_duplicate_ids_unknown_kind_and_dep(tmp_path):
    text = BASE.replace("{id: advantage, kind: advantage, deps: [reward]}", "{id: reward, kind: advantag, deps: [rewad]}")
    msgs = [p.message for p in problems(tmp_path, text)]
    assert any("duplicate node id 'reward'" in m for m in msgs)
    assert any("unknown node kind 'advantag'" in m and "advantage" in m for m in msgs)


def test_unknown_dependency_suggests(tmp_path):
    text = BASE.replace("deps: [reward]}", "deps: [rewad]}")
    (p,) = problems(tmp_path, text)
    assert "unknown dependency 'rewad'; did you mean 'reward'?" in p.message
    assert p.path == ("nodes", 2, "deps", 0)


def test_cycle_is_named(tmp_path):
    text = BASE.replace("{id: reward, kind: reward, deps: [rollout]}", "{id: reward, kind: reward, deps: [rollout, advantage]}")
    msgs = [p.message for p in problems(tmp_path, text)]
    assert any("dependency cycle reward -> advantage -> reward" in m for m in msgs)


def test_unreachable_nodes(tmp_path):
    text = BASE.replace("{id: reward, kind: reward, deps: [rollout]}", "{id: reward, kind: reward, deps: [advantage]}")
    msgs = [p.message for p in problems(tmp_path, text)]
    assert any("not reachable from any source node" in m for m in msgs)
    assert any("cycle reward -> advantage -> reward" in m for m in msgs)


def test_missing_producer_suggests_dependency(tmp_path):
    text = BASE.replace("deps: [advantage, old_logprob]", "deps: [old_logprob]")
    (p,) = problems(tmp_path, text)
    assert "'actor_update' consumes 'advantages' but no upstream node produces it; add 'advantage' to its deps" in p.message


def test_two_producers_of_one_key(tmp_path):
    text = BASE.replace("    trainer:", "").replace(
        "  - id: actor_update",
        "  - {id: old2, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {output: old_logprobs}}\n  - id: actor_update",
    ).replace("deps: [advantage, old_logprob]", "deps: [advantage, old_logprob, old2]")
    (p,) = problems(tmp_path, text)
    assert "produced by several upstream nodes (old2, old_logprob)" in p.message


def test_weights_from_must_name_a_trainer_of_the_same_model(tmp_path):
    text = BASE.replace("weights_from: actor_update", "weights_from: old_logprob")
    (p,) = problems(tmp_path, text)
    assert p.path == ("nodes", 0, "weights_from") and "'old_logprob' does not train" in p.message


def test_strategy_the_kind_cannot_use(tmp_path):
    text = BASE.replace("kind: logprob, deps: [rollout], mesh: train", "kind: logprob, strategy: vllm, deps: [rollout], mesh: train")
    text = text.replace("{id: reward, kind: reward, deps: [rollout]}", "{id: reward, kind: reward, deps: [rollout], strategy: vllm}")
    msgs = {p.path: p.message for p in problems(tmp_path, text)}
    assert "cannot use strategy 'vllm'; expected one of: megatron" in msgs[("nodes", 3, "strategy")]
    assert "compute node" in msgs[("nodes", 1, "strategy")]


def test_mesh_backend_without_strategy(tmp_path):
    text = BASE.replace("train: megatron:d2", "train: fsdp:d2")
    msgs = [p.message for p in problems(tmp_path, text)]
    assert any("backend 'fsdp' has no strategy in this engine (available: megatron, vllm)" in m for m in msgs)


def test_batch_arithmetic_says_which_numbers(tmp_path):
    (p,) = problems(tmp_path, BASE.replace("mini_batch_size: 4", "mini_batch_size: 3"))
    assert "mini_batch_size 3 does not divide data.train_batch_size 8" in p.message
    text = BASE.replace("    params: {mini_batch_size: 4}", "    options: {micro_batch_size: 3}\n    params: {mini_batch_size: 4}")
    msgs = [p.message for p in problems(tmp_path, text)]
    assert any("4 prompts x 4 samples = 16 samples, which do not split into 2 data-parallel ranks x micro_batch_size 3" in m for m in msgs)


def test_cluster_too_small(tmp_path):
    msgs = [p.message for p in problems(tmp_path, BASE.replace("devices_per_node: 4", "devices_per_node: 2"))]
    assert any("3" in m and "2" in m and "device" in m for m in msgs)


def test_overrides_typed_by_id_and_checked(tmp_path):
    f = write(tmp_path, BASE)
    pipe = load_pipeline(f, ["data.train_batch_size=16", "nodes.actor_update.params.mini_batch_size=8",
                             "trainer.logger=[console]", "runtime.backend=local"])
    assert pipe.data.train_batch_size == 16 and pipe.nodes["actor_update"].params["mini_batch_size"] == 8
    assert pipe.trainer.logger == ("console",) and pipe.runtime.backend == "local"
    with pytest.raises(ConfigError) as info:
        load_pipeline(f, ["trainer.total_stpes=3"])
    (p,) = info.value.problems
    assert p.file == "<command line>" and "did you mean 'total_steps'" in p.message and "override 'trainer.total_stpes=3'" in p.message
    with pytest.raises(ConfigError, match="no node with id 'actr'"):
        load_pipeline(f, ["nodes.actr.params.epochs=2"])
    with pytest.raises(ConfigError, match="expected key.path=value"):
        load_pipeline(f, ["trainer.total_steps"])


def test_roll_spelling_is_accepted(tmp_path):
    text = BASE.replace("mesh: train, model: policy, params: {output: old_logprobs}",
                        "model: policy, params: {output: old_logprobs}, device_mapping: 'list(range(3,5))', "
                        "strategy_args: {strategy_name: megatron_infer, strategy_config: {tensor_model_parallel_size: 2}}")
    pipe = load_pipeline(write(tmp_path, text), ["cluster.devices_per_node=5"])
    node = pipe.nodes["old_logprob"]
    assert node.strategy == "megatron" and node.options["tensor_model_parallel_size"] == 2
    assert pipe.meshes[node.mesh].devices == (3, 4) and pipe.plan.meshes[node.mesh].devices == [3, 4]


def test_roll_spelling_sizes_its_mesh_as_the_roll_importer_does(tmp_path):
    """Expert tensor parallel follows tensor parallel unless written (megatron-core's default, as ROLL runs it)."""
    config = "{tensor_model_parallel_size: 2, expert_model_parallel_size: 2, sequence_parallel: true}"
    text = BASE.replace("mesh: train, model: policy, params: {output: old_logprobs}",
                        "model: policy, params: {output: old_logprobs}, device_mapping: '3-6', "
                        f"strategy_args: {{strategy_name: megatron_infer, strategy_config: {config}}}")
    pipe = load_pipeline(write(tmp_path, text), ["cluster.devices_per_node=7"])
    dims = pipe.plan.meshes[pipe.nodes["old_logprob"].mesh].dims
    assert (dims.dp, dims.tp, dims.ep, dims.etp) == (2, 2, 2, 2)


def test_device_mapping_is_never_evaluated(tmp_path):
    text = BASE.replace("mesh: train, model: policy, params: {output: old_logprobs}",
                        "model: policy, params: {output: old_logprobs}, device_mapping: \"__import__('os').getcwd()\"")
    (p,) = problems(tmp_path, text)
    assert p.path == ("nodes", 3, "device_mapping") and "cannot read device list" in p.message


@pytest.mark.parametrize("text,devices", [("list(range(0,4))", [0, 1, 2, 3]), ("range(2, 8, 2)", [2, 4, 6]),
                                          ("[1, 3]", [1, 3]), ("0,1,2", [0, 1, 2]), ("4-6", [4, 5, 6]), ([0, 2], [0, 2])])
def test_device_lists(text, devices):
    assert parse_device_list(text) == devices


@pytest.mark.parametrize("text, message", [([0, 2, 0], "names device(s) 0 more than once; expected each device once"),
                                           ("1,1", "names device(s) 1 more than once"),
                                           ("\u0663-\u0665", "cannot read device list"),  # Arabic-Indic digits
                                           ("0,\u0661", "cannot read device list")])
def test_device_lists_name_each_device_once_in_ascii_digits(text, message):
    with pytest.raises(ValueError) as info:
        parse_device_list(text)
    assert message in str(info.value)


def run_cli(*args) -> subprocess.CompletedProcess:
    """`python -m siirl_dag.main ARGS` called in this process: its exit status and what it printed."""
    from siirl_dag.main import main

    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's own refusals
            code = exc.code
    return subprocess.CompletedProcess(args, code, out.getvalue(), err.getvalue())


def run_cli_process(*args) -> subprocess.CompletedProcess:
    """The same command as a process of its own: the exit status and output a user's shell sees."""
    return subprocess.run([sys.executable, "-m", "siirl_dag.main", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("args", [["validate", "--json"], ["validate"], ["plan", "--json"], ["plan"]],
                         ids=lambda a: " ".join(a))
def test_output_into_a_pipe_whose_reader_left_ends_quietly(args):
    """`validate --json | head`: the reader is gone before the output is written (SIGPIPE's exit status)."""
    import os

    read, write = os.pipe()
    os.close(read)
    graph = str(Path(__file__).resolve().parents[1] / "graphs" / "qwen3_30b_a3b_moe.yaml")
    try:
        res = subprocess.run([sys.executable, "-m", "siirl_dag.main", args[0], graph, *args[1:]], stdout=write,
                             stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert res.returncode == 141 and "Traceback" not in res.stderr and "Error" not in res.stderr, res.stderr


def test_validate_and_a_refused_run_do_not_load_torch(tmp_path, tiny_model_dir):
    """Checking a pipeline takes about a second: torch (and Ray) load only for a run whose YAML, data
    and checkpoint passed."""
    code = "import sys; from siirl_dag.main import main; rc = main(sys.argv[1:]); print(rc, 'torch' in sys.modules)"
    bad = write(tmp_path, BASE.replace("total_steps", "total_step"), "bad.yaml")
    no_data = write(tmp_path, BASE.replace("no/such/model", tiny_model_dir).replace("train.parquet", "missing.parquet"),
                    "no_data.yaml")
    for args, out in [(["validate", str(write(tmp_path, BASE))], "0 False"), ([str(bad)], "2 False"),
                      ([str(no_data)], "2 False")]:
        res = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120)
        assert res.stdout.splitlines()[-1] == out, res.stderr


def test_cli_validate_ok_and_errors(tmp_path):
    ok = run_cli_process("validate", str(write(tmp_path, BASE)))
    assert ok.returncode == 0 and "is valid" in ok.stdout and "actor_update" in ok.stdout
    bad = write(tmp_path, BASE.replace("total_steps", "total_step"), "bad.yaml")
    res = run_cli_process("validate", str(bad))
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert f"{bad}:{line_of(bad.read_text(), 'total_step')}:11: trainer.total_step: unknown key" in res.stderr
    js = run_cli("validate", str(bad), "--json")
    assert js.returncode == 2 and json.loads(js.stdout)["errors"][0]["path"] == "trainer.total_step"
    missing = run_cli("validate", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "no such file" in missing.stderr and "Traceback" not in missing.stderr


def test_cli_plan_alloc_json():
    res = run_cli("plan", "--alloc", "vllm:d2t4+megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)", "--json")
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["world_size"] == 24
    assert out["components"][1]["ep"] == 4 and out["components"][1]["etp"] == 1
    bad = run_cli("plan", "--alloc", "d4t2", "--json")
    assert bad.returncode == 2 and "backend" in bad.stdout


def test_strategy_options_are_checked_with_suggestions(tmp_path):
    text = BASE.replace("options: {n: 4}", "options: {n: 4, temprature: 0.7}")
    (p,) = problems(tmp_path, text)
    assert p.path == ("nodes", 0, "options", "temprature") and "did you mean 'temperature'" in p.message


def test_nodes_sharing_an_engine_share_options(tmp_path):
    text = BASE.replace("params: {output: old_logprobs}}", "params: {output: old_logprobs}, options: {micro_batch_size: 2}}")
    text = text.replace("    params: {mini_batch_size: 4}", "    options: {lr: 0.001}\n    params: {mini_batch_size: 4}")
    pipe = load_pipeline(write(tmp_path, text))
    old, upd = pipe.nodes["old_logprob"].options, pipe.nodes["actor_update"].options
    assert old == upd and old["micro_batch_size"] == 2 and old["lr"] == 0.001
    clash = text.replace("options: {lr: 0.001}", "options: {lr: 0.001, micro_batch_size: 4}")
    (p,) = problems(tmp_path, clash)
    assert p.path == ("nodes", 4, "options", "micro_batch_size") and "conflicts with 2 on 'old_logprob'" in p.message


def test_strategy_rules_across_options_run_at_validation(tmp_path):
    text = BASE.replace("    params: {mini_batch_size: 4}", "    options: {lr: 1.0e-6, min_lr: 1.0e-5}\n    params: {mini_batch_size: 4}")
    (p,) = problems(tmp_path, text)
    assert p.path == ("nodes", 4, "options", "min_lr") and "min_lr <= lr" in p.message
    assert p.line == line_of(text, "min_lr")


def test_run_refuses_bad_input_before_starting_anything(tmp_path, tiny_model_dir):
    """Missing model, missing data, damaged checkpoint: exit 2, one clear message, no traceback."""
    text = BASE.replace("no/such/model", tiny_model_dir).replace("train.parquet", str(tmp_path / "missing.parquet"))
    res = run_cli(str(write(tmp_path, text)))
    assert res.returncode == 2 and "missing.parquet" in res.stderr and "Traceback" not in res.stderr
    res = run_cli(str(write(tmp_path, BASE)))
    assert res.returncode == 2 and "model directory 'no/such/model' not found" in res.stderr
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a"], "data_source": ["gsm8k"], "ground_truth": ["1"]}), tmp_path / "t.parquet")
    text = BASE.replace("no/such/model", tiny_model_dir).replace("train.parquet", str(tmp_path / "t.parquet"))
    res = run_cli(str(write(tmp_path, text)))
    assert res.returncode == 2 and f":{line_of(text, 'train_batch_size')}:" in res.stderr
    assert "data.train_batch_size: the data has 1 rows, fewer than one batch of 8" in res.stderr
    pq.write_table(pa.table({"prompt": ["a"] * 8, "data_source": ["gsm8k"] * 8, "ground_truth": ["1"] * 8}), tmp_path / "t.parquet")
    bad_ckpt = tmp_path / "ckpt"
    bad_ckpt.mkdir()
    (bad_ckpt / "trainer_state.json").write_text("{not json")
    res = run_cli(str(write(tmp_path, text)), "trainer.resume_mode=resume_path", f"trainer.resume_from_path={bad_ckpt}")
    assert res.returncode == 2 and "trainer_state.json is unreadable" in res.stderr and "Traceback" not in res.stderr


def test_prompts_no_scorer_grades_and_a_scorer_that_does_not_import_are_refused(tmp_path, tiny_model_dir):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["a"] * 8, "data_source": ["gsm8k"] * 5 + ["my/set"] * 3,
                             "ground_truth": ["1"] * 8}), tmp_path / "t.parquet")
    text = BASE.replace("no/such/model", tiny_model_dir).replace("train.parquet", str(tmp_path / "t.parquet"))
    res = run_cli(str(write(tmp_path, text)))
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert (f":{line_of(text, 'train_files')}:" in res.stderr and "data.train_files: node 'reward': 3 prompt(s) have "
            "data_source 'my/set', which no built-in scorer grades" in res.stderr)
    res = run_cli(str(write(tmp_path, text)), "nodes.reward.params.scorer=no_such_module:score")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert "params.scorer: scorer 'no_such_module:score': cannot import module 'no_such_module'" in res.stderr


def _long_and_chat_prompts(tmp_path, tiny_model_dir) -> str:
    """A pipeline whose training prompts are 8 chats and whose validation prompts are 8 strings, one
    of them 40 tokens long (row 6)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    prompts = ["1+1=?"] * 6 + ["word " * 8, "x"]
    pq.write_table(pa.table({"prompt": prompts, "data_source": ["gsm8k"] * 8, "ground_truth": ["2"] * 8}),
                   tmp_path / "t.parquet")
    chats = [[{"role": "user", "content": "1+1=?"}]] * 8
    pq.write_table(pa.table({"prompt": chats, "data_source": ["gsm8k"] * 8, "ground_truth": ["2"] * 8}),
                   tmp_path / "v.parquet")
    return BASE.replace("no/such/model", tiny_model_dir).replace(
        "train_files: train.parquet", f"train_files: {tmp_path / 'v.parquet'}\n  val_files: {tmp_path / 't.parquet'}")


def test_overlong_prompts_are_left_out_when_asked_and_saying_so(tmp_path, tiny_model_dir):
    from siirl_dag.trainer.loop import Trainer

    text, said = _long_and_chat_prompts(tmp_path, tiny_model_dir), []
    trainer = Trainer(load_pipeline(write(tmp_path, text), ["data.max_prompt_length=32", "data.filter_overlong_prompts=true"],
                                    for_run=True), progress=said.append)
    assert len(trainer.train_data) == 8 and len(trainer.val_data) == 7
    assert [row["index"] for row in trainer.val_data.rows] == [0, 1, 2, 3, 4, 5, 7]  # ids stay the files' rows
    assert said == ["[data] data.val_files: left out 1 of 8 prompts longer than data.max_prompt_length = 32 tokens "
                    "(as node 'rollout' counts them)"]
    pipe = load_pipeline(write(tmp_path, text), ["data.max_prompt_length=8", "data.filter_overlong_prompts=true"],
                         for_run=True)
    with pytest.raises(ConfigError) as info:
        Trainer(pipe, progress=said.append)
    (p,) = info.value.problems
    assert p.path == ("data", "train_files") and "every prompt is longer than data.max_prompt_length = 8" in p.message


def test_prompts_longer_than_max_prompt_length_are_refused_before_start(tmp_path, tiny_model_dir):
    """Counted as the engine tokenizes them (a chat list through the template), named by file and row."""
    from siirl_dag.trainer.loop import Trainer

    text = _long_and_chat_prompts(tmp_path, tiny_model_dir)
    res = run_cli(str(write(tmp_path, text)), "data.max_prompt_length=32")
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert (f":{line_of(text, 'val_files')}:3: data.val_files: node 'rollout': 1 of 8 prompts do not fit "
            f"data.max_prompt_length = 32 tokens (chat_template: false): '{tmp_path / 't.parquet'}' row 6 has "
            "40 tokens; expected 1 to 32 tokens") in res.stderr
    assert "train_files" not in res.stderr  # the chat prompts are short even through the template
    pipe = load_pipeline(write(tmp_path, text), ["data.max_prompt_length=8"], for_run=True)
    with pytest.raises(ConfigError) as info:
        Trainer(pipe)
    train, val = info.value.problems
    assert train.path == ("data", "train_files") and "8 of 8 prompts" in train.message
    assert val.path == ("data", "val_files") and "1 of 8 prompts" in val.message
    model = Trainer(load_pipeline(write(tmp_path, text), ["data.max_prompt_length=40"], for_run=True)).pipe.models["policy"]
    assert model.load_tokenizer() is model.load_tokenizer(), "read once per process (the reward decodes every step)"
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer_config.json").write_text("{not json")
    pipe = load_pipeline(write(tmp_path, text), [f"models.policy.tokenizer={tmp_path / 'tok'}"], for_run=True)
    with pytest.raises(ConfigError) as info:
        Trainer(pipe)
    (p,) = info.value.problems
    assert p.path == ("models", "policy", "tokenizer") and p.file == "<command line>"  # where it was written
    assert f"the tokenizer in '{tmp_path / 'tok'}' does not load" in p.message
    (tmp_path / "tok" / "tokenizer_config.json").unlink()  # a model's config alone: transformers makes an empty tokenizer
    shutil.copy(Path(tiny_model_dir) / "config.json", tmp_path / "tok")
    with pytest.raises(ConfigError) as info:
        Trainer(pipe)
    (p,) = info.value.problems
    assert f"'{tmp_path / 'tok'}' holds no tokenizer (no vocabulary)" in p.message


def test_a_later_run_counts_prompt_tokens_without_the_tokenizer(tmp_path, tiny_model_dir, monkeypatch):
    """The counts are kept on disk (data/row_cache.py): a later process on the same files and tokenizer
    refuses the same prompt, in the same words, without loading transformers (seconds to import)."""
    from siirl_dag.trainer.loop import Trainer

    monkeypatch.setenv("SIIRL_DAG_CACHE", str(tmp_path / "cache"))
    f = str(write(tmp_path, _long_and_chat_prompts(tmp_path, tiny_model_dir)))
    with pytest.raises(ConfigError) as info:
        Trainer(load_pipeline(f, ["data.max_prompt_length=32"], for_run=True))
    code = "import sys; from siirl_dag.main import main; rc = main(sys.argv[1:]); print(rc, 'transformers' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code, f, "data.max_prompt_length=32"], capture_output=True, text=True,
                         timeout=120)
    assert res.stdout.splitlines()[-1] == "2 False", res.stderr
    assert info.value.problems[0].message in res.stderr and "row 6 has 40 tokens" in res.stderr


def test_samples_per_prompt_above_vllms_limit_are_refused_at_validation(tmp_path, monkeypatch):
    (p,) = problems(tmp_path, BASE, ["nodes.rollout.options.n=16386"])
    assert p.path == ("nodes", 0, "options", "n") and p.file == "<command line>"
    assert "16386 samples per prompt are above vLLM's limit; expected at most 16384" in p.message
    load_pipeline(write(tmp_path, BASE), ["nodes.rollout.options.n=16384"])
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "20000")
    load_pipeline(write(tmp_path, BASE), ["nodes.rollout.options.n=16386"])


def test_prompt_and_response_must_fit_the_rollout_context(tmp_path, tiny_model_dir):
    text = BASE.replace("options: {n: 4}", "options: {n: 4, max_model_len: 64}")
    (p,) = problems(tmp_path, text, ["data.max_prompt_length=60", "data.max_response_length=8"])
    assert p.path == ("nodes", 0, "options", "max_model_len")
    assert "max_prompt_length + data.max_response_length = 68 do not fit max_model_len = 64" in p.message
    limit = json.loads((Path(tiny_model_dir) / "config.json").read_text())["max_position_embeddings"]
    (p,) = problems(tmp_path, BASE.replace("no/such/model", tiny_model_dir), [f"data.max_prompt_length={limit}"])
    assert f"do not fit the model's max_position_embeddings (max_model_len: null) = {limit}" in p.message


@pytest.mark.parametrize("override", ["name=../../x", "name=a b", "trainer.experiment_name=/abs",
                                      "trainer.project_name=.hidden"])
def test_output_folder_names_are_one_plain_folder(tmp_path, override):
    (p,) = problems(tmp_path, BASE, [override])
    assert "expected one folder name of letters, digits" in p.message


def test_an_unreachable_ray_cluster_is_refused_at_once(tmp_path, tiny_model_dir):
    import socket

    import pyarrow as pa
    import pyarrow.parquet as pq

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pq.write_table(pa.table({"prompt": ["a"] * 8, "data_source": ["gsm8k"] * 8, "ground_truth": ["1"] * 8}),
                   tmp_path / "t.parquet")
    text = BASE.replace("no/such/model", tiny_model_dir).replace("train.parquet", str(tmp_path / "t.parquet"))
    res = run_cli(str(write(tmp_path, text)), "--address", f"127.0.0.1:{port}")  # (Ray would retry it for minutes)
    assert res.returncode == 2 and "Traceback" not in res.stderr, res.stderr
    assert f"<command line>: --address: nothing answers at 127.0.0.1:{port}" in res.stderr
    res = run_cli(str(write(tmp_path, text)), "runtime.backend=ray", "runtime.address=no-port")
    assert res.returncode == 2 and "runtime.address: 'no-port' is not host:port" in res.stderr, res.stderr


@pytest.mark.parametrize("dtype, vllm_dtype, bf16", [("float32", "float32", False), ("bfloat16", "bfloat16", True)])
def test_the_model_dtype_sets_each_engine_precision(tmp_path, dtype, vllm_dtype, bf16):
    pipe = load_pipeline(write(tmp_path, BASE), [f"models.policy.dtype={dtype}"])
    assert pipe.nodes["rollout"].options["dtype"] == vllm_dtype
    assert pipe.nodes["old_logprob"].options["bf16"] is bf16 and pipe.nodes["actor_update"].options["bf16"] is bf16


def test_a_written_precision_option_wins_over_the_model_dtype(tmp_path):
    text = BASE.replace("options: {n: 4}", "options: {n: 4, dtype: bfloat16}").replace(
        "params: {mini_batch_size: 4}", "params: {mini_batch_size: 4}\n    options: {bf16: true}")
    pipe = load_pipeline(write(tmp_path, text))
    assert pipe.nodes["rollout"].options["dtype"] == "bfloat16"
    assert pipe.nodes["actor_update"].options["bf16"] is True and pipe.nodes["old_logprob"].options["bf16"] is True


def test_a_dtype_megatron_cannot_train_is_refused_at_the_model(tmp_path):
    found = problems(tmp_path, BASE.replace("dtype: float32", "dtype: float16"))
    assert found and all(p.path == ("models", "policy", "dtype") for p in found)
    assert "trains in bfloat16 or float32, not float16" in found[0].message
    assert line_of(BASE, "dtype: float32") == found[0].line


@pytest.mark.parametrize("override, path", [
    ("cluster.devices_per_node=4.0", ("cluster", "devices_per_node")),
    ("data.train_batch_size=8.0", ("data", "train_batch_size")),
    ("trainer.total_steps=2.0", ("trainer", "total_steps")),
    ("runtime.staleness=1.0", ("runtime", "staleness")),
    ("nodes.rollout.options.n=4.0", ("nodes", 0, "options", "n")),
    ("nodes.actor_update.params.mini_batch_size=4.0", ("nodes", 4, "params", "mini_batch_size")),
])
def test_an_integer_is_a_real_int_not_a_whole_float(tmp_path, override, path):
    (p,) = problems(tmp_path, BASE, [override])
    assert p.path == path and p.file == "<command line>"
    assert p.message.startswith(f"{override.split('=')[1]} is a float; expected integer")


@pytest.mark.parametrize("override, path", [
    ("nodes.rollout.options.temperature=.nan", ("nodes", 0, "options", "temperature")),
    ("nodes.actor_update.options.lr=.nan", ("nodes", 4, "options", "lr")),
    ("runtime.weight_sync_bucket_mb=.inf", ("runtime", "weight_sync_bucket_mb")),
    ("runtime.cpus_per_rank=.nan", ("runtime", "cpus_per_rank")),
])
def test_a_number_is_finite(tmp_path, override, path):
    (p,) = problems(tmp_path, BASE, [override])
    assert p.path == path and "is not a finite number; expected a finite number" in p.message


def test_a_whole_float_or_nan_in_the_file_is_located(tmp_path):
    text = BASE.replace("devices_per_node: 4", "devices_per_node: 4.0")
    (p,) = problems(tmp_path, text)
    assert (p.line, p.message) == (line_of(text, "devices_per_node"), "4.0 is a float; expected integer")
    assert str(p).startswith(f"{p.file}:{p.line}:{p.col}: cluster.devices_per_node: 4.0 is a float")
    text = BASE.replace("options: {n: 4}", "options: {n: 4, top_p: .nan}")
    (p,) = problems(tmp_path, text)
    assert p.path == ("nodes", 0, "options", "top_p") and p.line == line_of(text, "top_p")
    assert p.message == "nan is not a finite number; expected a finite number"


def test_strategies_validate_their_options_as_strictly():
    from siirl_dag.strategies.megatron.options import resolve
    from siirl_dag.strategies.vllm.options import resolve_options

    with pytest.raises(ConfigError) as info:
        resolve_options({"n": 2.0, "temperature": float("nan")})
    assert {p.path for p in info.value.problems} == {("options", "n"), ("options", "temperature")}
    with pytest.raises(ConfigError) as info:
        resolve({"micro_batch_size": 2.0, "lr": float("inf")})
    assert {p.path for p in info.value.problems} == {("options", "micro_batch_size"), ("options", "lr")}


@pytest.mark.parametrize("override, bound", [("cluster.nodes=100000000", "<= 4096"),
                                             ("cluster.devices_per_node=100000000", "<= 256"),
                                             ("data.seed=-1", ">= 0")])
def test_sizes_and_seed_have_bounds(tmp_path, override, bound):
    (p,) = problems(tmp_path, BASE, [override])
    key, value = override.split("=")
    assert format_path(p.path) == key and p.message.startswith(f"{value} is out of range; expected a value >= ")
    assert bound in p.message


def test_an_alias_bomb_is_refused_at_the_alias(tmp_path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    text = "\n".join(levels) + "\nname: *a8\n"
    (p,) = problems(tmp_path, text)
    assert p.message == "alias '*a3' expands the document past 100000 aliased values; expected aliases of small sections"
    assert p.line == line_of(text, "a4:") and text.splitlines()[p.line - 1][p.col - 1:].startswith("*a3")


@pytest.mark.parametrize("text, message, where", [
    ("a: " + "[" * 5000, "more than 100 levels of nesting; expected a flatter document", (1, 103)),
    ("a: &x [1, *x]\n", "alias '*x' is inside the node it names (a cycle); expected an alias of a finished node", (1, 11)),
])
def test_deep_or_cyclic_yaml_is_one_located_error(tmp_path, text, message, where):
    (p,) = problems(tmp_path, text)
    assert (p.message, (p.line, p.col)) == (message, where)


@pytest.mark.parametrize("text", ["range(0, 10000000000)", "list(range(0, 10**30))".replace("10**30", "1" + "0" * 30),
                                  "0-10000000000"])
def test_device_lists_are_bounded_before_they_are_built(text):
    with pytest.raises(ValueError, match=r"names more than 1048576 devices, the most a cluster may have; expected"):
        parse_device_list(text)


def model_dir(tmp_path, config: str, *files: str):
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(config)
    for name in files:
        (folder / name).write_text("")
    return folder


@pytest.mark.parametrize("config, message", [
    ("{not json", "config.json is unreadable (Expecting property name"),
    ("[1, 2]", "config.json holds a list; expected the model's Hugging Face config.json (a JSON object)"),
    ('{"num_hidden_layers": "x"}', "config.json: num_hidden_layers: 'x' is a string; expected integer"),
])
def test_a_corrupt_model_config_is_located_at_the_model(tmp_path, config, message):
    text = BASE.replace("no/such/model", str(model_dir(tmp_path, config)))
    (p,) = problems(tmp_path, text)
    assert p.path == ("models", "policy", "path") and message in p.message and p.line == line_of(text, "policy:")


@pytest.mark.parametrize("override, message", [
    ("{num_hidden_layers: abc}", "'abc' is a string; expected integer"),
    ("{num_experts: x}", "'x' is a string; expected integer or null"),
    ("{num_hidden_layers: -2}", "-2 is out of range; expected a value >= 1"),
    ("{num_hidden_layers: 2.0}", "2.0 is a float; expected integer"),
    ("{num_hidden_layers: null}", "None is null; expected integer"),
])
def test_override_config_values_placement_reads_are_checked(tmp_path, override, message):
    text = BASE.replace("dtype: float32}", f"dtype: float32,\n             override_config: {override}}}")
    (p,) = problems(tmp_path, text)
    assert p.path[:3] == ("models", "policy", "override_config") and p.message == message
    assert p.line == line_of(text, "override_config")


ROLL_NODE = ("model: policy, params: {output: old_logprobs}, device_mapping: 'list(range(3,5))', "
             "strategy_args: {strategy_name: megatron_infer, strategy_config: {tensor_model_parallel_size: TP}}")


@pytest.mark.parametrize("tp", ["0", "'2'", "x"])
def test_roll_parallel_sizes_must_be_positive_ints(tmp_path, tp):
    text = BASE.replace("mesh: train, model: policy, params: {output: old_logprobs}", ROLL_NODE.replace("TP", tp))
    (p,) = problems(tmp_path, text, ["cluster.devices_per_node=5"])
    assert p.path == ("nodes", 3, "options", "tensor_model_parallel_size") and p.line == line_of(text, "device_mapping")
    assert p.message.endswith("is not a parallel size; expected an integer >= 1 (it sizes the mesh of device_mapping)")


def test_a_null_roll_parallel_size_is_unset(tmp_path):
    text = BASE.replace("mesh: train, model: policy, params: {output: old_logprobs}", ROLL_NODE.replace("TP", "null"))
    pipe = load_pipeline(write(tmp_path, text), ["cluster.devices_per_node=5"])
    assert pipe.meshes["old_logprob"].alloc == "megatron:d2"


USER_KINDS = {"kind_raises": "raise RuntimeError('boom at import')\n", "kind_syntax": "def fn(:\n",
              "kind_exits": "import sys\nsys.exit(3)\n", "kind_plain": "def fn(batch, ctx):\n    return {}\n"}


@pytest.mark.parametrize("kind, message", [
    (":", "unknown node kind ':'; expected one of: "),
    (".x:y", "cannot import module '.x' of node kind '.x:y' (TypeError: "),
    ("kind_raises:fn", "cannot import module 'kind_raises' of node kind 'kind_raises:fn' (RuntimeError: boom at import); "
                       "expected an importable module"),
    ("kind_syntax:fn", "cannot import module 'kind_syntax' of node kind 'kind_syntax:fn' (SyntaxError: "),
    ("kind_exits:fn", "cannot import module 'kind_exits' of node kind 'kind_exits:fn' (SystemExit: 3)"),
    ("kind_plain:fn", "'kind_plain:fn' is not a node kind; expected a function decorated with @siirl_dag.registry.node_kind"),
    ("os:getcwd", "'os:getcwd' is not a node kind; expected a function decorated with @siirl_dag.registry.node_kind"),
])
def test_a_bad_user_kind_is_a_located_problem(tmp_path, monkeypatch, kind, message):
    for name, source in USER_KINDS.items():
        (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    text = BASE.replace("{id: reward, kind: reward,", f"{{id: reward, kind: '{kind}',")
    (p,) = problems(tmp_path, text)
    assert p.path == ("nodes", 1, "kind") and p.line == line_of(text, "id: reward") and message in p.message


@pytest.mark.parametrize("override", ["a..b=1", "trainer.=1", ".trainer=1"])
def test_an_override_with_an_empty_key_part_is_refused_on_the_command_line(tmp_path, override):
    (p,) = problems(tmp_path, BASE, [override])
    key = override.split("=")[0]
    assert p.file == "<command line>" and p.line is None
    assert f"key '{key}' has an empty part; expected names joined by single dots" in p.message


def test_a_run_needs_model_weights_and_an_existing_tokenizer(tmp_path):
    text = BASE.replace("no/such/model", str(model_dir(tmp_path, "{}")))
    with pytest.raises(ConfigError) as info:
        load_pipeline(write(tmp_path, text), for_run=True)
    (p,) = info.value.problems
    assert p.path == ("models", "policy", "path") and p.line == line_of(text, "policy:")
    assert "has no weights; expected *.safetensors or *.bin files (or their *.index.json) beside config.json" in p.message
    model_dir(tmp_path, "{}", "model.safetensors.index.json")
    load_pipeline(write(tmp_path, text), for_run=True)
    with pytest.raises(ConfigError) as info:
        load_pipeline(write(tmp_path, text), ["models.policy.tokenizer=no/such/tokenizer"], for_run=True)
    (p,) = info.value.problems
    assert p.path == ("models", "policy", "tokenizer") and "tokenizer directory 'no/such/tokenizer' not found" in p.message
    warned = load_pipeline(write(tmp_path, text), ["models.policy.tokenizer=no/such/tokenizer"]).warnings
    assert (("models", "policy", "tokenizer"), "warning") in [(w.path, w.severity) for w in warned]


def test_a_one_of_reports_the_branch_of_the_values_type(tmp_path):
    text = BASE.replace("train: megatron:d2", "train: {alloc: 'megatron:d2', colocate: gen}")
    (p,) = problems(tmp_path, text)
    assert p.path == ("meshes", "train", "colocate") and "did you mean 'colocate_with'?" in p.message
    assert p.line == line_of(text, "colocate")
    (p,) = problems(tmp_path, BASE.replace("train_files: train.parquet", "train_files: []"))
    assert p.path == ("data", "train_files") and p.message == "[] is too short; expected at least 1 item(s)"


def test_an_alias_bomb_in_an_override_is_refused(tmp_path):
    levels = ["&a0 [x, x, x, x, x, x, x, x, x, x]"] + [f"&a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    (p,) = problems(tmp_path, BASE, [f"description=[{', '.join(levels)}]"])
    assert p.file == "<command line>" and "expands the document past 100000 aliased values" in p.message


FILTERED = BASE.replace("  - {id: advantage, kind: advantage, deps: [reward]}\n",
                        "  - {id: filter, kind: filter_groups, deps: [reward], params: {max_gen_batches: 3}}\n"
                        "  - {id: advantage, kind: advantage, deps: [filter]}\n")


def test_dynamic_sampling_phases_are_shown(tmp_path):
    from siirl_dag.cli.validate import summary

    pipe = load_pipeline(write(tmp_path, FILTERED))
    assert pipe.to_json()["dynamic_sampling"] == {"filter": "filter", "rerun": ["rollout", "reward", "filter"],
                                                  "then": ["advantage", "old_logprob", "actor_update"],
                                                  "max_gen_batches": 3}
    assert ("dynamic sampling: rollout, reward, filter run again on more prompts until 8 are kept (at most 3 "
            "rounds); then advantage, old_logprob, actor_update on those") in summary(pipe)
    assert load_pipeline(write(tmp_path, BASE)).to_json()["dynamic_sampling"] is None


def test_dynamic_sampling_refuses_a_second_filter_and_training_before_it(tmp_path):
    text = FILTERED.replace("  - {id: advantage, kind: advantage, deps: [filter]}\n",
                            "  - {id: advantage, kind: advantage, deps: [filter]}\n"
                            "  - {id: again, kind: filter_groups, deps: [actor_update]}\n")
    (p,) = problems(tmp_path, text)
    assert p.path == ("nodes", 4, "kind") and "a second node that filters rows ('filter' is the first)" in p.message
    assert p.line == line_of(text, "id: again")
    text = FILTERED.replace("{id: filter, kind: filter_groups, deps: [reward],",
                            "{id: filter, kind: filter_groups, deps: [actor_update],")
    (p,) = problems(tmp_path, text.replace("{id: advantage, kind: advantage, deps: [filter]}",
                                           "{id: advantage, kind: advantage, deps: [reward]}"))
    assert p.path == ("nodes", 2, "deps")
    assert "'actor_update' would train in each round; expected no training node upstream of 'filter'" in p.message


@pytest.mark.parametrize("key, value, accepted", [
    ("policy_loss", "gpso", "'vanilla', 'gspo'"),
    ("loss_agg_mode", "token_sum", "'token-sum'"),
    ("kl_loss_type", "k3++", "'low_var_kl+'"),
    ("rollout_is", "tokens", "'off', 'token', 'sequence'"),
])
def test_algorithm_names_are_checked_with_the_accepted_ones_listed(tmp_path, key, value, accepted):
    text = BASE.replace("params: {mini_batch_size: 4}", f"params: {{mini_batch_size: 4, {key}: {value}}}")
    (p,) = problems(tmp_path, text)
    assert p.path == ("nodes", 4, "params", key) and accepted in p.message and p.line == line_of(text, key)


def test_overlong_buffer_must_fit_the_response_limit(tmp_path):
    text = BASE.replace("{id: reward, kind: reward, deps: [rollout]}",
                        "{id: reward, kind: reward, deps: [rollout], params: {overlong_buffer_len: 512}}")
    (p,) = problems(tmp_path, text)
    assert p.path == ("nodes", 1, "params", "overlong_buffer_len")
    assert "512 tokens do not fit inside data.max_response_length" in p.message


def test_one_step_off_needs_staleness_and_meshes_of_its_own(tmp_path):
    pipe = load_pipeline(write(tmp_path, BASE), ["runtime.schedule=one_step_off"])  # its staleness defaults to 1
    assert pipe.runtime.staleness == 1
    assert load_pipeline(write(tmp_path, BASE), ["runtime.schedule=async"]).runtime.staleness == 0
    (p,) = problems(tmp_path, BASE, ["runtime.schedule=one_step_off", "runtime.staleness=0"])
    assert p.path == ("runtime", "staleness") and "expected runtime.staleness >= 1" in p.message
    colocated = BASE.replace("gen: vllm:d1", "gen: {alloc: 'vllm:d2', colocate_with: train}")
    (p,) = problems(tmp_path, colocated, ["runtime.schedule=one_step_off", "runtime.staleness=1"])
    assert p.path == ("nodes", 0, "mesh") and "shares devices [0, 1] with the training side" in p.message
    # dynamic sampling: the filter and its ancestors generate ahead, round after round
    filtered = load_pipeline(write(tmp_path, FILTERED), ["runtime.schedule=one_step_off", "runtime.staleness=1"])
    assert phases_of(filtered).first == {"rollout", "reward", "filter"}
    assert schedule.generating_nodes(filtered) == phases_of(filtered).first | {"advantage"}  # reads only kept rows
    load_pipeline(write(tmp_path, FILTERED), ["runtime.schedule=async", "runtime.staleness=1",
                                               "runtime.partial_rollout=true", "runtime.partial_rollout_tokens=4"])
    pipe = load_pipeline(write(tmp_path, BASE), ["runtime.schedule=one_step_off", "runtime.staleness=1"])
    assert pipe.runtime.schedule == "one_step_off"


def test_async_takes_any_staleness_and_refuses_shared_devices(tmp_path):
    for k in (0, 2):  # 0: the sync schedule's order
        pipe = load_pipeline(write(tmp_path, BASE), ["runtime.schedule=async", f"runtime.staleness={k}"])
        assert (pipe.runtime.schedule, schedule.depth(pipe.runtime)) == ("async", k)
    colocated = BASE.replace("gen: vllm:d1", "gen: {alloc: 'vllm:d2', colocate_with: train}")
    (p,) = problems(tmp_path, colocated, ["runtime.schedule=async", "runtime.staleness=2"])
    assert p.path == ("nodes", 0, "mesh") and "runs ahead under async" in p.message
    (p,) = problems(tmp_path, BASE, ["runtime.schedule=asynchronous"])
    assert p.path == ("runtime", "schedule") and "'async'" in p.message


def test_partial_rollouts_need_a_schedule_that_runs_ahead_and_a_kind_that_resumes(tmp_path):
    (p,) = problems(tmp_path, BASE, ["runtime.partial_rollout=true"])
    assert p.path == ("runtime", "partial_rollout") and "expected runtime.schedule one_step_off or async" in p.message
    pipe = load_pipeline(write(tmp_path, BASE), ["runtime.schedule=async", "runtime.staleness=1",
                                                 "runtime.partial_rollout=true", "runtime.partial_rollout_tokens=4"])
    assert "partial rollouts: segments of 4 tokens" in schedule.describe(pipe)
    agent = Path(__file__).resolve().parents[1] / "graphs" / "tiny_agent_tools_cpu.yaml"
    with pytest.raises(ConfigError) as err:
        load_pipeline(agent, ["runtime.schedule=async", "runtime.staleness=1", "runtime.partial_rollout=true"])
    (p,) = [p for p in err.value.problems if p.path[-1] == "kind"]
    assert "(kind agent_rollout) cannot continue its samples in segments" in p.message


def test_plan_and_the_pictures_show_the_schedule(tmp_path):
    from siirl_dag.visualize import mermaid

    f = write(tmp_path, BASE)
    res = run_cli("plan", str(f), "runtime.schedule=async", "runtime.staleness=2")
    assert res.returncode == 0, res.stderr
    assert "schedule async: rollout, reward, advantage run up to 2 batches ahead of old_logprob, " in res.stdout
    js = json.loads(run_cli("plan", str(f), "runtime.schedule=async", "runtime.staleness=2", "--json").stdout)
    assert js["schedule"] == {"name": "async", "staleness": 2, "ahead": ["rollout", "reward", "advantage"], "depth": 2}
    assert "schedule" not in run_cli("plan", str(f)).stdout.split("cluster:")[0]
    drawn = mermaid.graph_mermaid(load_pipeline(f, ["runtime.schedule=one_step_off", "runtime.staleness=1"]))
    assert '-.->|"weights (one_step_off, ≤ 1 version behind)"|' in drawn


def test_log_probs_at_another_temperature_than_the_rollout_are_warned_at_their_line():
    tiny = Path(__file__).resolve().parents[1] / "graphs" / "tiny_grpo_cpu.yaml"
    assert not [w for w in load_pipeline(tiny).warnings if "temperature" in w.message]
    pipe = load_pipeline(tiny, ["nodes.rollout.options.temperature=0.7", "nodes.ref_logprob.params.temperature=0.7"])
    warned = {format_path(w.path): (w.line, w.message) for w in pipe.warnings if "temperature" in w.message}
    assert set(warned) == {"nodes[4].params.temperature"}  # actor_update; ref_logprob was given the rollout's
    assert warned["nodes[4].params.temperature"][1] == ("log-probs at temperature 1.0, but 'rollout' samples at 0.7, so "
                                                         "every ratio against its samples is off-policy; expected temperature: 0.7")


def test_exponents_without_a_dot_are_numbers_as_in_yaml_1_2(tmp_path):
    """YAML 1.1 reads `1e-6` as a string; every RL config written for Python means a float."""
    text = BASE.replace("params: {mini_batch_size: 4}", "params: {mini_batch_size: 4}\n    options: {lr: 1e-6}")
    assert load_pipeline(write(tmp_path, text)).nodes["actor_update"].options["lr"] == 1e-6
    pipe = load_pipeline(write(tmp_path, BASE), ["nodes.actor_update.options.lr=1e-4"])
    assert pipe.nodes["actor_update"].options["lr"] == 1e-4
    quoted = problems(tmp_path, BASE, ["nodes.actor_update.options.lr='1e-4'"])
    assert any("'1e-4' is a string; expected number" in p.message for p in quoted)
