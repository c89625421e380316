"""Pipelines written to a test's folder and loaded, or refused: the helpers the language's tests share."""

from __future__ import annotations

import pytest

from siirl_dag.config import load_pipeline
from siirl_dag.errors import ConfigError


def load(tmp_path, text, overrides=()):
    f = tmp_path / "p.yaml"
    f.write_text(text)
    return load_pipeline(f, list(overrides))


def errors(tmp_path, text, overrides=()) -> list:
    """The error problems of a pipeline that must be refused."""
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text, overrides)
    return [p for p in info.value.problems if p.severity == "error"]


def messages(tmp_path, text, overrides=()) -> str:
    return "\n".join(map(str, errors(tmp_path, text, overrides)))


def line_of(text, needle):
    return next(i for i, line in enumerate(text.splitlines(), 1) if needle in line)
