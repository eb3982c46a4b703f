"""A service's config section from its command line: `--config FILE` (the section the launcher wrote,
asyncrl.config.write_section), then a flag per field for a person running the service alone.

The flags are generated from the section's dataclass, so a field added there has its flag at once:
`--field-name` (nested sections: `--sampling-temperature`, and `--sampling JSON` for the whole one),
`--x/--no-x` for booleans, a repeated flag for a list, `k=v,k=v` for a dict. Values are converted and
checked by asyncrl.config.load_section, so a flag and the file fail the same way, naming the field.
Secrets have no generated flag: each service declares its own, defaulting to an environment variable.
"""

from __future__ import annotations

import argparse
import json
import typing
from dataclasses import fields, is_dataclass
from typing import Any, Iterator, Optional

from asyncrl.config import Section, field_docs, is_secret, load_section

DEST = "section:"
"""Prefix of the argparse dests of generated flags (kept apart from a service's own flags)."""


def add_section_flags(parser: argparse.ArgumentParser, cls: type, names: Optional[dict[str, str]] = None) -> None:
    """`--config FILE` and the flags of every field of `cls` but its secrets; `names` gives a (dotted)
    field a flag other than its generated one (e.g. {"run_name": "--run"})."""
    names = names or {}
    parser.add_argument("--config", metavar="FILE", help="the section as JSON (the launcher writes "
                                                         "<run_dir>/config/*.json); the flags below override it")
    for key, kind, doc in _fields(cls):
        flag = names.get(key, "--" + key.replace(".", "-").replace("_", "-"))
        spec: dict[str, Any] = {"dest": DEST + key, "default": argparse.SUPPRESS, "help": doc.replace("%", "%%")}
        if is_dataclass(kind):
            if flag in names.values() and key not in names:
                continue  # its name is taken by one of its fields (e.g. --dynamic-sampling: its `enabled`)
            spec.update(type=lambda text, kind=kind: _sub_section(kind, text), metavar="JSON")
        elif kind is bool:
            spec["action"] = argparse.BooleanOptionalAction
        elif kind is list:
            spec.update(action="append", metavar="VALUE", help=f"{spec['help']} (repeat for each item)")
        elif kind is dict:
            spec.update(type=_pairs, metavar="K=V,...")
        else:
            spec["metavar"] = key.rpartition(".")[2].upper()
        parser.add_argument(flag, **spec)


def parse_section(parser: argparse.ArgumentParser, cls: type[Section], argv: Optional[list[str]] = None
                  ) -> tuple[Section, argparse.Namespace]:
    """Parse `argv`; -> (the section, the namespace for the service's own flags). A field that fails
    to load is a usage error (exit 2) naming it."""
    args = parser.parse_args(argv)
    try:
        return section_from_args(cls, args), args
    except ValueError as err:
        parser.error(str(err))


def section_from_args(cls: type[Section], args: argparse.Namespace) -> Section:
    """`cls` from --config (when given) and then the generated flags that were given."""
    overrides: dict[str, Any] = {}
    for dest, value in vars(args).items():
        if dest.startswith(DEST):
            *parents, name = dest[len(DEST):].split(".")
            node = overrides
            for parent in parents:
                node = node.setdefault(parent, {})
            node[name] = {**node.get(name, {}), **value} if isinstance(node.get(name), dict) else value
    return load_section(cls, args.config, overrides)


def _fields(cls: type, prefix: str = "") -> Iterator[tuple[str, Any, str]]:
    """(dotted name, kind, docstring) of every non-secret field: a nested dataclass (then its own fields),
    bool, list, dict, or str for every other scalar (load_section converts it)."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    for f in fields(cls):
        if is_secret(f):
            continue
        hint = _unwrap_optional(hints[f.name])
        kind = typing.get_origin(hint) or hint
        key = prefix + f.name
        if is_dataclass(kind):
            yield key, kind, docs.get(f.name, "")
            yield from _fields(kind, key + ".")
        else:
            yield key, kind if kind in (bool, list, dict) else str, docs.get(f.name, "")


def _unwrap_optional(hint: Any) -> Any:
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if typing.get_origin(hint) is typing.Union and len(args) == 1 else hint


def _sub_section(cls: type, text: str) -> dict:
    """A nested section given whole as JSON; checked here so the error names the flag."""
    try:
        value = json.loads(text)
        load_section(cls, overrides=value)
    except (json.JSONDecodeError, ValueError) as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    return value


def _pairs(text: str) -> dict[str, str]:
    """'swe=2,terminal=1' -> {'swe': '2', 'terminal': '1'} (load_section converts the values)."""
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        if not sep:
            raise argparse.ArgumentTypeError(f"expected NAME=VALUE, got {part!r}")
        out[key.strip()] = value.strip()
    return out
