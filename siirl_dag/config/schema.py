"""JSON Schema (draft 2020-12) validation with defaults filled and errors a person can act on.

The schema files in `siirl_dag/schemas/` are the definition of the pipeline language; this module only loads
them, fills defaults (the jsonschema FAQ recipe: extend the `properties` keyword) and turns
jsonschema's errors into `Problem`s with "did you mean" hints for misspelt keys and values.
"""

from __future__ import annotations

import copy
import difflib
import json
import math
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError, best_match

from siirl_dag.errors import Problem

SCHEMA_DIR = Path(__file__).resolve().parents[1] / "schemas"  # package data

_JSON_TYPES = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a float", type(None): "null"}


def is_int(value: Any) -> bool:
    """A real int: JSON Schema's integer also takes 2.0, which later fails in range() or numpy, and
    Python's bool is an int."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_count(value: Any) -> bool:
    """A non-negative integer that fits int64 (JSON allows any size)."""
    return is_int(value) and 0 <= value < 2**63


def _is_integer(checker, instance) -> bool:
    return is_int(instance)


def _is_number(checker, instance) -> bool:
    """A finite number: NaN passes every minimum/maximum comparison, and no setting is infinite."""
    return is_int(instance) or (isinstance(instance, float) and math.isfinite(instance))


# The validator every schema of the project is checked with (pipelines, node params, strategy options).
StrictValidator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine_many({"integer": _is_integer, "number": _is_number}),
)


def _fill_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def properties_with_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if isinstance(sub, dict) and "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
                # YAML reads a plain off / on as a boolean; a setting whose words (or default) include them means the word
                word = {False: "off", True: "on"}.get(instance.get(name)) if isinstance(instance.get(name), bool) else None
                if word and isinstance(sub, dict) and (word in sub.get("enum", ()) or word == sub.get("default")):
                    instance[name] = word
        yield from validate_properties(validator, properties, instance, schema)

    return validators.extend(validator_class, {"properties": properties_with_defaults})


_DefaultingValidator = _fill_defaults(StrictValidator)


@lru_cache(maxsize=None)
def load_schema(relative: str) -> dict:
    """Load and self-check a schema file under schemas/ (e.g. 'pipeline.schema.json')."""
    schema = json.loads((SCHEMA_DIR / relative).read_text(encoding="utf-8"))
    Draft202012Validator.check_schema(schema)
    return schema


def schema_exists(relative: str) -> bool:
    return (SCHEMA_DIR / relative).is_file()


def _suggest(word: str, choices) -> str:
    close = difflib.get_close_matches(str(word), [str(c) for c in choices], n=1, cutoff=0.6)
    return f"did you mean '{close[0]}'?" if close else ""


def describe(value: Any) -> str:
    """'a mapping', 'a list', ...: a value's kind in the words of the messages."""
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _type_problem(inst: Any, want: str) -> str:
    """NaN and infinity are floats, so 'is a float' would not say what is wrong with them."""
    if isinstance(inst, float) and not math.isfinite(inst):
        return f"{inst!r} is not a finite number; expected a finite {want}"
    return f"{inst!r} is {describe(inst)}; expected {want}"


def _refused_for_type(error: ValidationError) -> set[int]:
    """The branches of a oneOf/anyOf that refused the instance for its type (by index)."""
    return {e.relative_schema_path[0] for e in error.context if e.validator == "type" and len(e.relative_schema_path) == 2}


def _fitting_branch(error: ValidationError) -> list[ValidationError]:
    """The errors of the one oneOf/anyOf branch whose type fits the instance, so that a mapping is
    told what is wrong inside it rather than that it is not a string; best_match's pick otherwise."""
    branches: dict[int, list[ValidationError]] = {}
    for sub in error.context:
        branches.setdefault(sub.relative_schema_path[0], []).append(sub)
    refused = _refused_for_type(error)
    fitting = [subs for i, subs in branches.items() if i not in refused]
    return fitting[0] if len(fitting) == 1 else [best_match(error.context)]


def _types_of_branches(error: ValidationError) -> list[str]:
    """The types the branches of a oneOf/anyOf take, where each refused the instance for its type; else []."""
    refused = _refused_for_type(error)
    if len(refused) < len(error.validator_value):
        return []
    types = [b["type"] for b in error.validator_value]
    return list(dict.fromkeys(x for ty in types for x in ([ty] if isinstance(ty, str) else ty)))


_MIN_SIZES = {"minItems": "item(s)", "minProperties": "key(s)", "minLength": "character(s)"}
_BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
_TYPE_WORDS = {"object": "a mapping", "array": "a list", "string": "a string", "boolean": "a boolean",
               "integer": "an integer", "number": "a number", "null": "null"}


def _branch_words(branch: dict) -> str:
    """A oneOf/anyOf branch of one plain type, in words with its bounds ('an integer >= 1'); '' otherwise."""
    if not isinstance(branch.get("type"), str):
        return ""
    bounds = " and ".join(f"{op} {branch[k]}" for k, op in _BOUNDS.items() if k in branch)
    return _TYPE_WORDS.get(branch["type"], branch["type"]) + (f" {bounds}" if bounds else "")


def _problems_from(error: ValidationError, base: tuple, besides: str = "") -> Iterator[Problem]:
    """`besides`: what the other branches of a oneOf/anyOf take, for an enum branch's message."""
    path = base + tuple(error.absolute_path)
    kw, schema, inst = error.validator, error.schema, error.instance
    if kw in ("oneOf", "anyOf") and error.context:
        wanted = _types_of_branches(error)
        if wanted:  # no branch takes a value of this type: all of them said, not best_match's one
            yield Problem(path, _type_problem(inst, " or ".join(wanted)))
            return
        besides = "".join(f", or {words}" for i in sorted(_refused_for_type(error))
                          if (words := _branch_words(error.validator_value[i])))
        for sub in _fitting_branch(error):  # the others' types belong to this value, not to one inside it
            yield from _problems_from(sub, base, besides if not sub.relative_path else "")
        return
    if kw == "additionalProperties" and isinstance(inst, dict):
        known = list(schema.get("properties", {}))
        for extra in sorted(k for k in inst if k not in known):
            hint = _suggest(extra, known)
            expected = hint or (f"expected one of: {', '.join(known)}" if known else "no keys are allowed here")
            yield Problem(path + (extra,), f"unknown key '{extra}'; {expected}")
        return
    if kw == "required":
        missing = error.message.split("'")[1] if "'" in error.message else error.message
        yield Problem(path, f"missing required key '{missing}'")
        return
    if kw == "type":
        want = error.validator_value
        want = " or ".join(want) if isinstance(want, list) else want
        yield Problem(path, _type_problem(inst, want))
        return
    if kw in _BOUNDS:
        allowed = " and ".join(f"{op} {schema[k]}" for k, op in _BOUNDS.items() if k in schema)
        yield Problem(path, f"{inst!r} is out of range; expected a value {allowed}")
        return
    if kw in _MIN_SIZES:
        yield Problem(path, f"{inst!r} is too short; expected at least {error.validator_value} {_MIN_SIZES[kw]}")
        return
    if kw == "enum":
        hint = _suggest(inst, error.validator_value)
        choices = ", ".join(repr(c) for c in error.validator_value)
        yield Problem(path, f"{inst!r} is not allowed; {hint + ' ' if hint else ''}expected one of: {choices}{besides}")
        return
    if kw == "pattern":
        desc = schema.get("description", f"a string matching {error.validator_value}")
        yield Problem(path, f"{inst!r} does not match the expected form; expected {desc}")
        return
    yield Problem(path, f"{error.message}")


def _subschema(relative: str) -> dict:
    """'file.json' or 'file.json#/$defs/name' (a self-contained definition inside a file)."""
    file, _, pointer = relative.partition("#")
    found = load_schema(file)
    for key in filter(None, pointer.split("/")):
        found = found[key]
    return found


def validate(instance: Any, relative_schema: str, base_path: tuple = ()) -> list[Problem]:
    """Validate `instance` in place (defaults are filled); return problems sorted by path."""
    validator = _DefaultingValidator(_subschema(relative_schema))
    problems = [p for e in validator.iter_errors(instance) for p in _problems_from(e, base_path)]
    return sorted(problems, key=lambda p: [str(x) for x in p.path])
