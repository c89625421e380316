"""`import --from PEER SOURCE -o pipeline.yaml` (siirl, verl, roll, areal, slime, nemo-rl, openrlhf): write
the equivalent pipeline under a header auditing the import (what was carried over as written, what with
a difference and what not, each with its line and why; `--json` gives the same as data), then validate it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import yaml

from siirl_dag.config import load_pipeline
from siirl_dag.errors import ConfigError
from siirl_dag.importers import import_config
from siirl_dag.importers.source import Imported


class _Dumper(yaml.SafeDumper):
    """Block style for the document, flow style for small leaf maps and lists (one node per line or so)."""


def _flow_when_small(dumper: yaml.SafeDumper, data: dict):
    flat = all(not isinstance(v, dict) and not (isinstance(v, list) and any(isinstance(x, (dict, list)) for x in v))
               for v in data.values())
    return dumper.represent_mapping("tag:yaml.org,2002:map", data, flow_style=flat and len(str(data)) < 100)


def _flow_when_scalars(dumper: yaml.SafeDumper, data: list):
    flat = all(not isinstance(v, (dict, list)) for v in data)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flat)


_Dumper.add_representer(dict, _flow_when_small)
_Dumper.add_representer(list, _flow_when_scalars)


def audit(imported: Imported) -> dict[str, list[dict]]:
    """What was carried over as written, mapped (carried with a difference) and not carried, with why."""
    row = lambda x: {"key": x.key, "line": x.line, "value": _plain(x.value), "why": x.why}  # noqa: E731
    return {"carried_over": [row(x) for x in imported.source.carried()], "differences": [row(x) for x in imported.remarks],
            "not_carried": [row(x) for x in imported.left]}


def _plain(value):
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def render(imported: Imported) -> str:
    """The pipeline YAML under a header naming the source and auditing what was carried over."""
    src = imported.source
    name = Path(src.file).name
    head = [f"# Imported from {imported.peer}: {name} (python -m siirl_dag.main import --from {imported.peer} ...).",
            f"# Carried over as written: {len(src.carried())} key(s) of {name} (import --json lists them)."]
    for title, items in ((f"Carried over with a difference ({len(imported.remarks)})", imported.remarks),
                         (f"Not carried over from {name} ({len(imported.left)})", imported.left)):
        if items:
            head += [f"# {title}:"] + [f"#   line {x.line}: {x}" if x.line else f"#   {x}" for x in items]
    head += ["# Check the paths, then: python -m siirl_dag.main validate THIS_FILE", ""]
    body = yaml.dump(imported.pipeline, Dumper=_Dumper, sort_keys=False, width=110, allow_unicode=True)
    return "\n".join(head) + body


def main(args) -> int:
    imported = import_config(args.peer, args.source)
    out = Path(args.output)
    if out.resolve() == Path(args.source).resolve():
        raise ConfigError(f"-o {out} is the source itself; expected another file (the source is kept)")
    out.write_text(render(imported), encoding="utf-8")
    try:
        pipe = load_pipeline(out)
        problems, meshes = [], {m.name: m.alloc for m in pipe.meshes.values()}
    except ConfigError as exc:
        problems, meshes = exc.problems, {}
    errors = [p for p in problems if p.severity == "error"]
    if args.json:
        print(json.dumps({"output": str(out), "valid": not errors, "meshes": meshes, **audit(imported),
                          "errors": [p.to_json() for p in problems]}, indent=2))
    else:
        print(f"wrote {out} from {imported.peer} configuration {imported.source.file}")
        for name, alloc in meshes.items():
            print(f"  mesh {name}: {alloc}")
        for title, items in (("carried over with a difference", imported.remarks), ("not carried over", imported.left)):
            if items:
                print(f"{title} ({len(items)}; also listed at the top of {out}):")
                print("\n".join(f"  {imported.source.file}:{x.line}: {x}" if x.line else f"  {x}" for x in items))
        for p in problems:
            print(str(p), file=sys.stderr)
        print(f"{len(errors)} error(s) in the written pipeline; fix them in {out}" if errors else
              f"{out} validates; see its layout with: python -m siirl_dag.main plan {out}",
              file=sys.stderr if errors else sys.stdout)
    return 2 if errors else 0
