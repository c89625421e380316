"""The settings of rollout correction, parsed as verl parses them and checked once (the door calls
these too, without torch): `rollout_is_threshold` one number (TIS) or "lower_upper" (IcePop);
`rollout_rs` options comma-chained; `rollout_rs_threshold` one entry for all options or one per
option, a band for k1 options and an upper bound for the others. Each ValueError says what is
expected."""

from __future__ import annotations

import math
from dataclasses import dataclass

IS_LEVELS = ("token", "sequence")
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
              "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")


def _number(text: str, expected: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{text!r} is not a positive number; {expected}")
    return value


def _band(spec: str, expected: str) -> tuple[float, float]:
    lower, upper = (_number(part, expected) for part in spec.split("_", 1))
    if lower > upper:
        raise ValueError(f"the band {spec!r} has its lower bound above its upper; expected lower <= upper")
    return lower, upper


def parse_is_threshold(spec) -> tuple[float, float | None]:
    """(upper, lower) of `rollout_is_threshold`: one positive number (TIS, lower None) or "lower_upper"
    (IcePop). ValueError says what is expected."""
    expected = "expected a positive number (TIS) or a band \"lower_upper\" such as \"0.5_5.0\" (IcePop)"
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{spec!r} is not a threshold; {expected}")
    text = str(spec).strip()
    if "_" in text:
        lower, upper = _band(text, expected)
        return upper, lower
    return _number(text, expected), None


def parse_rs(spec: str) -> list[str]:
    """The options of `rollout_rs`, comma-chained, each once, in their order."""
    options = [o.strip() for o in str(spec).split(",") if o.strip()]
    unknown = [o for o in options if o not in RS_OPTIONS]
    if unknown or not options:
        raise ValueError(f"unknown option(s) {', '.join(map(repr, unknown)) or repr(spec)}; expected one or more of "
                         f"{', '.join(RS_OPTIONS)}, joined by commas")
    return list(dict.fromkeys(options))


def parse_rs_thresholds(options: list[str], spec) -> dict[str, tuple[float | None, float]]:
    """Per option its (lower, upper): `spec` one entry for all options or a comma list of one per
    option; k1 options a band of the ratio ("lower_upper", or u meaning [1/u, u]), the others an
    upper bound on their divergence."""
    if spec is None:
        raise ValueError("missing; expected rollout_rs_threshold: a number, \"lower_upper\" for k1 options (e.g. "
                         "\"0.999_1.001\"), or a comma list with one entry per rollout_rs option")
    if isinstance(spec, bool) or not isinstance(spec, (int, float, str)):
        raise ValueError(f"{spec!r} is not a threshold; expected a number, or a string of comma-separated entries")
    entries = [str(spec)] if not isinstance(spec, str) else [e.strip() for e in spec.split(",") if e.strip()]
    if len(entries) not in (1, len(options)):
        raise ValueError(f"{len(entries)} entries for {len(options)} rollout_rs options ({', '.join(options)}); "
                         f"expected one entry for all, or {len(options)}")
    out: dict[str, tuple[float | None, float]] = {}
    for option, entry in zip(options, entries * len(options) if len(entries) == 1 else entries):
        if option.endswith("k1"):
            expected = f"expected for {option} a band \"lower_upper\" of the ratio, or one positive number u: [1/u, u]"
            out[option] = _band(entry, expected) if "_" in entry else (1.0 / _number(entry, expected),
                                                                      _number(entry, expected))
        elif "_" in entry:
            raise ValueError(f"{entry!r} is a band, but {option} takes an upper bound only (k2 and k3 are divergences "
                             ">= 0); expected one positive number")
        else:
            out[option] = (None, _number(entry, f"expected for {option} one positive number (an upper bound)"))
    return out


@dataclass(frozen=True)
class Correction:
    """The settings of one correction, parsed: the IS level (None: no weights), its (upper, lower)
    bounds, whether the weights are rescaled to mean 1, and per rejection option its band (None: no
    rejection)."""
    level: str | None
    upper: float
    lower: float | None
    batch_normalize: bool
    rs_bands: dict[str, tuple[float | None, float]] | None


def parse(rollout_is: str | None = None, rollout_is_threshold=2.0, rollout_is_batch_normalize: bool = False,
          rollout_rs: str | None = None, rollout_rs_threshold=None) -> Correction:
    """verl's keyword settings (the update's params) as a Correction; ValueError says what is expected."""
    if rollout_is is not None and rollout_is not in IS_LEVELS:
        raise ValueError(f"unknown rollout_is {rollout_is!r}; expected one of {', '.join(IS_LEVELS)}")
    upper, lower = parse_is_threshold(rollout_is_threshold)
    bands = None if rollout_rs is None else parse_rs_thresholds(parse_rs(rollout_rs), rollout_rs_threshold)
    return Correction(rollout_is, upper, lower, bool(rollout_is_batch_normalize), bands)
