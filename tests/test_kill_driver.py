"""A driver killed with SIGKILL (a crash, the OOM killer) leaves nothing running, and the same
command resumes from its last checkpoint. Each run is a real `python -m siirl_dag.main` process
on a local Ray; it is killed while it writes a checkpoint, then, resumed, at a random moment of a
later step (which lands in a rollout, an update or a weight sync), and finally runs to the end."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
from test_e2e import PIPELINE, QUICK, SEPARATE

from siirl_dag.runtime import reaper

ROOT = Path(__file__).resolve().parents[1]
STEPS = 8  # the two kills land by step 3 or so: work is left for the resume


def start(folder: Path) -> subprocess.Popen:
    pipeline = folder / "pipeline.yaml"
    command = [sys.executable, "-m", "siirl_dag.main", str(pipeline), f"trainer.total_steps={STEPS}", "trainer.save_freq=1",
               "trainer.max_ckpt_to_keep=2", *QUICK]
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT)


def checkpoints(folder: Path, prefix: str = "global_step_") -> list[int]:
    ckpt = folder / "ckpt"
    return sorted(int(p.name[len(prefix):]) for p in ckpt.glob(f"{prefix}*")) if ckpt.is_dir() else []


def wait_for(condition, proc: subprocess.Popen, timeout: float = 300, every: float = 0.005) -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"the run ended early: {proc.communicate()[1][-3000:]}"
        assert time.monotonic() < end, "timed out"
        time.sleep(every)


def kill_and_check(proc: subprocess.Popen) -> list[str]:
    """SIGKILL the driver; every process it started must be gone soon after. Returns their names."""
    driver = psutil.Process(proc.pid)
    token = reaper.token_of(proc.pid)
    tree = [p for p in driver.children(recursive=True)]
    names = sorted({p.name() for p in tree if p.is_running()})
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    end = time.monotonic() + 60  # the reaper's sweep of the marked ones can lag on a loaded machine
    while (left := [p for p in tree if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]) or reaper.marked().get(token):
        assert time.monotonic() < end, (f"still running 60 s after the driver was killed: {[(p.pid, p.name()) for p in left]}, "
                                        f"marked with its token: {reaper.marked().get(token)}")
        time.sleep(0.2)
    return names


def test_a_killed_driver_leaves_nothing_and_the_same_command_resumes(tmp_path, tiny_model_dir, demo_data):
    (tmp_path / "pipeline.yaml").write_text(PIPELINE.format(devices=2, model=tiny_model_dir, data=demo_data, meshes=SEPARATE,
                                                            out=tmp_path, backend="ray"))
    # 1: while a checkpoint is being written (its temporary folder is there)
    proc = start(tmp_path)
    wait_for(lambda: checkpoints(tmp_path, ".tmp_global_step_"), proc)
    started = kill_and_check(proc)
    assert {"raylet", "gcs_server"} <= set(started) and any(n.startswith("ray::") for n in started)
    # 2: at a random moment of a step after the last checkpoint, from a resumed run (one such kill is
    # enough: every start costs the engines' start-up, and the resume below starts from a killed resume)
    before = checkpoints(tmp_path)
    proc = start(tmp_path)
    wait_for(lambda: checkpoints(tmp_path) and checkpoints(tmp_path)[-1] > (before[-1] if before else 0), proc, every=0.05)
    delay = random.uniform(0.0, 0.5)  # a step of this pipeline takes about half a second
    print(f"killed {delay:.2f} s after checkpoint {checkpoints(tmp_path)[-1]}")
    time.sleep(delay)
    kill_and_check(proc)
    last = checkpoints(tmp_path)[-1]
    assert last < STEPS, "the kills came too late to leave work for the resume"
    proc = start(tmp_path)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert f"[trainer] resumed from {tmp_path / 'ckpt' / f'global_step_{last}'} at step {last}" in err
    assert checkpoints(tmp_path)[-1] == STEPS
