"""The door: what a new user gets wrong, refused (or warned about) before anything starts.

Called from `load_pipeline`, one line per stage:
- `mesh_name_problems`: mesh names become file and process names (logs, Ray workers): plain names only.
  Node ids keep the schema's stricter pattern (no '.'), because `inputs: {KEY: NODE.KEY}` bindings
  split at the first dot.
- `problems`: likely mistakes a run would carry out without complaint (warnings, exit 0), and a
  sampling limit a rollout would refuse only at its first batch, and a validation-only run
  (trainer.val_only) with nothing to validate.
- `run_problems`: what only a run needs of this machine: CUDA for `cluster.device: cuda` (on a run
  that starts its own Ray), output folders it can write, data files that are regular files.
"""

from __future__ import annotations

import ctypes
import os
import re
import stat
from pathlib import Path

from siirl_dag.errors import Problem

PLAIN_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*")
ROLLOUT_KINDS = ("rollout", "agent_rollout")  # samplers that should follow a trainer (a judge is frozen on purpose)


def mesh_name_problems(names) -> list[Problem]:
    """Mesh names become parts of file names: letters, digits, '_', '-', '.', not starting with '.'."""
    return [Problem(("meshes", name), f"mesh name {name!r} is not a plain name (it names log files and processes); "
                    "expected letters, digits, '_', '-' and '.', not starting with '.' (e.g. gen, actor_train)")
            for name in names if not PLAIN_NAME.fullmatch(str(name))]


def _written(pipe, path: tuple) -> bool:
    return path in pipe.positions or any(path[:len(t)] == t for t in pipe.touched)


def problems(pipe) -> list[Problem]:
    """Settings that run, but likely not as meant (warnings), and a sampling limit a rollout would
    refuse at its first batch (an error)."""
    out, errors, rt, nodes = [], [], pipe.runtime, pipe.nodes.values()
    if rt.schedule == "sync" and rt.staleness and _written(pipe, ("runtime", "staleness")):
        out.append(Problem(("runtime", "staleness"), f"{rt.staleness} has no effect under runtime.schedule sync, which "
                           "generates nothing ahead; expected runtime.schedule async (or one_step_off) to use it, or "
                           "no staleness"))
    if pipe.trainer.val_only:
        errors += _val_only_problems(pipe)
    trained = {}
    for n in nodes:
        if pipe.kinds[n.id].trains:
            trained.setdefault(n.model, n.id)
    for n in nodes:
        if pipe.kinds[n.id].name in ROLLOUT_KINDS and n.weights_from is None and n.model in trained:
            out.append(Problem(pipe.node_path(n.id), f"'{n.id}' samples model '{n.model}', which '{trained[n.model]}' "
                               "trains, but takes no weights from it: it samples the initial weights at every step "
                               f"and the run never learns; expected weights_from: {trained[n.model]}"))
        limit = n.options.get("max_tokens") if pipe.kinds[n.id].name in ROLLOUT_KINDS else None
        if limit and limit > pipe.data.max_response_length:  # responses are padded to it: they stop there
            out.append(Problem(pipe.node_path(n.id) + ("options", "max_tokens"), f"{limit} is above "
                               f"data.max_response_length = {pipe.data.max_response_length}, the length every response "
                               f"is padded to, so responses stop at {pipe.data.max_response_length} tokens; expected at "
                               f"most {pipe.data.max_response_length} (or raise data.max_response_length)"))
    for section, key, used, what in (("meshes", "mesh", {n.mesh for n in nodes}, "its devices are reserved for nothing"),
                                     ("models", "model", {n.model for n in nodes}, "nothing loads it")):
        for name in getattr(pipe, section):
            if name not in used:
                out.append(Problem((section, name), f"no node uses {key} '{name}' ({what}); expected a node with "
                                   f"{key}: {name}, or no such entry"))
    for p in out:
        p.severity = "warning"
    return errors + out


def _val_only_problems(pipe) -> list[Problem]:
    """trainer.val_only validates and stops: it needs prompts to validate on and a node to score them."""
    where = ("trainer", "val_only")
    if not pipe.data.val_files:
        return [Problem(where, "validates on data.val_files, which is empty; expected data.val_files: the prompts "
                               "to validate on")]
    if not pipe.scorers:
        return [Problem(where, "has nothing to report: no node produces trainer.val_score_key "
                               f"('{pipe.trainer.val_score_key}'); expected a node that scores the responses")]
    return []


def cuda_devices() -> int:
    """CUDA devices this process would see, without initializing CUDA (NVML, or the driver's /proc
    entries), so nothing forked later inherits a CUDA context."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() in ("", "-1"):
        return 0
    count = 0
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        n = ctypes.c_uint(0)
        if nvml.nvmlInit_v2() == 0 and nvml.nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0:
            count = n.value
        nvml.nvmlShutdown()
    except (OSError, AttributeError):
        gpus = Path("/proc/driver/nvidia/gpus")
        count = len(list(gpus.iterdir())) if gpus.is_dir() else 0
    return min(count, len(visible.split(","))) if visible else count


def _folder_problem(folder: Path, what: str) -> str | None:
    """Why a run could not write `folder` (made if missing), or None."""
    if folder.exists():
        if not folder.is_dir():
            return f"{what} '{folder}' is a file; expected a folder (or a path where one can be made)"
        return None if os.access(folder, os.W_OK | os.X_OK) else f"{what} '{folder}' is not writable here"
    parent = folder.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{what} '{folder}' cannot be made: '{parent}' is a file; expected a path under folders"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{what} '{folder}' cannot be made: '{parent}' is not writable here"
    return None


def _output_folders(pipe) -> list[tuple[tuple, Path, str]]:
    t = pipe.trainer
    out = pipe.out_dir
    return [(("trainer", "output_dir"), out, "output folder"),
            (("trainer", "default_local_dir"), Path(t.default_local_dir or out / "checkpoints"), "checkpoint folder"),
            (("trainer", "tensorboard_dir"), Path(t.tensorboard_dir or out / "tensorboard"), "tensorboard folder"),
            (("trainer", "log_dir"), Path(t.log_dir or out / "logs"), "log folder")]


def run_problems(pipe, address: str | None = None) -> list[Problem]:
    """What a run needs of this machine, all at once (validate, which may plan for another machine, skips it)."""
    out, c = [], pipe.cluster
    simulated = pipe.runtime.backend == "simulated"  # no device and no model behind its ranks
    if c.device == "cuda" and not (address or pipe.runtime.address or simulated):  # an attached cluster brings its own GPUs
        found = cuda_devices()
        if not found:
            out.append(Problem(("cluster", "device"), "cuda, but this machine has no CUDA device (no NVIDIA driver, or "
                               "CUDA_VISIBLE_DEVICES hides them); expected device: cpu here, a machine with GPUs, or "
                               "--address of a Ray cluster that has them"))
        elif c.nodes == 1 and found < c.devices_per_node:
            out.append(Problem(("cluster", "devices_per_node"), f"{c.devices_per_node} devices per machine, but this "
                               f"machine has {found} CUDA device(s); expected at most {found}"))
    for key, folder, what in _output_folders(pipe):
        why = _folder_problem(folder, what)
        if why:
            out.append(Problem(key, f"{why} (a run writes there)"))
    files = [("train_files", f) for f in pipe.data.train_files] + [("val_files", f) for f in pipe.data.val_files]
    for key, f in files:
        try:
            mode = os.stat(f).st_mode
        except OSError:
            continue  # the data check names a missing file
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):  # a folder: the data check says what to do
            out.append(Problem(("data", key), f"'{f}' is not a regular file; expected a parquet file"))
    return out
