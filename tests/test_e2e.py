"""GRPO end to end through the real stack (vLLM rollout, Megatron actor/ref, Ray, weight sync),
exact resume on the local runtime, and runtime.schedule=async with staleness 0 giving the sync
schedule's metrics. Each run is a real `python -m siirl_dag.main` process."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

PIPELINE = """\
name: e2e
cluster: {{nodes: 1, devices_per_node: {devices}, device: cpu}}
models: {{policy: {{path: {model}, dtype: float32}}}}
data: {{train_files: {data}/train.parquet, val_files: {data}/test.parquet, train_batch_size: 8,
        max_prompt_length: 16, max_response_length: 8}}
meshes:
{meshes}
nodes:
  - {{id: rollout, kind: rollout, mesh: gen, model: policy, weights_from: actor_update,
     options: {{n: 4, temperature: 1.0, kv_cache_gb: 0.25, max_model_len: 64, enforce_eager: true}}}}
  - {{id: reward, kind: reward, deps: [rollout]}}
  - {{id: advantage, kind: advantage, deps: [reward]}}
  - {{id: old_logprob, kind: logprob, deps: [rollout], mesh: train, model: policy, params: {{output: old_logprobs}}}}
  - {{id: ref_logprob, kind: logprob, deps: [rollout], mesh: ref, model: policy, params: {{output: ref_logprobs}}}}
  - {{id: actor_update, kind: actor_update, deps: [advantage, old_logprob, ref_logprob], mesh: train, model: policy,
     options: {{lr: 1.0e-3, micro_batch_size: 16}}, params: {{mini_batch_size: 4, use_kl_loss: true, entropy_coeff: 0.001}}}}
trainer: {{total_steps: 2, logger: [tensorboard], default_local_dir: {out}/ckpt, tensorboard_dir: {out}/tb,
          log_dir: {out}/logs, project_name: e2e, experiment_name: run}}
runtime: {{backend: {backend}}}
"""
SEPARATE = '  gen: "vllm:d1"\n  train: "megatron:d1"\n  ref: {alloc: "megatron:d1", colocate_with: train}'
COLOCATED = '  train: "megatron:d1"\n  gen: {alloc: "vllm:d1", colocate_with: train}\n  ref: {alloc: "megatron:d1", colocate_with: train}'
# the metrics two runs that must train alike are compared on
COMPARED = ("critic/score/mean", "actor/pg_loss", "actor/grad_norm", "response_length/mean", "actor/ppo_kl")
METRICS = ["critic/score/mean", "critic/advantages/mean", "response_length/mean", "prompt_length/mean", "actor/pg_loss", "actor/pg_clipfrac",
           "actor/ppo_kl", "actor/kl_loss", "actor/entropy", "actor/grad_norm", "actor/lr", "timing_s/rollout",
           "timing_s/actor_update", "timing_s/step", "timing_s/sync_weights", "perf/throughput", "val-core/demo/arith/acc"]


def launch(tmp_path, model, data, meshes=SEPARATE, devices=2, backend="ray", *overrides) -> subprocess.CompletedProcess:
    tmp_path.mkdir(parents=True, exist_ok=True)
    f = tmp_path / "pipeline.yaml"
    f.write_text(PIPELINE.format(devices=devices, model=model, data=data, meshes=meshes, out=tmp_path, backend=backend))
    return subprocess.run([sys.executable, "-m", "siirl_dag.main", str(f), "--json", *overrides], capture_output=True,
                          text=True, timeout=600, cwd=Path(__file__).resolve().parents[1])


def run(*args):
    return parsed(launch(*args))


def parsed(res: subprocess.CompletedProcess) -> dict:
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout)  # --json: the document alone, though Ray forwards the workers' logs


def logs_of(res: subprocess.CompletedProcess) -> tuple[Path, str]:
    """The run's log folder, as it named it at the start, and all its files' text."""
    (folder,) = re.findall(r"^\[run\] logs of vLLM, Ray, Megatron and transformers: (\S+)/ \(--verbose", res.stderr, re.M)
    return Path(folder), "".join(p.read_text(errors="replace") for p in sorted(Path(folder).glob("*.log")))


def tensorboard_tags(folder) -> set:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return set(acc.Tags()["scalars"])


@pytest.mark.parametrize("layout", ["separate", "colocated"])
def test_grpo_through_ray(tmp_path, tiny_model_dir, demo_data, layout):
    meshes, devices = (SEPARATE, 2) if layout == "separate" else (COLOCATED, 1)
    res = launch(tmp_path, tiny_model_dir, demo_data, meshes, devices)
    history = parsed(res)
    assert set(history["steps"]) == {"1", "2"}
    # a quiet console: the engine's own lines; what vLLM, Ray and Megatron say is in a file per process
    folder, logs = logs_of(res)
    assert "RankWorker pid=" not in res.stderr and "Resolved architecture" not in res.stderr, res.stderr[-2000:]
    names = {p.stem.split("-rank")[0] for p in folder.glob("*.log")}
    assert {"driver", "train", "compute"} | ({"gen"} if layout == "separate" else set()) <= names
    assert "Resolved architecture: Qwen2ForCausalLM" in logs  # vLLM's INFO line, from the rollout rank
    warnings = int(re.search(r"^\[run\] (\d+) warning line\(s\) in the logs", res.stderr, re.M).group(1))
    assert warnings == sum(bool(re.search(r"WARNING|Warning|\[W\d{4} |\]:W\d{4} ", line)) for line in logs.splitlines())
    assert "val-core/demo/arith/acc" in history["val_before"]
    assert set(METRICS) <= tensorboard_tags(tmp_path / "tb")
    step2 = history["steps"]["2"]
    assert step2["actor/lr"] > 0 and step2["timing_s/sync_weights"] > 0
    # each mesh's measured peak (on CPU its processes' resident sets), the plan's estimate printed at start
    assert all(step2[f"memory/{mesh}/peak_gb"] > 0.1 for mesh in ("gen", "train", "ref"))
    assert "[run] memory per device (estimate" in res.stderr
    assert ("sync/handoff_s" in step2) == (layout == "colocated"), "colocated meshes hand weights over in-process"
    ckpt = tmp_path / "ckpt" / "global_step_2"
    state = json.loads((ckpt / "trainer_state.json").read_text())
    assert state["versions"] == {"actor_update": 2} and state["synced"] == {"rollout": 2}
    assert (ckpt / "actor_update.hf" / "config.json").is_file(), "the final actor is exported for HF"


QUICK = ("trainer.val_before_train=false", "trainer.export_hf=false")
# vLLM's compiled model (the tests' runs are eager, as the shipped CPU graphs are): its cache is what a resume reads
COMPILED = "nodes.rollout.options.enforce_eager=false"
FOUR_STEPS = ("trainer.total_steps=4", "trainer.save_freq=2", COMPILED, *QUICK)


@pytest.fixture(scope="module")
def four_steps(made_once, tiny_model_dir, demo_data):
    """A local run of four steps, saved at steps 2 and 4: its history, and its folder with only step 2's
    checkpoint left (copied by the tests that resume from it)."""
    def make(out: Path) -> None:
        res = launch(out, tiny_model_dir, demo_data, SEPARATE, 2, "local", *FOUR_STEPS, "--verbose")
        history = parsed(res)
        # --verbose: everything streams to the console (stderr, beside --json's document), no log folder
        assert "Resolved architecture: Qwen2ForCausalLM" in res.stderr and not (out / "logs").exists()
        shutil.rmtree(out / "ckpt" / "global_step_4")
        (out / "history.json").write_text(json.dumps(history))

    out = made_once("four_steps", make)
    return out, json.loads((out / "history.json").read_text())


def test_resume_is_exact_on_local_runtime(tmp_path, tiny_model_dir, demo_data, four_steps):
    folder, straight = four_steps
    shutil.copytree(folder, tmp_path, dirs_exist_ok=True)
    res = launch(tmp_path, tiny_model_dir, demo_data, SEPARATE, 2, "local", *FOUR_STEPS)
    resumed = parsed(res)
    assert set(straight["steps"]) == {"1", "2", "3", "4"} and set(resumed["steps"]) == {"3", "4"}
    # the checkpoint loads before the start-up sync: the rollout is synced once, straight to its weights
    assert [line for line in res.stderr.splitlines() if "syncing weights" in line] == \
        ["[runtime] syncing weights: rollout <- actor_update v2 ..."]
    # the same engine started in `four_steps`: this start loads its compiled model from vLLM's cache
    _, logs = logs_of(res)
    assert "Resolved architecture" in logs and "load failure" not in logs, "vLLM compiled again"
    assert "reset prefix cache" not in logs  # vLLM's line at every weight update
    # a save says so before and after, each on a line of its own (not appended to the training bar)
    lines = re.split(r"[\r\n]", res.stderr)  # the bar redraws itself after a carriage return
    assert "[trainer] step 4: saving a checkpoint ..." in lines
    assert any(re.fullmatch(r"\[trainer\] step 4: saved \S+/global_step_4 in \d+\.\d s", line) for line in lines), \
        res.stderr[-3000:]
    assert "timing_s/save_checkpoint" in resumed["steps"]["4"] and "timing_s/save_checkpoint" not in resumed["steps"]["3"]
    for step in ("3", "4"):
        for key in ("critic/score/mean", "actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "response_length/mean"):
            assert resumed["steps"][step][key] == pytest.approx(straight["steps"][step][key], abs=1e-6), (step, key)
    # validation only, of the checkpoint just written: the final validation's scores again, nothing trained or saved
    saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    res = launch(tmp_path, tiny_model_dir, demo_data, SEPARATE, 2, "local", "trainer.val_only=true", COMPILED)
    checked = parsed(res)
    assert checked["steps"] == {} and checked["val_only"] == resumed["val_last"] != {}
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == saved
    assert re.search(rf"\[run\] 'e2e': validation only \(\d+ prompts, the weights of {re.escape(str(tmp_path))}/ckpt/"
                     r"global_step_4\)", res.stderr), res.stderr[-2000:]
    acc = checked["val_only"]["val-core/demo/arith/acc"]
    assert f"[run] val-core/demo/arith/acc: {acc:.3f} (validation only)" in res.stderr.splitlines()


def test_a_truncated_checkpoint_fails_as_one_line(tmp_path, tiny_model_dir, demo_data, four_steps):
    """Damage only the engines can see (a shard cut short): one line, exit 1, no traceback."""
    shutil.copytree(four_steps[0], tmp_path, dirs_exist_ok=True)
    checkpoint = tmp_path / "ckpt" / "global_step_2"
    shard = sorted((checkpoint / "actor_update").glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:shard.stat().st_size // 2])
    res = launch(tmp_path, tiny_model_dir, demo_data, SEPARATE, 2, "local", "trainer.total_steps=3", *QUICK)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr[-4000:]
    (failed,) = [line for line in res.stderr.splitlines() if line.startswith("[run] failed: ")]
    assert failed.startswith(f"[run] failed: resuming from {checkpoint}: node 'actor_update' could not load "
                             f"{checkpoint / 'actor_update'} ("), failed


def test_async_with_staleness_zero_is_the_sync_schedule(tmp_path, tiny_model_dir, demo_data, four_steps):
    """Compared with the first two steps of `four_steps` (the sync schedule, same pipeline and data), so
    that only the async run is started here."""
    sync = four_steps[1]["steps"]
    zero = parsed(launch(tmp_path, tiny_model_dir, demo_data, SEPARATE, 2, "local", "trainer.total_steps=2", COMPILED, *QUICK,
                         "runtime.schedule=async", "runtime.staleness=0"))["steps"]
    assert set(zero) == {"1", "2"}
    for step in ("1", "2"):
        assert zero[step]["async/staleness/max"] == 0
        for key in COMPARED:
            assert zero[step][key] == sync[step][key], (step, key)
