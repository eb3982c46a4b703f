"""Plugins: every setting that picks an implementation (a loss, a trainer or rollout backend, a session
provider, a weight pusher, a sandbox, a launcher component) names a built-in by its short name, or any
object by its import path.

An import path is `package.module:Name` or `package.module.Name` (the same object). Each plugin point
keeps one `dict[str, str]` of its built-in short names -> import paths and resolves its setting with
`load_plugin`, so a user's own class is configured exactly as a built-in, and nothing is imported before
it is chosen (megatron-core only when the megatron backend is)."""

from __future__ import annotations

import importlib
from typing import Any, Mapping, Optional

PATH_SYNTAX = "package.module:Name or package.module.Name"


class PluginNotFound(ImportError):
    """An import path that names nothing: its module (or a package above it) does not exist
    (`missing_module` names it), or the module has no such attribute (`missing_module` is None).
    A module that exists but fails to import raises its own error instead."""

    def __init__(self, message: str, missing_module: Optional[str] = None) -> None:
        super().__init__(message)
        self.missing_module = missing_module


def split_path(path: str) -> tuple[str, str]:
    """`a.b:C` or `a.b.C` -> ("a.b", "C")."""
    module, _, name = path.partition(":") if ":" in path else path.rpartition(".")
    if not (module and name):
        raise ValueError(f"{path!r} is not an import path ({PATH_SYNTAX})")
    return module, name


def load_object(path: str) -> Any:
    """The object an import path names; PluginNotFound saying whether the module or the attribute is missing."""
    module_name, name = split_path(path)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as err:
        if err.name is None or not (module_name == err.name or module_name.startswith(err.name + ".")):
            raise  # the module was found; something it imports is missing
        raise PluginNotFound(f"cannot import {path!r}: no module named {err.name!r}", err.name) from None
    try:
        return getattr(module, name)
    except AttributeError:
        raise PluginNotFound(f"cannot import {path!r}: module {module_name!r} "
                             f"({getattr(module, '__file__', None)}) has no attribute {name!r}") from None


def load_plugin(builtins: Mapping[str, str], value: str, setting: str) -> Any:
    """The object setting `setting` = `value` names: a key of `builtins`, else an import path."""
    if value in builtins:
        return load_object(builtins[value])
    if "." not in value and ":" not in value:
        raise ValueError(f"{setting} {value!r} not in {sorted(builtins)} and not an import path ({PATH_SYNTAX})")
    try:
        return load_object(value)
    except PluginNotFound as err:
        raise PluginNotFound(f"{setting}: {err} (built-ins: {sorted(builtins)})", err.missing_module) from None
