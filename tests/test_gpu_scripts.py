"""The CPU side of the GPU checks: the wheel list carried to the lent machine, and the summary of a
GPU run read back from its events and `plan`'s output."""

import re
import subprocess
import sys
from pathlib import Path

from gpu_run_summary import plan_fullest_gib, summarize

ROOT = Path(__file__).resolve().parents[1]


def test_the_carried_wheels_pin_one_version_each_and_leave_the_images_torch_alone():
    pins = [line for line in (ROOT / "scripts" / "gpu_wheels.txt").read_text().splitlines()
            if line and not line.startswith("#")]
    names = [re.split(r"==", pin)[0].lower().replace("_", "-") for pin in pins]
    assert all("==" in pin for pin in pins) and len(names) == len(set(names))
    assert {"vllm==0.25.0", "ray==2.60.0", "megatron-core==0.16.1"} <= set(pins)
    # the image's own (torch 2.11 for CUDA, numpy, transformers): carrying them would shadow it
    assert not {"torch", "numpy", "transformers", "triton", "flashinfer-python"} & set(names)


def test_a_run_summary_counts_training_steps_and_averages_after_the_first():
    series = {"timing_s/rollout": {0: 9.0, 1: 5.0, 2: 2.0, 3: 4.0}, "memory/gen/peak_gb": {1: 40.0, 2: 41.5},
              "training/rollout_logprob_diff_max": {1: 0.5, 2: 0.25, 3: 0.75}}
    out = summarize(series)
    assert out["steps"] == 3 and out["seconds_per_step"] == {"rollout": 3.0}  # step 0 (validation) and 1 left out
    assert out["peak_gb"] == {"gen": 41.5}
    assert out["training/rollout_logprob_diff_max"] == {"first": 0.5, "last": 0.75, "max": 0.75}


def test_the_plans_fullest_device_is_read_from_plan_itself(tmp_path):
    # the graph's model as gpu_checks.sh makes it; its config alone is what `plan` reads
    model = tmp_path / "model"
    subprocess.run([sys.executable, "scripts/make_tiny_model.py", str(model), "--arch", "qwen3", "--hidden-size", "1024",
                    "--num-layers", "28", "--num-heads", "8", "--num-kv-heads", "4", "--intermediate-size", "3072",
                    "--untied", "--no-weights"], capture_output=True, cwd=ROOT, check=True)
    res = subprocess.run([sys.executable, "-m", "siirl_dag.main", "plan", "graphs/gpu1_grpo.yaml",
                          "cluster.device_memory_gb=140", f"models.policy.path={model}"],
                         capture_output=True, text=True, cwd=ROOT, check=True)
    (tmp_path / "plan.out").write_text(res.stdout)
    assert plan_fullest_gib(tmp_path / "plan.out") == 47.92
