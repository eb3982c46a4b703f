"""Every field of every config dataclass says what it does and its unit, in the string literal right
after it (what `--cfg job` readers, docs and the generated flags' --help rely on)."""

import inspect
from dataclasses import dataclass, fields, is_dataclass

import asyncrl.config


def config_classes() -> list[type]:
    return [c for _, c in inspect.getmembers(asyncrl.config, inspect.isclass)
            if is_dataclass(c) and c.__module__ == asyncrl.config.__name__]


@dataclass
class Example:
    x: int = 1
    """X, in s."""
    y: int = 2
    z: int = 3


def test_field_docs_reads_the_literal_after_each_field():
    assert asyncrl.config.field_docs(Example) == {"x": "X, in s."}


def test_every_config_field_has_a_docstring():
    assert len(config_classes()) > 15
    missing = [f"{c.__name__}.{f.name}" for c in config_classes() for f in fields(c)
               if not asyncrl.config.field_docs(c).get(f.name, "").strip()]
    assert not missing, f"{len(missing)} fields of asyncrl/config.py without a docstring: {', '.join(missing)}"
