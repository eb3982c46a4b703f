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
import signal
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
CALL_TIMEOUT_S = 0.2


class _Hang(Exception):
    pass


@dataclass(frozen=True)
class Failure:
    """What a call produced instead of a value: an exception (by type name) or a hang."""

    kind: str


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    def expire(*_):
        raise _Hang()

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


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
        with _time_limit(CALL_TIMEOUT_S):
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


def make_task(rng: random.Random, index: int) -> dict | None:
    """One task, or None when the drawn mutation is not a usable bug (survives all cases, or hangs)."""
    theme = rng.choice(sorted(THEMES))
    specs, packages = THEMES[theme]
    chosen = rng.sample(specs, 3)
    buggy_spec = rng.choice(chosen)
    buggy_source, bug = mutate(normalized(buggy_spec.source), rng.randrange(count_sites(buggy_spec.source)))
    mutant = load(buggy_source, buggy_spec.name)
    results, failing = draw_cases(buggy_spec, rng), []
    for args, want in results:
        got = outcome(mutant, args)
        if got == Failure("hang"):
            return None
        if not same(got, want):
            failing.append((args, want))
    if len(failing) < 2:
        return None
    rng.shuffle(results)
    first_fail = failing[0]
    rest = [r for r in results if r is not first_fail]
    visible = [first_fail] + rest[:VISIBLE_CASES - 1]
    hidden_pool = [r for r in results if r not in visible]
    hidden_fail = next(r for r in failing if r not in visible)
    hidden = [hidden_fail] + [r for r in hidden_pool if r is not hidden_fail][:HIDDEN_CASES - 1]
    return assemble(rng, index, theme, packages, chosen, buggy_spec, buggy_source, bug, visible, hidden)


def assemble(rng, index, theme, packages, chosen, buggy_spec, buggy_source, bug, visible, hidden) -> dict:
    package = rng.choice(packages)
    module_path = f"{package}/{rng.choice(('core', 'helpers', 'utils', 'ops'))}.py"
    doc = f'"""Small {theme} helpers."""\n'
    parts = {s.name: (buggy_source if s is buggy_spec else normalized(s.source)) for s in chosen}
    correct_parts = {s.name: normalized(s.source) for s in chosen}
    visible_cases, hidden_cases = {buggy_spec.name: visible}, {buggy_spec.name: hidden}
    for spec in chosen:
        if spec is not buggy_spec:
            rows = draw_cases(spec, rng)
            visible_cases[spec.name], hidden_cases[spec.name] = rows[:OTHER_VISIBLE], rows[OTHER_VISIBLE:
                                                                                            OTHER_VISIBLE + OTHER_HIDDEN]
    test_name = f"tests/test_{Path(module_path).stem}.py"
    return {
        "task_id": f"swe-{index:04d}",
        "theme": theme,
        "module": module_path,
        "visible_test": test_name,
        "repo": {
            "README.md": f"# {package}\n\nSmall {theme} helpers. Run the tests with `python -m unittest`.\n",
            f"{package}/__init__.py": doc,
            module_path: doc + "\n\n" + "\n\n".join(parts.values()),
            "tests/__init__.py": "",
            test_name: test_file(module_path, visible_cases, "TestVisible"),
        },
        "hidden_tests": {"tests/test_heldout.py": test_file(module_path, hidden_cases, "TestHeldOut")},
        "solution": {module_path: doc + "\n\n" + "\n\n".join(correct_parts.values())},
        "bug": {"function": buggy_spec.name, "change": bug},
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
