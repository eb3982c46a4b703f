"""Generates the swe env's tasks (envs/swe/data/tasks.jsonl): small Python repositories, each with one
planted bug, visible tests that fail because of it, and held-out tests used for the reward.

A task: pick a theme, 3 of its functions (functions.py) and one mutation site in one of them
(mutations.py); draw random arguments and compute the expected results with the correct code;
keep the mutant only if it fails at least one visible and one held-out case and never hangs.
The visible test file always contains a failing case; the held-out file has more cases (edge cases
drawn the same way) and is copied in only when the agent submits.

    python -m envs.swe.generate            # 300 tasks, seed 0 (the shipped file)
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import random
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

from envs.swe.functions import THEMES, FunctionSpec
from envs.swe.mutations import count_sites, mutate

DATA = Path(__file__).with_name("data") / "tasks.jsonl"
CANDIDATE_CASES = 40
VISIBLE_CASES, HIDDEN_CASES = 3, 8
OTHER_VISIBLE, OTHER_HIDDEN = 2, 3
MAX_LINES_PER_CALL = 20_000


class _Hang(Exception):
    pass


@dataclass(frozen=True)
class Failure:
    """What a call produced instead of a value: an exception (by type name) or a hang."""

    kind: str


@contextmanager
def _step_limit(max_lines: int) -> Iterator[None]:
    """Raise _Hang after max_lines executed lines: a hang check that does not depend on machine load,
    so generation gives the same tasks on any machine."""
    executed = 0

    def trace(frame, event, arg):
        nonlocal executed
        if event == "line":
            executed += 1
            if executed > max_lines:
                raise _Hang()
        return trace

    previous = sys.gettrace()
    sys.settrace(trace)
    try:
        yield
    finally:
        sys.settrace(previous)


def load(source: str, name: str) -> Callable:
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<{name}>", "exec"), namespace)  # noqa: S102 - our own generated code
    return namespace[name]


def same(got: Any, expected: Any) -> bool:
    if isinstance(got, Failure):
        return False
    if isinstance(expected, float):
        return isinstance(got, (int, float)) and math.isclose(got, expected, rel_tol=1e-9, abs_tol=1e-9)
    return type(got) is type(expected) and got == expected


def outcome(func: Callable, args: tuple) -> Any:
    """The result of func(*args) on a fresh copy of the arguments, or a Failure."""
    try:
        with _step_limit(MAX_LINES_PER_CALL):
            return func(*ast.literal_eval(repr(args)))
    except _Hang:
        return Failure("hang")
    except Exception as err:  # noqa: BLE001 - a crash is a legitimate test outcome
        return Failure(type(err).__name__)


def normalized(source: str) -> str:
    """One formatting for all code of a repo (ast.unparse), so the bug does not stand out by its style."""
    return ast.unparse(ast.parse(source)) + "\n"


def test_file(module_path: str, cases: dict[str, list[tuple[tuple, Any]]], class_name: str) -> str:
    package, module = module_path[:-3].split("/")
    lines = ["import math", "import unittest", "", f"from {package}.{module} import {', '.join(cases)}", "", "",
             f"class {class_name}(unittest.TestCase):",
             "    def check(self, func, cases):",
             "        for args, expected in cases:",
             "            with self.subTest(func=func.__name__, args=args):",
             "                got = func(*args)",
             "                if isinstance(expected, float):",
             "                    self.assertTrue(isinstance(got, (int, float)) and math.isclose(got, expected, "
             "rel_tol=1e-9, abs_tol=1e-9), f'{got!r} != {expected!r}')",
             "                else:",
             "                    self.assertEqual(got, expected)"]
    for name, rows in cases.items():
        lines += ["", f"    def test_{name}(self):", f"        self.check({name}, ["]
        lines += [f"            ({args!r}, {expected!r})," for args, expected in rows]
        lines += ["        ])"]
    return "\n".join(lines) + "\n"


def draw_cases(spec: FunctionSpec, rng: random.Random) -> list[tuple[tuple, Any]]:
    """Distinct argument tuples with the correct function's result (cases where it raises are dropped)."""
    correct = load(normalized(spec.source), spec.name)
    seen, cases = set(), []
    for _ in range(CANDIDATE_CASES * 3):
        args = spec.args(rng)
        if repr(args) in seen:
            continue
        seen.add(repr(args))
        expected = outcome(correct, args)
        if not isinstance(expected, Failure):
            cases.append((args, expected))
        if len(cases) == CANDIDATE_CASES:
            break
    return cases


@dataclass
class PlantedBug:
    spec: FunctionSpec
    source: str
    """The mutated function."""
    change: str
    """Where and what changed, e.g. 'line 4: <= -> <' (kept in the task record, never shown)."""
    visible: list[tuple[tuple, Any]]
    """Cases for the visible test file; the first one fails on the bug."""
    hidden: list[tuple[tuple, Any]]
    """Cases for the held-out test file; the first one fails on the bug."""


def plant_bug(rng: random.Random, spec: FunctionSpec) -> PlantedBug | None:
    """Mutate one site of spec; None unless at least two cases catch the bug and nothing hangs."""
    source, change = mutate(normalized(spec.source), rng.randrange(count_sites(spec.source)))
    cases = draw_cases(spec, rng)
    failing = failing_cases(load(source, spec.name), cases)
    if failing is None or len(failing) < 2:
        return None
    rng.shuffle(cases)
    visible = [failing[0]] + [c for c in cases if c is not failing[0]][:VISIBLE_CASES - 1]
    hidden_fail = next(c for c in failing if c not in visible)
    hidden = [hidden_fail] + [c for c in cases if c not in visible and c is not hidden_fail][:HIDDEN_CASES - 1]
    return PlantedBug(spec, source, change, visible, hidden)


def failing_cases(mutant: Callable, cases: list[tuple[tuple, Any]]) -> list[tuple[tuple, Any]] | None:
    """The cases the mutant gets wrong; None when it hangs on any (such tasks would only time out)."""
    failing = []
    for args, want in cases:
        got = outcome(mutant, args)
        if got == Failure("hang"):
            return None
        if not same(got, want):
            failing.append((args, want))
    return failing


def make_task(rng: random.Random, index: int) -> dict | None:
    """One task, or None when the drawn mutation is not a usable bug."""
    theme = rng.choice(sorted(THEMES))
    specs, packages = THEMES[theme]
    chosen = rng.sample(specs, 3)
    bug = plant_bug(rng, rng.choice(chosen))
    if bug is None:
        return None
    package = rng.choice(packages)
    module = f"{package}/{rng.choice(('core', 'helpers', 'utils', 'ops'))}.py"
    visible, hidden = {bug.spec.name: bug.visible}, {bug.spec.name: bug.hidden}
    for spec in chosen:
        if spec is not bug.spec:
            rows = draw_cases(spec, rng)
            visible[spec.name], hidden[spec.name] = rows[:OTHER_VISIBLE], rows[OTHER_VISIBLE:OTHER_VISIBLE + OTHER_HIDDEN]
    doc = f'"""Small {theme} helpers."""\n\n\n'
    buggy = doc + "\n\n".join(bug.source if s is bug.spec else normalized(s.source) for s in chosen)
    fixed = doc + "\n\n".join(normalized(s.source) for s in chosen)
    test_name = f"tests/test_{Path(module).stem}.py"
    return {
        "task_id": f"swe-{index:04d}", "theme": theme, "module": module, "visible_test": test_name,
        "repo": {"README.md": f"# {package}\n\nSmall {theme} helpers. Run the tests with `python -m unittest`.\n",
                 f"{package}/__init__.py": doc.rstrip() + "\n", module: buggy, "tests/__init__.py": "",
                 test_name: test_file(module, visible, "TestVisible")},
        "hidden_tests": {"tests/test_heldout.py": test_file(module, hidden, "TestHeldOut")},
        "solution": {module: fixed},
        "bug": {"function": bug.spec.name, "change": bug.change},
    }


def generate(seed: int = 0, count: int = 300) -> list[dict]:
    rng, tasks = random.Random(seed), []
    while len(tasks) < count:
        task = make_task(rng, len(tasks))
        if task is not None:
            tasks.append(task)
    return tasks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=300)
    parser.add_argument("--out", type=Path, default=DATA)
    args = parser.parse_args()
    tasks = generate(args.seed, args.count)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(t, sort_keys=True) + "\n" for t in tasks))
    print(f"wrote {len(tasks)} tasks to {args.out}")


if __name__ == "__main__":
    main()
