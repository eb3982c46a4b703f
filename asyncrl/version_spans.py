"""Per-token weight versions as `meta_info.weight_versions` spans (docs/protocols/engine.md): the engine
writes them for its responses, the gateway for the turns it assembles from several engine calls."""

from __future__ import annotations

from typing import Any, Optional


def version_spans(versions: list[Any], spans: Optional[list[dict[str, Any]]] = None, offset: int = 0
                  ) -> list[dict[str, Any]]:
    """Per-token weight versions -> `weight_versions` spans [{"version", "start", "end"}] (versions as strings).
    Given `spans` (of the tokens before `offset`), extends them in place with the tokens from `offset` on."""
    spans = [] if spans is None else spans
    for i, version in enumerate(map(str, versions), start=offset):
        if spans and spans[-1]["version"] == version:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": version, "start": i, "end": i + 1})
    return spans
