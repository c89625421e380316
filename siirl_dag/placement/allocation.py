"""Allocation strings (AReaL-compatible) -> `Component`s.

    spec       := group ("+" group)*             components on their own devices
    group      := component ("|" component)*     colocated: the same devices
    component  := backend ["[" name "]"] ":" (dims | "(" "attn:" dims "|" "ffn:" dims ")")
    dims       := (letter positive-int)+         letters d t p c e, each at most once

`|` binds tighter than `+`. Each component's sizes are a `ParallelDims` (world_size = d*t*p*c; e
adds no devices, it splits the experts across the existing mesh; edp = world / (p * etp * e)).

Expert tensor parallel (etp), which the string cannot spell outside MoE folding:
- plain string with e > 1 (`megatron:d4t2e4`): etp = 1, AReaL's default (expert weights not
  split by TP; megatron-core would default to etp = tp);
- plain string without e: etp = t, megatron-core's default, so the expert grid equals the dense one;
- MoE parallel folding `megatron:(attn:d1p4t2c2|ffn:d1p4t1e4)`: attn gives d/t/p/c of the dense
  layers, ffn's t is etp, ffn's d is edp (derived when omitted), ffn's p must equal attn's
  (inherited when omitted), and attn and ffn must cover the same number of devices.

The parser is hand-written (a dozen lines of splitting) so that every error can name the part
of the string at fault and the rule it breaks; every problem found is reported at once.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Iterable, Sequence

from siirl_dag.errors import ConfigError, PathPart, Problem
from siirl_dag.placement.parallel_dims import ParallelDims
from siirl_dag.registry import STRATEGIES

BACKEND_DIMS = {
    "vllm": "dtp",
    "sglang": "dtp",
    "fsdp": "dtc",
    "megatron": "dtpce",
    "archon": "dtpce",
}
FOLDING_BACKENDS = ("megatron", "archon")
SECTION_DIMS = {"attn": "dtpc", "ffn": "dtpe"}
STRATEGY_BACKENDS = tuple(sorted(STRATEGIES))

_COMPONENT = re.compile(
    r"^(?P<backend>[A-Za-z_][\w-]*)?\s*(?:\[\s*(?P<name>[^\]]*?)\s*\])?\s*:\s*(?P<body>.*)$", re.S
)
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_DIMS_ONLY = re.compile(r"^(\s*[A-Za-z]\s*\d+)+\s*$", re.ASCII)
_DIM = re.compile(r"\s*([A-Za-z])\s*(\d+)\s*", re.ASCII)
_SECTION = re.compile(r"^\s*(attn|ffn)\s*:(.*)$", re.S)


@dataclass(frozen=True)
class Component:
    """One model's devices and how they are split. Folded MoE meshes have etp/edp != tp/dp."""

    backend: str
    name: str | None
    dims: ParallelDims = ParallelDims()
    colocated_with: str | None = None
    text: str = field(default="", compare=False)  # the component as written, for messages

    @property
    def label(self) -> str:
        """How messages refer to it: its name, else its text."""
        return self.name or self.text or self.backend


def component_to_json(c: Component) -> dict:
    dims = c.dims.to_json()
    del dims["vpp"]  # not a size of the allocation string
    return {"backend": c.backend, "name": c.name, **dims, "colocated_with": c.colocated_with}


def allocation_world_size(components: Iterable[Component]) -> int:
    """Devices claimed: colocated members share their anchor's devices and count once."""
    return sum(c.dims.world_size for c in components if c.colocated_with is None)


def check_backend_supported(
    component: Component, available: Sequence[str] = STRATEGY_BACKENDS, path: Sequence[PathPart] = ()
) -> None:
    """Refuse a backend that parses but has no strategy in this engine."""
    if component.backend not in available:
        raise ConfigError(
            f"component {component.label!r}: backend {component.backend!r} has no strategy in this "
            f"engine (available: {', '.join(available)})",
            path,
        )


class _Bad(Exception):
    """A rule broken inside one component; parse_allocation turns it into a Problem."""


def _split_top(text: str, sep: str) -> list[str]:
    """Split on `sep` outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += (ch == "(") - (ch == ")")
        if ch == sep and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def _dims(text: str, allowed: str, where: str) -> dict[str, int]:
    """'d2t4' -> {'d': 2, 't': 4}; every letter allowed, once, with a positive size."""
    if not text.strip():
        raise _Bad(f"no dimensions after ':' (expected e.g. d2t4 with letters {', '.join(allowed)})")
    out: dict[str, int] = {}
    pos = 0
    for m in _DIM.finditer(text):
        if m.start() != pos:
            break
        pos = m.end()
        letter, size = m.group(1), int(m.group(2))
        if letter not in "dtpce":
            raise _Bad(f"unknown dimension {letter!r} (known: d, t, p, c, e)")
        if letter not in allowed:
            raise _Bad(f"{letter} is not allowed {where} (allowed: {', '.join(allowed)})")
        if letter in out:
            raise _Bad(f"dimension {letter} given twice")
        if size < 1:
            raise _Bad(f"{letter}{m.group(2)}: sizes must be positive integers")
        out[letter] = size
    if pos != len(text):
        raise _Bad(f"cannot read dimensions {text.strip()!r} at {text[pos:].strip()!r} "
                   "(expected letter+number pairs such as d2t4)")
    return out


def _folded(backend: str, body: str) -> dict[str, int]:
    """'(attn:d1p4t2c2|ffn:d1p4t1e4)' -> sizes of one component (dp,tp,pp,cp from attn; ep,etp from ffn)."""
    if backend not in FOLDING_BACKENDS:
        raise _Bad(f"MoE parallel folding (attn:/ffn:) is not allowed for backend {backend} "
                   f"(allowed: {', '.join(FOLDING_BACKENDS)})")
    inner = body.strip()
    if inner.startswith("(") != inner.endswith(")"):
        raise _Bad("unbalanced parentheses around attn:/ffn:")
    inner = inner[1:-1] if inner.startswith("(") else inner
    sections: dict[str, dict[str, int]] = {}
    for part in inner.split("|"):
        m = _SECTION.match(part)
        if not m:
            raise _Bad(f"expected attn:<dims>|ffn:<dims>, got {part.strip()!r}")
        label = m.group(1)
        if label in sections:
            raise _Bad(f"section {label}: given twice")
        sections[label] = _dims(m.group(2), SECTION_DIMS[label], f"in {label}:")
    if set(sections) != {"attn", "ffn"}:
        raise _Bad("MoE parallel folding needs both attn:<dims> and ffn:<dims>")
    attn, ffn = sections["attn"], sections["ffn"]
    dp, tp, pp, cp = (attn.get(k, 1) for k in "dtpc")
    ep, etp = ffn.get("e", 1), ffn.get("t", 1)
    if ffn.get("p", pp) != pp:
        raise _Bad(f"p must be equal in attn and ffn (attn p{pp}, ffn p{ffn['p']})")
    world = dp * tp * pp * cp
    if "d" in ffn and ffn["d"] * etp * ep * pp != world:
        raise _Bad(f"attn and ffn must cover the same devices (attn d*t*p*c = {world}, "
                   f"ffn d*t*p*e = {ffn['d'] * etp * ep * pp})")
    return {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "etp": etp}  # ffn's d when omitted: the edp


def _component(text: str) -> Component:
    m = _COMPONENT.match(text.strip())
    if not m and not _DIMS_ONLY.match(text):
        raise _Bad("missing ':' between backend and dimensions (expected backend[name]:dims, e.g. megatron:d2t4)")
    if not m or not m.group("backend"):
        raise _Bad("a backend is required, as in backend[name]:dims "
                   f"(backends: {', '.join(BACKEND_DIMS)}; e.g. megatron:d2t4, vllm[rollout]:d4t2)")
    backend, name, body = m.group("backend"), m.group("name"), m.group("body")
    if backend not in BACKEND_DIMS:
        raise _Bad(f"unknown backend {backend!r} (known: {', '.join(BACKEND_DIMS)})")
    if name is not None and not _NAME.match(name):
        raise _Bad(f"bad name {name!r} (letters, digits, _ and -, not starting with a digit)")
    if _SECTION.match(body.lstrip("( ")):
        sizes = _folded(backend, body)
    else:
        d = _dims(body, BACKEND_DIMS[backend], f"for backend {backend}")
        sizes = {"dp": d.get("d", 1), "tp": d.get("t", 1), "pp": d.get("p", 1), "cp": d.get("c", 1),
                 "ep": d.get("e", 1)}
        sizes["etp"] = 1 if sizes["ep"] > 1 else sizes["tp"]
    try:
        dims = ParallelDims(**sizes)
    except ValueError as exc:
        raise _Bad(str(exc)) from None
    return Component(backend=backend, name=name, dims=dims, text=text.strip())


def parse_allocation(spec: str, path: Sequence[PathPart] = ()) -> list[Component]:
    """Parse an allocation string; raise ConfigError with every problem found (at `path`)."""
    path = tuple(path)
    problems: list[Problem] = []

    def bad(message: str, part: str | None = None) -> None:
        where = f"component {part.strip()!r}: " if part is not None else ""
        problems.append(Problem(path, f"{spec!r}: {where}{message}"))

    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"empty allocation string {spec!r}; expected e.g. 'vllm:d2t4+megatron:d2t4'", path)
    groups: list[list[Component]] = []
    for group_text in _split_top(spec, "+"):
        # `megatron:attn:..|ffn:..` without parentheses: rejoin the ffn/attn part to its component
        parts: list[str] = []
        for part in _split_top(group_text, "|"):
            if parts and _SECTION.match(part):
                parts[-1] += "|" + part
            else:
                parts.append(part)
        group = []
        for part in parts:
            if not part.strip():
                bad("empty component (two operators in a row, or one at an end)")
                continue
            try:
                group.append(_component(part))
            except _Bad as e:
                bad(str(e), part)
        groups.append(group)
    if problems:
        raise ConfigError(problems)

    flat = [c for g in groups for c in g]
    seen: set[str] = set()
    for c in flat:
        if c.name in seen:
            bad(f"name {c.name!r} is used twice (names must be unique)", c.text)
        if c.name is not None:
            seen.add(c.name)
    if len(flat) >= 3:
        for c in flat:
            if c.name is None:
                bad("needs a name, as in backend[name]:dims (names are required with 3 or more components)",
                    c.text)
    out: list[Component] = []
    for group in groups:
        anchor = group[0]
        for i, c in enumerate(group):
            if len(group) > 1 and c.name is None and len(flat) < 3:
                bad("needs a name, as in backend[name]:dims (members of a '|' colocation group are named)",
                    c.text)
            if c.dims.world_size != anchor.dims.world_size:
                bad(f"colocated components need equal world sizes ({anchor.label!r} has "
                    f"{anchor.dims.world_size}, {c.label!r} has {c.dims.world_size})", c.text)
            out.append(c if i == 0 else replace(c, colocated_with=anchor.name))
    if problems:
        raise ConfigError(problems)
    return out


def spell(backend: str, dp: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1, etp: int = 1) -> str:
    """The allocation string of these sizes (ParallelDims' names; the inverse of parsing), those of 1
    other than dp left out. Experts split by tensor parallel too (etp > 1, megatron-core's default
    etp = tp in verl and ROLL) need MoE folding to say so."""
    dims = "".join(f"{k}{v}" for k, v in (("t", tp), ("p", pp), ("c", cp)) if v > 1)
    if ep > 1 and etp > 1:
        return f"{backend}:(attn:d{dp}{dims}|ffn:t{etp}" + (f"p{pp}" if pp > 1 else "") + f"e{ep})"
    return f"{backend}:d{dp}{dims}" + (f"e{ep}" if ep > 1 else "")
