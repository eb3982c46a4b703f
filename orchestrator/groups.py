"""GRPO groups and their member episodes: the unit of work the orchestrator accepts and persists.

A member moves through

    pending ──dispatch──> running ──result──> done
       ^                     │
       └──failure/refusal────┤ (attempt + 1; a failure also counts towards max_attempts)
                             └──max_attempts failures──> given_up

A group is complete when every member is done or given up; then its GroupRecord is appended once.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

import msgpack

from asyncrl.types import GroupRecord


class MemberState(str, Enum):
    pending = "pending"
    running = "running"
    done = "done"
    given_up = "given_up"


@dataclass
class Member:
    index: int
    seed: int
    state: MemberState = MemberState.pending
    attempt: int = 0
    """Dispatches so far; the episode id of dispatch k ends in `-a{k}`."""
    incarnation: int = 1
    """Which start of the run's orchestrator made the current dispatch. A restarted one (its r-th start)
    adds `-r{r}` to its episode ids: the dead process may have sent attempts it had not yet written to
    Redis (the ledger writes behind dispatch), and their ids must not name a second episode."""
    failures: int = 0
    service: Optional[str] = None
    """env_id of the service running (or that last ran) it."""
    session_id: Optional[str] = None
    reward: Optional[float] = None
    status: Optional[str] = None
    """The env's episode status of the final result (completed, truncated, failed)."""
    num_turns: int = 0
    sample_refs: list[str] = field(default_factory=list)
    ready_at: float = 0.0
    """Monotonic time it became ready to dispatch (not persisted: the scheduling-overhead clock)."""

    @property
    def finished(self) -> bool:
        return self.state in (MemberState.done, MemberState.given_up)


@dataclass
class Group:
    group_id: str
    env: str
    task_id: str
    ordinal: int
    members: list[Member]
    created_at: float = field(default_factory=time.time)

    @classmethod
    def new(cls, env: str, task_id: str, ordinal: int, group_size: int, seed: int) -> "Group":
        """Member i gets episode seed (seed, ordinal, i) -> one integer; retries keep their seed."""
        base = (seed * 1_000_003 + ordinal) * group_size
        members = [Member(index=i, seed=base + i, ready_at=time.monotonic()) for i in range(group_size)]
        return cls(f"g{ordinal:07d}-{env}", env, task_id, ordinal, members)

    def episode_id(self, member: Member) -> str:
        restart = f"-r{member.incarnation}" if member.incarnation > 1 else ""
        return f"{self.group_id}-m{member.index}-a{member.attempt}{restart}"

    @property
    def complete(self) -> bool:
        return all(m.finished for m in self.members)

    def record(self) -> GroupRecord:
        refs = [ref for m in self.members for ref in m.sample_refs]
        return GroupRecord(self.group_id, self.task_id, self.env, refs, len(self.members))

    def encode(self) -> bytes:
        members = [{k: (v.value if isinstance(v, Enum) else v) for k, v in m.__dict__.items() if k != "ready_at"}
                   for m in self.members]
        return msgpack.packb({**self.__dict__, "members": members}, use_bin_type=True)

    @classmethod
    def decode(cls, blob: bytes) -> "Group":
        data: dict[str, Any] = msgpack.unpackb(blob, raw=False)
        data["members"] = [Member(**{**m, "state": MemberState(m["state"])}) for m in data["members"]]
        return cls(**data)


class TaskOrder:
    """The tasks of one env in a seeded order: epoch e is a shuffle by (seed, env, e), cycled forever
    (`shuffled`), or one pass in the env's own order (`listed`: evaluation plays every task once).
    Position n of the order is what the n-th group of that env plays, so a restart that keeps the
    cursor continues the same sequence."""

    def __init__(self, env: str, task_ids: list[str], seed: int, order: str = "shuffled") -> None:
        if not task_ids:
            raise ValueError(f"env {env!r} lists no tasks")
        self.env, self.task_ids, self.seed, self.shuffled = env, list(task_ids), seed, order == "shuffled"
        self._epoch, self._order = -1, self.task_ids

    def has(self, position: int) -> bool:
        """Whether the order goes on to `position` (a listed one ends after its tasks)."""
        return self.shuffled or position < len(self.task_ids)

    def __getitem__(self, position: int) -> str:
        epoch, offset = divmod(position, len(self.task_ids))
        if self.shuffled and epoch != self._epoch:
            self._order = list(self.task_ids)
            random.Random(f"{self.seed}:{self.env}:{epoch}").shuffle(self._order)
            self._epoch = epoch
        return self._order[offset]
