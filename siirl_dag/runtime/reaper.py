"""Nothing outlives a killed driver.

A local Ray that a run starts is the driver's children (GCS, raylet) and theirs (Ray's agents, the
rank workers, their vLLM and gloo processes). A driver killed with SIGKILL (a crash, the OOM killer)
cannot stop them; Ray's dashboard and runtime-env agents then stay for minutes. So before it starts
Ray, the driver puts `SIIRL_DAG_DRIVER=<pid>:<start time>` in its environment, which every one of
those processes inherits, and starts a watcher (`python -m siirl_dag.runtime.reaper TOKEN`, in a
session of its own, without the mark) that waits for the driver to end and then stops every process
carrying its mark or descending from the driver (the watcher keeps the tree: Ray's agents rewrite
their command line over their environment, and lose their parent with the raylet). Each start also
stops the marked processes of drivers that are gone and Ray processes whose raylet is gone (adopted
by init), were the watcher killed too. A cluster attached with --address is never touched: its processes do not
inherit the mark, and Ray ends the actors of a driver that has gone.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import defaultdict

import psutil

from siirl_dag.orphan_files import RAY_SEMAPHORES, sweep_dead

MARK = "SIIRL_DAG_DRIVER"
POLL_S = 0.5
GRACE_S = 3.0


def token_of(pid: int) -> str:
    """A process's identity that a reused pid does not share."""
    return f"{pid}:{int(psutil.Process(pid).create_time() * 1000)}"


def alive(token: str) -> bool:
    pid = int(token.split(":")[0])
    try:
        return token_of(pid) == token
    except (psutil.NoSuchProcess, psutil.AccessDenied, ValueError):
        return False


def marked(variable: str = MARK) -> dict[str, list[psutil.Process]]:
    """Processes of this user that carry a mark in their environment (`variable`: a driver's, or an agent
    program's episode's), by token (this process excluded)."""
    found: dict[str, list[psutil.Process]] = defaultdict(list)
    me, uid = os.getpid(), os.getuid()
    for proc in psutil.process_iter(["uids"]):
        try:
            if proc.pid == me or proc.info["uids"] is None or proc.info["uids"].real != uid:
                continue
            token = proc.environ().get(variable)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess, OSError):
            continue
        if token:
            found[token].append(proc)
    return found


def stop(processes: list[psutil.Process], grace_s: float = GRACE_S) -> int:
    """SIGTERM, then SIGKILL for what is still there after `grace_s`; how many were running."""
    for proc in processes:
        try:
            proc.terminate()
        except psutil.NoSuchProcess:
            pass
    _, left = psutil.wait_procs(processes, timeout=grace_s)
    for proc in left:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(left, timeout=grace_s)
    return len(processes)


def ray_orphans() -> list[psutil.Process]:
    """This user's Ray processes (`ray::...`) adopted by init: their raylet, and its cluster, are gone."""
    found, uid = [], os.getuid()
    for proc in psutil.process_iter(["ppid", "uids", "cmdline"]):
        info = proc.info
        if info["ppid"] == 1 and info["uids"] and info["uids"].real == uid and (info["cmdline"] or [""])[0].startswith("ray::"):
            found.append(proc)
    return found


def stop_orphans() -> int:
    """Stop what drivers that have ended left: their marked processes, and Ray's orphans."""
    left = [p for token, procs in marked().items() if not alive(token) for p in procs]
    return stop(_unique(left + ray_orphans()))


def _unique(processes: list[psutil.Process]) -> list[psutil.Process]:
    return list({p.pid: p for p in processes}.values())


_watched: set[str] = set()


def guard() -> None:
    """Stop earlier runs' orphans; mark this driver; start its watcher (once per driver)."""
    token = token_of(os.getpid())
    if token in _watched:
        return
    stop_orphans()
    os.environ[MARK] = token
    env = {k: v for k, v in os.environ.items() if k != MARK}
    subprocess.Popen([sys.executable, "-m", "siirl_dag.runtime.reaper", token], env=env, start_new_session=True,
                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, close_fds=True)
    _watched.add(token)


def watch(token: str) -> None:
    """Keep the driver's process tree while it runs; once it has ended, stop what is left of it and
    whatever carries its mark."""
    tree: dict[int, psutil.Process] = {}
    try:
        driver = psutil.Process(int(token.split(":")[0]))
    except psutil.NoSuchProcess:
        driver = None
    while driver is not None and alive(token):
        try:
            tree.update((p.pid, p) for p in driver.children(recursive=True) if p.pid != os.getpid())  # not this watcher
        except psutil.Error:  # a process that ended while the tree was read: read it again next time
            pass
        time.sleep(POLL_S)
    left = [p for p in tree.values() if p.is_running()]  # is_running: the same process, not a reused pid
    stop(_unique(left + marked().get(token, [])))
    sweep_dead(RAY_SEMAPHORES)  # the weight-sync semaphores its raylet named


if __name__ == "__main__":
    watch(sys.argv[1])
