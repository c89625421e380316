"""JSON Schema (draft 2020-12) validation with defaults filled and errors a person can act on.

The schema files in `schemas/` are the definition of the pipeline language; this module only loads
them, fills defaults (the jsonschema FAQ recipe: extend the `properties` keyword) and turns
jsonschema's errors into `Problem`s with "did you mean" hints for misspelt keys and values.
"""

from __future__ import annotations

import copy
import difflib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterator

from jsonschema import Draft202012Validator, validators
from jsonschema.exceptions import ValidationError, best_match

from siirl_dag.errors import Problem

SCHEMA_DIR = Path(__file__).resolve().parents[2] / "schemas"

_JSON_TYPES = {dict: "a mapping", list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a number", type(None): "null"}


def _fill_defaults(validator_class):
    validate_properties = validator_class.VALIDATORS["properties"]

    def properties_with_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if isinstance(sub, dict) and "default" in sub and name not in instance:
                    instance[name] = copy.deepcopy(sub["default"])
        yield from validate_properties(validator, properties, instance, schema)

    return validators.extend(validator_class, {"properties": properties_with_defaults})


_DefaultingValidator = _fill_defaults(Draft202012Validator)


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


def _describe(value: Any) -> str:
    return _JSON_TYPES.get(type(value), type(value).__name__)


def _problems_from(error: ValidationError, base: tuple) -> Iterator[Problem]:
    path = base + tuple(error.absolute_path)
    kw, schema, inst = error.validator, error.schema, error.instance
    if kw in ("oneOf", "anyOf") and error.context:
        yield from _problems_from(best_match(error.context), base)
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
        yield Problem(path, f"{inst!r} is {_describe(inst)}; expected {want}")
        return
    if kw == "enum":
        hint = _suggest(inst, error.validator_value)
        choices = ", ".join(repr(c) for c in error.validator_value)
        yield Problem(path, f"{inst!r} is not allowed; {hint + ' ' if hint else ''}expected one of: {choices}")
        return
    if kw == "pattern":
        desc = schema.get("description", f"a string matching {error.validator_value}")
        yield Problem(path, f"{inst!r} does not match the expected form; expected {desc}")
        return
    yield Problem(path, f"{error.message}")


def validate(instance: Any, relative_schema: str, base_path: tuple = ()) -> list[Problem]:
    """Validate `instance` in place (defaults are filled); return problems sorted by path."""
    validator = _DefaultingValidator(load_schema(relative_schema))
    problems = [p for e in validator.iter_errors(instance) for p in _problems_from(e, base_path)]
    return sorted(problems, key=lambda p: [str(x) for x in p.path])
