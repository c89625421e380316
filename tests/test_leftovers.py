"""Files a process leaves behind: swept when their maker is gone, and recorded to remove later."""

import os
import subprocess
import sys

from siirl_dag import leftovers


def _dead_pid() -> str:
    return subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_sweep_removes_the_files_and_folders_of_dead_processes_only(tmp_path):
    dead, live = _dead_pid(), str(os.getpid())
    for pid in (dead, live):
        (tmp_path / f"sock-{pid}").mkdir()
        (tmp_path / f"sock-{pid}" / "a-socket").touch()
        (tmp_path / f"file-{pid}").touch()
    (tmp_path / f"other-{dead}").touch()  # not matched by the pattern
    leftovers.sweep_dead(r"(?:sock|file)-(\d+)", str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == sorted([f"sock-{live}", f"file-{live}", f"other-{dead}"])
    assert os.listdir(tmp_path / f"sock-{live}") == ["a-socket"]


def test_created_records_what_appears_meanwhile_and_remove_unlinks_it(tmp_path):
    (tmp_path / "before").touch()
    found: list[str] = []
    with leftovers.created(str(tmp_path), found, keep=lambda name: name.startswith("x")):
        (tmp_path / "x1").touch()
        (tmp_path / "y1").touch()
    assert found == [str(tmp_path / "x1")]
    (tmp_path / "x1").unlink()  # already gone is fine
    found.append(str(tmp_path / "before"))
    leftovers.remove(found)
    assert found == [] and sorted(os.listdir(tmp_path)) == ["y1"]
