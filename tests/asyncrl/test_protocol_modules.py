"""asyncrl/protocols/ holds wire types and their validators only (issue 18): logic that reads or builds
them lives with its users (rollout/batch.py, asyncrl/engine_response.py, asyncrl/version_spans.py)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import types
from enum import Enum

import pytest
from pydantic import BaseModel

import asyncrl.protocols

MODULES = [m.name for m in pkgutil.iter_modules(asyncrl.protocols.__path__, "asyncrl.protocols.")]


def logic_in(module: types.ModuleType) -> list[str]:
    """Public functions and non-model classes the module defines (private helpers of validators pass)."""
    found = []
    for attr, value in vars(module).items():
        if attr.startswith("_") or getattr(value, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(value) or (inspect.isclass(value) and not issubclass(value, (BaseModel, Enum))):
            found.append(attr)
    return found


@pytest.mark.parametrize("name", MODULES)
def test_protocol_module_defines_only_wire_types(name):
    assert not logic_in(importlib.import_module(name)), f"{name} defines logic beside its wire types"


def test_logic_in_finds_public_functions_and_plain_classes():
    module = types.ModuleType("fake_protocol")
    exec("from pydantic import BaseModel\n"
         "class Wire(BaseModel):\n    x: int\n"
         "class Accumulator:\n    pass\n"
         "def split(x):\n    return x\n"
         "def _validator_helper(x):\n    return x\n", module.__dict__)
    assert sorted(logic_in(module)) == ["Accumulator", "split"]
    assert "asyncrl.protocols.engine" in MODULES


def clashing_names(modules: list[types.ModuleType]) -> dict[str, list[str]]:
    """Class names defined by more than one of `modules` (private bases included) -> those modules."""
    where: dict[str, list[str]] = {}
    for module in modules:
        for attr, value in vars(module).items():
            if inspect.isclass(value) and value.__module__ == module.__name__:
                where.setdefault(attr, []).append(module.__name__)
    return {name: found for name, found in where.items() if len(found) > 1}


def test_no_two_wire_types_share_a_name():
    """Two `SamplingParams` (the engine's SGLang fields, the endpoint's OpenAI ones) read as one type in a
    module that imports either; each wire type has a name of its own."""
    assert clashing_names([importlib.import_module(name) for name in MODULES]) == {}
    a, b = types.ModuleType("a"), types.ModuleType("b")
    for module in (a, b):
        exec("class Params:\n    pass\n", module.__dict__)
    assert clashing_names([a, b]) == {"Params": ["a", "b"]}
