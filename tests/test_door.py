"""The door (#49): what a new user gets wrong is refused at once (exit 2, FILE:LINE, what is expected,
nothing started), or warned about when it runs but likely not as meant."""

from __future__ import annotations

import os
import signal
import textwrap
import time

import pytest

from siirl_dag.config import door, load_pipeline
from siirl_dag.config.yaml_loader import MAX_BYTES
from siirl_dag.errors import ConfigError
from siirl_dag.main import main
from test_checkpoint import tmp, write_checkpoint  # noqa: F401  (a pipeline of a tiny model, a faked checkpoint)

PIPELINE = textwrap.dedent("""\
    name: t
    cluster: {nodes: 1, devices_per_node: 8, device: cpu}
    models:
      policy:
        path: no/such/model
        dtype: float32
        override_config: {num_hidden_layers: 2, num_attention_heads: 4, num_key_value_heads: 2, hidden_size: 64, vocab_size: 100}
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
      - {id: actor_update, kind: actor_update, deps: [advantage, old_logprob], mesh: train, model: policy,
         params: {mini_batch_size: 4}}
    trainer: {total_steps: 2}
    """)


def write(tmp_path, text=PIPELINE):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    return f


def refused(path, overrides=(), **kw):
    with pytest.raises(ConfigError) as info:
        load_pipeline(path, list(overrides), **kw)
    return [p for p in info.value.problems if p.severity == "error"]


def warned(path, overrides=()):
    return [p for p in load_pipeline(path, list(overrides)).warnings
            if "not found (no config.json)" not in p.message and "does not exist; expected a parquet" not in p.message]


def cli(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


# ---- parallel sizes against the model ---------------------------------------------------------------------------

@pytest.mark.parametrize("mesh, alloc, message", [
    ("gen", "vllm:t3", "t3 (tensor parallel) does not divide the model's 4 attention heads; expected t dividing 4 (t1, t2, t4)"),
    ("train", "megatron:t3", "does not divide the model's 4 attention heads"),
    ("train", "megatron:t4", "t4 (tensor parallel) does not divide the model's 2 KV heads (num_key_value_heads); expected t1, t2"),
    ("train", "megatron:d2e2", "e2 (expert parallel) needs an MoE model, this one has num_experts=0; expected e1"),
    ("train", "megatron:p4", "p4 x vpp1 = 4 pipeline chunks for a model of 2 layers"),
])
def test_parallel_sizes_the_model_cannot_take_are_refused_at_the_mesh(tmp_path, mesh, alloc, message):
    text = PIPELINE.replace(f"{mesh}: {'vllm:d1' if mesh == 'gen' else 'megatron:d2'}", f"{mesh}: {alloc}")
    (problem,) = refused(write(tmp_path, text))
    line = next(i for i, s in enumerate(text.splitlines(), 1) if s.strip().startswith(f"{mesh}:"))
    assert message in problem.message and problem.line == line and problem.path == ("meshes", mesh)


def test_vllm_copies_kv_heads_over_a_multiple_of_them(tmp_path):
    load_pipeline(write(tmp_path, PIPELINE.replace("gen: vllm:d1", "gen: vllm:t4")))  # 2 KV heads, each on 2 ranks


def test_the_same_mistake_by_override_points_at_the_override(tmp_path):
    (problem,) = refused(write(tmp_path), ["meshes.gen=vllm:t3"])
    assert problem.file == "<command line>" and "set by override 'meshes.gen=vllm:t3'" in problem.message


# ---- CUDA, output folders, data files: what a run needs of this machine -----------------------------------------

def test_cuda_on_a_machine_without_it_is_refused_with_the_other_problems(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(door, "cuda_devices", lambda: 0)
    f = write(tmp_path, PIPELINE.replace("device: cpu", "device: cuda"))
    problems = refused(f, for_run=True)
    assert {p.path for p in problems} >= {("cluster", "device"), ("models", "policy", "path")}
    assert "this machine has no CUDA device" in str(problems[-1]) or any("no CUDA device" in p.message for p in problems)
    code, _, err = cli(capsys, str(f))
    assert code == 2 and "p.yaml:2:" in err and "cluster.device: cuda, but this machine has no CUDA device" in err
    assert "Traceback" not in err and "nothing was started" in err
    assert not any(p.path == ("cluster", "device") for p in refused(f, for_run=True, address="10.0.0.1:6379"))
    load_pipeline(f)  # validate plans for another machine: no complaint


def test_too_few_gpus_on_this_machine_are_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(door, "cuda_devices", lambda: 2)
    problems = refused(write(tmp_path, PIPELINE.replace("device: cpu", "device: cuda")), for_run=True)
    assert any(p.path == ("cluster", "devices_per_node") and "this machine has 2 CUDA device(s)" in p.message
               for p in problems)


def test_cuda_devices_respects_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert door.cuda_devices() == 0


@pytest.mark.parametrize("key", ["output_dir", "default_local_dir", "log_dir", "tensorboard_dir"])
def test_an_output_folder_that_is_a_file_or_under_one_is_refused(tmp_path, key):
    (tmp_path / "f").write_text("x")
    for target, why in ((tmp_path / "f", "is a file"), (tmp_path / "f" / "sub", "is a file; expected a path under folders")):
        problems = refused(write(tmp_path), [f"trainer.{key}={target}"], for_run=True)
        assert any(p.path == ("trainer", key) and why in p.message and p.file == "<command line>" for p in problems)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes everywhere")
def test_an_unwritable_output_folder_is_refused(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    problems = refused(write(tmp_path), [f"trainer.default_local_dir={locked}/ckpt"], for_run=True)
    assert any("is not writable here" in p.message for p in problems)


def test_a_data_file_that_is_a_fifo_is_refused_without_reading_it(tmp_path):
    os.mkfifo(tmp_path / "train.parquet")
    problems = refused(write(tmp_path), [f"data.train_files={tmp_path / 'train.parquet'}"], for_run=True)
    assert any(p.path == ("data", "train_files") and "not a regular file" in p.message for p in problems)


# ---- the pipeline file itself ----------------------------------------------------------------------------------

@pytest.fixture
def alarm():
    """Fail instead of hanging: a read that blocks (a FIFO) or never ends (/dev/zero)."""
    def expire(*_):
        raise TimeoutError("the file was read")
    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(20)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_a_fifo_or_a_device_is_refused_without_reading_it(tmp_path, alarm, capsys):
    os.mkfifo(tmp_path / "fifo.yaml")
    for f, what in ((tmp_path / "fifo.yaml", "is a FIFO"), ("/dev/zero", "is a device"), (tmp_path, "is a folder")):
        code, _, err = cli(capsys, "validate", str(f))
        assert code == 2 and what in err and "expected a pipeline YAML file (a regular file)" in err, err


def test_a_huge_pipeline_is_refused_by_its_size_and_its_number_of_values(tmp_path, capsys):
    big = tmp_path / "big.yaml"
    big.write_text("name: t\nx: '" + "a" * MAX_BYTES + "'\n")
    code, _, err = cli(capsys, "validate", str(big))
    assert code == 2 and "MiB; expected a pipeline YAML file of at most" in err
    many = tmp_path / "many.yaml"
    many.write_text("name: t\nx: [" + "1," * 30_000 + "1]\n")
    start = time.monotonic()
    code, _, err = cli(capsys, "validate", str(many))
    assert code == 2 and "values in one document" in err and "many.yaml:2:" in err
    assert time.monotonic() - start < 60  # refused at the cap, not after the whole list


# ---- overrides: Hydra's convention ------------------------------------------------------------------------------

@pytest.mark.parametrize("override, hint", [
    ("models.critic.path=m", "'models.critic' is not in the file (models: policy); expected an existing key, or "
                             "'+models.critic.path=m' to add one"),
    ("meshes.gen2=vllm:d1", "'meshes.gen2' is not in the file (meshes: gen, train)"),
    ("nodes.rollout.inputs.prompts=x.y", "'nodes.rollout.inputs.prompts' is not in the file"),
    ("+models.policy.dtype=bfloat16", "'models.policy.dtype' is already in the file; expected no '+'"),
    ("nodes.critic.params.x=1", "no node with id 'critic'"),
])
def test_an_override_must_name_an_existing_entry_or_add_it_with_a_plus(tmp_path, override, hint, capsys):
    f = write(tmp_path)
    (problem,) = refused(f, [override])
    assert problem.file == "<command line>" and hint in problem.message
    code, _, err = cli(capsys, "validate", str(f), override)
    assert code == 2 and err.startswith("<command line>:")


def test_a_plus_adds_an_entry_and_problems_in_it_point_at_the_override(tmp_path):
    f = write(tmp_path)
    pipe = load_pipeline(f, ["+meshes.spare=vllm:d1", "++models.policy.dtype=float32"])
    (unused,) = [w for w in pipe.warnings if w.path == ("meshes", "spare")]
    assert unused.file == "<command line>" and "no node uses mesh 'spare'" in unused.message
    (problem,) = refused(f, ["+meshes.bad=vllm:d0"])
    assert problem.file == "<command line>" and "set by override '+meshes.bad=vllm:d0'" in problem.message


def test_settings_with_defaults_are_still_set_without_a_plus(tmp_path):
    pipe = load_pipeline(write(tmp_path), ["data.max_response_length=64", "runtime.schedule=sync",
                                           "models.policy.override_config.num_hidden_layers=2"])
    assert pipe.data.max_response_length == 64


# ---- names that become file names -------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["../../x", "a/b", ".hidden", "a b"])
def test_mesh_names_are_plain_names(tmp_path, name):
    text = PIPELINE.replace("gen: vllm:d1", f"'{name}': vllm:d1").replace("mesh: gen", f"mesh: '{name}'")
    problems = refused(write(tmp_path, text))
    line = text.splitlines().index(f"  '{name}': vllm:d1") + 1
    assert any(p.path == ("meshes", name) and "is not a plain name" in p.message and p.line == line for p in problems)


def test_a_plain_mesh_name_may_hold_dots(tmp_path):
    load_pipeline(write(tmp_path, PIPELINE.replace("gen: vllm:d1", "gen.v2: vllm:d1").replace("mesh: gen", "mesh: gen.v2")))


@pytest.mark.parametrize("node_id", ["a.b", "../x", "a/b"])
def test_node_ids_have_no_dot_since_bindings_split_at_it(tmp_path, node_id):
    text = PIPELINE.replace("id: reward,", f"id: '{node_id}',").replace("deps: [reward]", f"deps: ['{node_id}']")
    problems = refused(write(tmp_path, text))
    assert any(p.path[-1] == "id" and "does not match" in p.message for p in problems)


# ---- warnings: it runs, but likely not as meant -----------------------------------------------------------------

def test_likely_mistakes_are_warned_about_at_their_line(tmp_path, capsys):
    text = PIPELINE.replace("weights_from: actor_update, options: {n: 4}", "options: {n: 4, max_tokens: 512}")
    text = text.replace("trainer: {total_steps: 2}", "trainer: {total_steps: 2}\nruntime: {staleness: 2}")
    text = text.replace("  train: megatron:d2\n", "  train: megatron:d2\n  spare: vllm:d1\n")
    text = text.replace("\ndata:\n", "\n  judge: {path: no/judge}\ndata:\n")
    f = write(tmp_path, text)
    found = {p.path: p for p in warned(f)}
    assert "takes no weights from it" in found[("nodes", 0)].message and "expected weights_from: actor_update" in found[("nodes", 0)].message
    assert "no effect under runtime.schedule sync" in found[("runtime", "staleness")].message
    assert "no node uses mesh 'spare'" in found[("meshes", "spare")].message
    assert "no node uses model 'judge'" in found[("models", "judge")].message
    assert all(p.line for p in found.values())
    code, _, err = cli(capsys, "validate", str(f))
    assert code == 0 and err.count("warning:") >= 4


def test_a_rollout_longer_than_the_response_length_is_warned_about_and_stops_there(tmp_path):
    from siirl_dag.strategies.vllm.options import resolve_options, sampling_kwargs

    found = [p for p in warned(write(tmp_path), ["nodes.rollout.options.max_tokens=1024"])
             if p.path == ("nodes", 0, "options", "max_tokens")]
    assert found and found[0].file == "<command line>"
    assert "1024 is above data.max_response_length = 512" in found[0].message
    assert "responses stop at 512 tokens" in found[0].message
    assert sampling_kwargs(resolve_options({"max_tokens": 1024}), {}, 512)["max_tokens"] == 512


def test_frozen_samplers_are_not_warned_about(tmp_path):
    # a rollout of a model nobody trains (a fixed opponent) and the shipped judge: frozen on purpose
    text = PIPELINE.replace("weights_from: actor_update, ", "model: frozen, ").replace(
        "mesh: gen, model: policy, model: frozen", "mesh: gen, model: frozen")
    text = text.replace("\ndata:\n", "\n  frozen: {path: no/frozen, override_config: {num_hidden_layers: 2}}\ndata:\n")
    assert not [p for p in warned(write(tmp_path, text)) if "weights" in p.message]
    assert not [p for p in warned("graphs/tiny_judge_cpu.yaml") if "takes no weights" in p.message]


def test_a_validation_only_run_needs_prompts_and_a_score(tmp_path):
    f = write(tmp_path)
    (problem,) = refused(f, ["trainer.val_only=true"])  # the pipeline has no data.val_files
    assert problem.path == ("trainer", "val_only") and problem.file == "<command line>"
    assert "data.val_files, which is empty; expected data.val_files" in problem.message
    (problem,) = refused(f, ["trainer.val_only=true", "data.val_files=test.parquet", "trainer.val_score_key=nothing"])
    assert problem.path == ("trainer", "val_only") and "no node produces trainer.val_score_key ('nothing')" in problem.message
    assert load_pipeline(f, ["trainer.val_only=true", "data.val_files=test.parquet"]).trainer.val_only


# ---- a finished run, the command line ---------------------------------------------------------------------------

def test_a_finished_run_started_again_says_how_to_start_a_new_one(tmp, capsys):  # noqa: F811
    write_checkpoint(tmp, 6)  # the pipeline's total_steps
    (tmp / "model" / "model.safetensors").write_text("")  # a run needs weights on disk; never loaded here
    code, _, err = cli(capsys, str(tmp / "p.yaml"))
    assert code == 0 and "is the end of a finished run (step 6 of 6" in err
    assert f"{tmp / 'p.yaml'} trainer.experiment_name=default-2" in err and "trainer.total_steps=12" in err


def test_help_lists_every_sub_command(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(c in out.splitlines()[2] for c in ("run", "validate", "plan", "visualize", "import"))


def test_a_value_no_form_of_a_key_takes_is_told_every_form(tmp_path):
    """A key written as one of several types (a file or a list of files) names them all, not the first."""
    (problem,) = refused(write(tmp_path), ["data.train_files=3"])
    assert problem.path == ("data", "train_files") and problem.message.startswith("3 is an integer; expected string or array")
