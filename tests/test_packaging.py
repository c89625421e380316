"""The package as a user installs it: `pip install .` (not editable) into a fresh virtual environment,
then the command line from another folder, with the schemas read from the installed package data."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_a_plain_install_validates_a_pipeline_from_another_folder(tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True).stdout.strip())
    # the dependencies (torch, jsonschema, ...) come from this environment's folder, whose own .pth files
    # (this checkout's editable install among them) a path line does not run; the package is installed
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    # built from a copy of the sources: a build writes its folders beside them
    source = tmp_path / "source"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(".*", "data", "outputs", "build", "*.egg-info",
                                                                  "__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                    str(site), str(source)], check=True, capture_output=True, timeout=300)
    where = subprocess.run([python, "-c", "import siirl_dag, nodes; print(siirl_dag.__file__, nodes.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, check=True).stdout.split()
    assert all(Path(f).is_relative_to(site) for f in where), where
    assert (site / "siirl_dag" / "schemas" / "strategies" / "vllm.schema.json").is_file()

    res = subprocess.run([python, "-m", "siirl_dag.main", "validate", str(ROOT / "graphs" / "qwen3_30b_a3b_moe.yaml"),
                          "--json"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert res.returncode == 0, res.stderr
    doc = json.loads(res.stdout)
    assert doc["valid"] and doc["pipeline"]["plan"]["devices_used"] == 32
    bad = subprocess.run([python, "-m", "siirl_dag.main", "validate", str(ROOT / "graphs" / "tiny_grpo_cpu.yaml"),
                          "trainer.totl_steps=3"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert bad.returncode == 2 and "trainer.totl_steps: unknown key 'totl_steps'" in bad.stderr, bad.stderr
