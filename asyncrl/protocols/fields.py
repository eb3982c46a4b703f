"""Bounded field types the wire types share: what a client may send is checked for type and range at
the edge (a 4xx naming the field), so nothing unbounded or unusable reaches a registry, a log line or a
sandbox path."""

from __future__ import annotations

from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import (AfterValidator, Field, StringConstraints, ValidationError, ValidatorFunctionWrapHandler,
                      WrapValidator)

MAX_URL_CHARS = 2048
NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._-]*"
MAX_NAME_CHARS = 128
MAX_ID_CHARS = 256
PRINTABLE = r"^[^\x00-\x1f\x7f]*$"
"""No control characters (newlines forge log lines; NUL breaks paths)."""


def _http_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError("must be an http:// or https:// URL with a host")
    parts.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
    return url


HttpUrl = Annotated[str, StringConstraints(min_length=1, max_length=MAX_URL_CHARS, pattern=r"^\S+$"),
                    AfterValidator(_http_url)]
"""An http(s) URL with a host, at most MAX_URL_CHARS characters, kept as sent (no normalisation)."""
Name = Annotated[str, StringConstraints(min_length=1, max_length=MAX_NAME_CHARS, pattern=f"^{NAME_PATTERN}$")]
"""An env or domain name: letters, digits, `.`, `_`, `-` (it becomes part of ids, Redis keys, metric labels)."""
OptionalName = Annotated[str, StringConstraints(max_length=MAX_NAME_CHARS, pattern=f"^({NAME_PATTERN})?$")]
"""A Name, or "" for none."""
Id = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS, pattern=PRINTABLE)]
"""An id chosen by the caller (episode, task): printable, bounded."""
Secret = Annotated[str, StringConstraints(max_length=1024, pattern=PRINTABLE)]
"""A bearer credential."""
Seed = Annotated[int, Field(ge=-(2 ** 63), le=2 ** 63 - 1, strict=True)]
"""A 64-bit integer seed."""


ID_CHUNK = 65_536
"""Ids validated per pydantic call in a long list (~10 ms of it); between calls, other threads run."""


def _in_chunks(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate a long flat list of ids a chunk at a time. One pydantic call over a million ids holds the
    GIL for ~200 ms, so a service that parses a request in a thread would stall its event loop (its
    /health) that long; between chunks the GIL passes. A list of lists (a batch) goes in one call."""
    if not isinstance(value, list) or len(value) <= ID_CHUNK or isinstance(value[0], list):
        return handler(value)
    out: list[int] = []
    for start in range(0, len(value), ID_CHUNK):
        try:
            out += handler(value[start:start + ID_CHUNK])
        except ValidationError as err:
            first = err.errors()[0]
            index = next((p for p in first["loc"] if isinstance(p, int)), 0)
            raise ValueError(f"item {start + index}: {first['msg']}") from None
    return out


LongIds = WrapValidator(_in_chunks)
"""Annotate a token-id list field with it: `Annotated[list[TokenId], LongIds]`."""
