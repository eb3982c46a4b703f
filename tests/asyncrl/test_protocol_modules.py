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
