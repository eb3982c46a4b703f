"""Typed tool parameters: the JSON schema of a tool's arguments, and the check of the model's arguments.

    from envs.sdk import param, schema

    schema({
        "path": "file to read, relative to the repository",          # a plain description: a required string
        "start": param.integer("first line, 1-based", minimum=1, default=1),   # a default makes it optional
        "mode": param.enum(["text", "hex"], "how to show the bytes"),
        "limit": param.number("seconds to wait at most", minimum=0, optional=True),
        "tags": param.array(param.string(), "labels to attach", optional=True),
        "verbose": param.boolean("explain each step", default=False),
    })

`schema()` returns the `parameters` object of an OpenAI function tool (`{"type": "object",
"properties": ..., "required": [...], "additionalProperties": false}`). `check_arguments()` is what
the AgentLoop runs on every call before the tool: a wrong type, a value outside its enum or bounds,
a missing or an unknown argument comes back to the model as an error observation (the tool is not
called); a valid call reaches the tool with defaults filled in and `null` for an optional argument
treated as not given.

The checker understands the JSON-schema keywords these helpers produce and the common ones of
hand-written schemas: type (one or a list), enum, const, minimum, maximum, exclusiveMinimum,
exclusiveMaximum, minLength, maxLength, pattern, items, minItems, maxItems, properties, required,
additionalProperties, default. Other keywords are passed to the model and not checked.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union


class _Missing:
    def __repr__(self) -> str:
        return "MISSING"


MISSING: Any = _Missing()
"""No default given."""


@dataclass(frozen=True)
class Param:
    """One argument: its JSON schema, whether the model may leave it out, and its default."""

    json: dict[str, Any]
    optional: bool = False
    default: Any = MISSING

    def __post_init__(self) -> None:
        if self.default is not MISSING:
            object.__setattr__(self, "optional", True)
            problems = _check(self.json, self.default, "default")
            if problems:
                raise ValueError(f"the default does not fit its own schema: {'; '.join(problems)}")

    def json_schema(self) -> dict[str, Any]:
        return {**self.json, **({} if self.default is MISSING else {"default": self.default})}


Spec = Union[str, Param, dict]
"""What schema() and array() take for one value: a description (a string argument), a Param, or a
hand-written JSON schema."""


def _param(json_schema: dict[str, Any], description: str, optional: bool, default: Any, **keywords: Any) -> Param:
    extra = {k: v for k, v in keywords.items() if v is not None}
    return Param({**json_schema, **({"description": description} if description else {}), **extra}, optional, default)


def string(description: str = "", *, min_length: Optional[int] = None, max_length: Optional[int] = None,
           pattern: Optional[str] = None, optional: bool = False, default: Any = MISSING) -> Param:
    return _param({"type": "string"}, description, optional, default, minLength=min_length, maxLength=max_length,
                  pattern=pattern)


def integer(description: str = "", *, minimum: Optional[int] = None, maximum: Optional[int] = None,
            optional: bool = False, default: Any = MISSING) -> Param:
    """A whole number (the model's 3.0 is accepted as 3; true, "3" and 3.5 are not)."""
    return _param({"type": "integer"}, description, optional, default, minimum=minimum, maximum=maximum)


def number(description: str = "", *, minimum: Optional[float] = None, maximum: Optional[float] = None,
           optional: bool = False, default: Any = MISSING) -> Param:
    return _param({"type": "number"}, description, optional, default, minimum=minimum, maximum=maximum)


def boolean(description: str = "", *, optional: bool = False, default: Any = MISSING) -> Param:
    return _param({"type": "boolean"}, description, optional, default)


def enum(values: Sequence[Union[str, int, float, bool]], description: str = "", *, optional: bool = False,
         default: Any = MISSING) -> Param:
    """One of `values` (strings, or numbers); typed when they all share one JSON type."""
    values = list(values)
    if not values:
        raise ValueError("enum() needs at least one value")
    types = {_json_type(v) for v in values}
    typed = {"type": types.pop()} if len(types) == 1 else {}
    return _param({**typed, "enum": values}, description, optional, default)


def array(items: Spec, description: str = "", *, min_items: Optional[int] = None, max_items: Optional[int] = None,
          optional: bool = False, default: Any = MISSING) -> Param:
    """A list whose every element is `items` (a Param, a JSON schema, or a description of a string)."""
    return _param({"type": "array", "items": _value_schema(items)}, description, optional, default,
                  minItems=min_items, maxItems=max_items)


def obj(properties: dict[str, Spec], description: str = "", *, optional: bool = False,
        default: Any = MISSING) -> Param:
    """A nested object with its own named fields (same rules as schema())."""
    return _param(schema(properties), description, optional, default)


def schema(properties: dict[str, Spec], required: Optional[list[str]] = None) -> dict[str, Any]:
    """The arguments object of a tool. A value is a description (a required string argument), a Param
    (string(), integer(), enum(), ... : required unless optional or with a default) or a JSON schema
    of its own (required). `required` overrides which names are required."""
    props = {name: _value_schema(spec) for name, spec in properties.items()}
    if required is None:
        required = [name for name, spec in properties.items() if not (isinstance(spec, Param) and spec.optional)]
    unknown = [name for name in required if name not in props]
    if unknown:
        raise ValueError(f"required names {unknown} are not among the properties {list(props)}")
    return {"type": "object", "properties": props, "required": list(required), "additionalProperties": False}


def _value_schema(spec: Spec) -> dict[str, Any]:
    if isinstance(spec, str):
        return {"type": "string", **({"description": spec} if spec else {})}
    if isinstance(spec, Param):
        return spec.json_schema()
    if isinstance(spec, dict):
        return dict(spec)
    raise TypeError(f"expected a description, a Param or a JSON schema dict, got {type(spec).__name__}")


# The check --------------------------------------------------------------------------------------
def check_arguments(parameters: dict[str, Any], args: Any) -> tuple[dict[str, Any], list[str]]:
    """(the arguments to call the tool with, problems). With problems the tool must not be called;
    each names the argument and what is wrong, for the model to read."""
    if not isinstance(args, dict):
        return {}, [f"the arguments must be a JSON object, got {_shown(args)}"]
    properties: dict[str, Any] = parameters.get("properties", {}) or {}
    required_names = list(parameters.get("required", []) or [])
    required = set(required_names)
    additional = parameters.get("additionalProperties", False)
    cleaned: dict[str, Any] = {}
    problems: list[str] = []
    unknown = [name for name in args if name not in properties and additional is False]
    for name, value in args.items():
        spec = properties.get(name)
        if spec is None:
            if isinstance(additional, dict):
                problems += _check(additional, value, name)
            if additional is not False:
                cleaned[name] = value
            continue
        if value is None and name not in required and not _allows_null(spec):
            continue  # an optional argument sent as null: not given
        problems += _check(spec, value, name)
        cleaned[name] = _normalised(spec, value)
    missing = [name for name in required_names if name not in args]
    for name, spec in properties.items():
        if name not in cleaned and name not in required and isinstance(spec, dict) and "default" in spec:
            cleaned[name] = copy.deepcopy(spec["default"])
    head = ([f"missing argument(s) {missing}"] if missing else []) + \
           ([f"unknown argument(s) {unknown} (expected: {', '.join(properties) or 'none'})"] if unknown else [])
    return cleaned, head + problems


def _check(spec: Any, value: Any, path: str) -> list[str]:
    """Problems of `value` against the JSON schema `spec` (the keywords of the module docstring)."""
    if not isinstance(spec, dict):
        return []  # True / {} / anything unknown accepts every value
    types = spec.get("type")
    if types is not None:
        allowed = [types] if isinstance(types, str) else list(types)
        if not any(_is_type(value, t) for t in allowed):
            return [f"{path}: expected {' or '.join(_an(t) for t in allowed)}, got {_shown(value)}"]
    if "enum" in spec and not any(_same(value, option) for option in spec["enum"]):
        return [f"{path}: expected one of {json.dumps(spec['enum'])}, got {_shown(value)}"]
    if "const" in spec and not _same(value, spec["const"]):
        return [f"{path}: expected {json.dumps(spec['const'])}, got {_shown(value)}"]
    problems: list[str] = []
    if _is_type(value, "number"):
        for key, ok, words in (("minimum", lambda v, b: v >= b, ">="), ("maximum", lambda v, b: v <= b, "<="),
                               ("exclusiveMinimum", lambda v, b: v > b, ">"),
                               ("exclusiveMaximum", lambda v, b: v < b, "<")):
            bound = spec.get(key)
            if isinstance(bound, (int, float)) and not isinstance(bound, bool) and not ok(value, bound):
                problems.append(f"{path}: must be {words} {bound:g}, got {value:g}")
    if isinstance(value, str):
        if isinstance(spec.get("minLength"), int) and len(value) < spec["minLength"]:
            problems.append(f"{path}: must be at least {spec['minLength']} characters long, got {len(value)}")
        if isinstance(spec.get("maxLength"), int) and len(value) > spec["maxLength"]:
            problems.append(f"{path}: must be at most {spec['maxLength']} characters long, got {len(value)}")
        if isinstance(spec.get("pattern"), str) and re.search(spec["pattern"], value) is None:
            problems.append(f"{path}: must match the pattern {spec['pattern']!r}, got {_shown(value)}")
    if isinstance(value, list):
        if isinstance(spec.get("minItems"), int) and len(value) < spec["minItems"]:
            problems.append(f"{path}: must have at least {spec['minItems']} items, got {len(value)}")
        if isinstance(spec.get("maxItems"), int) and len(value) > spec["maxItems"]:
            problems.append(f"{path}: must have at most {spec['maxItems']} items, got {len(value)}")
        if "items" in spec:
            for i, item in enumerate(value):
                problems += _check(spec["items"], item, f"{path}[{i}]")
    if isinstance(value, dict) and ("properties" in spec or "required" in spec or "additionalProperties" in spec):
        _, inner = check_arguments({"additionalProperties": True, **spec}, value)
        problems += [f"{path}.{p}" if not p.startswith(("missing", "unknown")) else f"{path}: {p}" for p in inner]
    return problems


def _normalised(spec: Any, value: Any) -> Any:
    """What the tool receives: integral floats where an integer is expected become ints (recursively);
    nested objects get their defaults."""
    if not isinstance(spec, dict):
        return value
    types = spec.get("type")
    allowed = [types] if isinstance(types, str) else list(types or [])
    if isinstance(value, float) and "integer" in allowed and "number" not in allowed and value.is_integer():
        return int(value)
    if isinstance(value, list) and "items" in spec:
        return [_normalised(spec["items"], item) for item in value]
    if isinstance(value, dict) and "properties" in spec:
        cleaned, _ = check_arguments({"additionalProperties": True, **spec}, value)
        return cleaned
    return value


_JSON_TYPES = {"string": (str,), "integer": (int,), "number": (int, float), "boolean": (bool,), "array": (list,),
               "object": (dict,), "null": (type(None),)}


def _is_type(value: Any, name: str) -> bool:
    if name not in _JSON_TYPES:
        return True
    if isinstance(value, bool) and name != "boolean":
        return False  # true is not 1 in JSON
    if name == "integer" and isinstance(value, float):
        return math.isfinite(value) and value.is_integer()
    if name == "number" and isinstance(value, float):
        return math.isfinite(value)
    return isinstance(value, _JSON_TYPES[name])


def _allows_null(spec: Any) -> bool:
    if not isinstance(spec, dict):
        return True
    types = spec.get("type")
    if types is None:
        return "enum" not in spec or None in spec["enum"]
    return "null" in ([types] if isinstance(types, str) else list(types))


def _same(a: Any, b: Any) -> bool:
    return a == b and isinstance(a, bool) == isinstance(b, bool)


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    raise TypeError(f"enum values must be strings, numbers or booleans, got {type(value).__name__}")


def _an(type_name: str) -> str:
    return {"integer": "an integer", "array": "an array", "object": "an object", "null": "null"}.get(
        type_name, f"a {type_name}")


def _shown(value: Any) -> str:
    """The value as the model wrote it (JSON, clipped), with its JSON type."""
    text = json.dumps(value) if not isinstance(value, float) or math.isfinite(value) else str(value)
    text = text if len(text) <= 60 else text[:57] + "..."
    kind = next(t for t, types in (("boolean", bool), ("integer", int), ("number", float), ("string", str),
                                  ("array", list), ("object", dict), (type(value).__name__, object))
                if isinstance(value, types))
    return text if value is None else f"{text} ({_an(kind)})"
