"""Files a peer's configuration names: verl's tool and interaction configs, and the Hydra config a
run script starts from (`--config-name`).

Each is looked for where the run would find it, as far as the source tells: a path relative to the
source's folder; behind a variable only running the script would set (`"$PROJECT_DIR/examples/..."`
with `PROJECT_DIR=$(pwd)`), the rest of the path under the source's folder or one of its parents;
last, the file's own name beside the source (and a Hydra config in a `config/` folder beside it, as
verl's examples keep theirs). What is found is read as YAML, never run or imported, and its keys join
the source's, so the audit lists every one of them.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from siirl_dag.importers.source import Source

PARENTS = 4  # folders above the source's that a path behind an unknown variable is looked for under
_LEADING = re.compile(r"^(\$\{[^}]*\}|\$\([^)]*\)|\$\w+)")  # the $X, ${X} or $(...) a path starts with


def find(src: Source, key: str, name: str = "") -> tuple[Path | None, list[Path]]:
    """The file that `key` names (with `name`: `key` names its folder, as --config-path does), and
    every place tried, in order."""
    folder = Path(src.file).resolve().parent
    written = str(src.keys.get(key, ("",))[0] or "").strip("'\"")
    if key in src.unresolved:
        rest = _LEADING.sub("", written).lstrip("/")
        tried = [top / rest / name for top in (folder, *folder.parents[:PARENTS])] if rest and "$" not in rest else []
    else:
        path = Path(written) / name
        tried = [path if path.is_absolute() else folder / path]
    file_name = name or Path(written).name
    if file_name and "$" not in file_name:
        tried += [folder / file_name] + ([folder / "config" / name] if name else [])
    tried = list(dict.fromkeys(Path(os.path.normpath(p)) for p in tried))
    return next((p for p in tried if _is_file(p)), None), tried


def _is_file(path: Path) -> bool:
    """A regular file here; a name the system cannot look up (too long, a NUL byte) is none."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def read(src: Source, path: Path, prefix: str = "", lists: bool = False, whole: tuple[str, ...] = ()) -> None:
    """`path`'s keys into `src` under `prefix` (keys `src` sets itself win; `lists`, `whole`: as
    `Source.from_yaml` flattens); bad YAML names its file and line."""
    src.include(Source.from_yaml(path, lists=lists, whole=whole), prefix)


def shown(src: Source, path: Path) -> str:
    """A found file as the audit names it: relative to the source's folder."""
    return os.path.relpath(path, Path(src.file).resolve().parent)
