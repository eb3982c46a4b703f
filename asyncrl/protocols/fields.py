"""Bounded field types the wire types share: what a client may send is checked for type and range at
the edge (a 4xx naming the field), so nothing unbounded or unusable reaches a registry, a log line or a
sandbox path."""

from __future__ import annotations

from typing import Annotated
from urllib.parse import urlsplit

from pydantic import AfterValidator, Field, StringConstraints

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
