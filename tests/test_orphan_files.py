"""Files a process leaves behind: swept when their maker is gone, and recorded to remove later."""

import contextlib
import os
import subprocess
import sys

import pytest

from siirl_dag import orphan_files
from siirl_dag.orphan_files import SHM_DIR

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def dead_pid() -> str:
    """The pid of a process that has ended."""
    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()


@contextlib.contextmanager
def planted(*names: str):
    """Files in /dev/shm named `name.format(pid=...)`, for a process that has ended and for a live
    one (this test's parent); yields (the dead one's, the live one's) paths, removed after."""
    paths = [[os.path.join(SHM_DIR, name.format(pid=pid)) for name in names] for pid in (dead_pid(), os.getppid())]
    for path in paths[0] + paths[1]:
        open(path, "wb").close()
    try:
        yield paths
    finally:
        for path in paths[0] + paths[1]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


def test_sweep_removes_the_files_and_folders_of_dead_processes_only(tmp_path):
    dead, live = dead_pid(), str(os.getpid())
    for pid in (dead, live):
        (tmp_path / f"sock-{pid}").mkdir()
        (tmp_path / f"sock-{pid}" / "a-socket").touch()
        (tmp_path / f"file-{pid}").touch()
    (tmp_path / f"other-{dead}").touch()  # not matched by the pattern
    orphan_files.sweep_dead(r"(?:sock|file)-(\d+)", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([f"sock-{live}", f"file-{live}", f"other-{dead}"])
    assert os.listdir(tmp_path / f"sock-{live}") == ["a-socket"]


def test_created_records_what_appears_meanwhile_and_remove_unlinks_it(tmp_path):
    (tmp_path / "before").touch()
    found: list[str] = []
    with orphan_files.created(str(tmp_path), found, keep=lambda name: name.startswith("x")):
        (tmp_path / "x1").touch()
        (tmp_path / "y1").touch()
    assert found == [str(tmp_path / "x1")]
    (tmp_path / "x1").unlink()  # already gone is fine
    found.append(str(tmp_path / "before"))
    orphan_files.remove(found)
    assert found == [] and sorted(os.listdir(tmp_path)) == ["y1"]


STOP_RAY = """
import os, ray
from siirl_dag.orphan_files import SHM_DIR
from siirl_dag.runtime.backends import init_ray, stop_ray
init_ray(num_cpus=1)
[raylet] = ray._private.worker._global_node.all_processes["raylet"]
left = [os.path.join(SHM_DIR, f"sem.{kind}{raylet.process.pid}-1795323247401977351") for kind in ("obj", "hdr")]
for path in left:
    open(path, "wb").close()
stop_ray()
print(sum(map(os.path.exists, left)))
for path in left:
    if os.path.exists(path):
        os.unlink(path)
"""


@pytest.mark.engines
def test_stopping_ray_removes_the_semaphores_named_after_its_raylet():
    """The Ray backend stops the Ray it started with `stop_ray`: its raylet is gone by then, so what
    its weight-sync channels left is swept at once, not at the next run's first channel. (In a
    process of its own: in CI, a Ray stopped in mid-test left the pytest process unable to start
    actors of test classes afterwards.)"""
    res = subprocess.run([sys.executable, "-c", STOP_RAY], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1] == "0", "files named after the stopped raylet are left"
