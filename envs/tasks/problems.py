"""Problem generators of the learnable tasks: short prompts, answers of a few tokens.

Each generator draws one problem from a seeded `random.Random`, so a task id always means the same
problem. A problem is a dialogue: one user prompt and one expected reply per turn.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

INTEGER = re.compile(r"-?\d+")


@dataclass(frozen=True)
class Problem:
    prompts: tuple[str, ...]
    """User messages, one per turn."""
    answers: tuple[str, ...]
    """The expected assistant reply of each turn."""


def arithmetic(rng: random.Random, max_operand: int, ops: str) -> Problem:
    a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
    return Problem((f"{a}{op}{b}=",), (str(_apply(a, op, b)),))


def chain(rng: random.Random, max_operand: int, ops: str, steps: int) -> Problem:
    """Multi-turn arithmetic: '3+4=' -> '7', then '+2=' -> '9', ... each turn builds on the last total."""
    total, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
    prompts, answers = [f"{total}{op}{b}="], []
    total = _apply(total, op, b)
    answers.append(str(total))
    for _ in range(steps - 1):
        b, op = rng.randint(0, max_operand), rng.choice(ops)
        total = _apply(total, op, b)
        prompts.append(f"{op}{b}=")
        answers.append(str(total))
    return Problem(tuple(prompts), tuple(answers))


def copy(rng: random.Random, alphabet: str, min_len: int, max_len: int) -> Problem:
    word = "".join(rng.choice(alphabet) for _ in range(rng.randint(min_len, max_len)))
    return Problem((f"copy {word}",), (word,))


def sort(rng: random.Random, min_len: int, max_len: int) -> Problem:
    digits = [rng.randint(0, 9) for _ in range(rng.randint(min_len, max_len))]
    return Problem(("sort " + " ".join(map(str, digits)),), (" ".join(map(str, sorted(digits))),))


def _apply(a: int, op: str, b: int) -> int:
    return {"+": a + b, "-": a - b, "*": a * b}[op]


def score_integer(expected: str, reply: str) -> float:
    """1 when the first integer in the reply is the expected one."""
    found = INTEGER.search(reply)
    return float(found is not None and found.group() == expected)


def score_exact(expected: str, reply: str) -> float:
    return float(reply.strip() == expected)


def score_positions(expected: str, reply: str) -> float:
    """Fraction of positions right (partial credit for sort); a reply of the wrong length scores by overlap."""
    want, got = expected.split(), reply.split()
    return sum(w == g for w, g in zip(want, got)) / max(len(want), len(got), 1)
