"""The engine's refusals of a control call (imports nothing, so every rollout module may raise them)."""

from __future__ import annotations


class Refused(Exception):
    """A control call the engine refused: answered as SGLang does, `{"success": false, "message"}` with
    `status` (400 for a bad call, 409 for one that conflicts with another under way)."""

    def __init__(self, message: str, status: int = 400) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
