"""Generates the terminal env's shell tasks (envs/terminal/data/tasks.jsonl), reproducibly from a seed.

Each template draws its data with a seeded rng and returns a task: an instruction, the files the
episode starts with, a verifier (a bash script run in the episode directory after the agent is
done; exit 0 = solved) and a reference solution. Expected values are baked into the verifier, so an
agent that edits the input files cannot talk the verifier into a pass.

    python -m envs.terminal.generate            # writes data/tasks.jsonl, checking every task in the sandbox
    python -m envs.terminal.generate --no-check # without the sandbox check (non-root machines)

The check runs the verifier on the untouched files (must fail), then the solution and the verifier
(must pass).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import string
from pathlib import Path
from typing import Callable

DATA = Path(__file__).with_name("data") / "tasks.jsonl"
WORDS = ("apple", "birch", "cobalt", "delta", "ember", "fjord", "garnet", "harbor", "indigo", "juniper", "kestrel",
         "lumen", "maple", "nectar", "onyx", "pepper", "quartz", "raven", "saffron", "tundra", "umber", "velvet",
         "willow", "xenon", "yarrow", "zephyr")
NAMES = ("ana", "bo", "chen", "dara", "eli", "femi", "gus", "hana", "ivo", "jun", "kai", "lea", "mio", "nadia",
         "omar", "pia", "quinn", "rui", "sol", "tess")
CITIES = ("oslo", "lima", "kyiv", "pune", "perth", "quito", "turin", "accra")


def same_text(path: str, expected: str) -> str:
    """Verifier lines: the file's content equals `expected` (trailing newlines ignored)."""
    return (f"[ -f {path} ] || exit 1\nexpected=$(cat <<'ASYNCRL_EOF'\n{expected}\nASYNCRL_EOF\n)\n"
            f"[ \"$(cat -- {path})\" = \"$expected\" ]\n")


def same_number(path: str, value: int) -> str:
    return f"[ -f {path} ] || exit 1\n[ \"$(tr -d '[:space:]' < {path})\" = \"{value}\" ]\n"


def lines(items) -> str:
    return "\n".join(map(str, items))


def write_text(rng):
    name, text = f"{rng.choice(WORDS)}.txt", " ".join(rng.sample(WORDS, 3))
    return (f"Create a file named {name} that contains exactly one line: {text}",
            {}, same_text(name, text), f"echo '{text}' > {name}")


def count_matches(rng):
    levels = [rng.choice(("INFO", "INFO", "WARN", "ERROR")) for _ in range(rng.randint(20, 60))]
    log = lines(f"2024-01-{i % 28 + 1:02d} {lvl} {rng.choice(WORDS)} event {i}" for i, lvl in enumerate(levels))
    level = rng.choice(("ERROR", "WARN"))
    return (f"Count the lines of app.log that contain the word {level} and write that number to count.txt",
            {"app.log": log + "\n"}, same_number("count.txt", levels.count(level)),
            f"grep -c {level} app.log > count.txt")


def csv_filter(rng):
    people = [(n, rng.choice(CITIES), rng.randint(18, 70)) for n in rng.sample(NAMES, rng.randint(8, 14))]
    age = rng.randint(30, 50)
    table = "name,city,age\n" + lines(f"{n},{c},{a}" for n, c, a in people) + "\n"
    return (f"people.csv has the columns name,city,age. Write the names of everyone older than {age}, one per "
            f"line, in the order they appear in the file, to older.txt",
            {"people.csv": table}, same_text("older.txt", lines(n for n, _, a in people if a > age)),
            f"awk -F, 'NR>1 && $3>{age} {{print $1}}' people.csv > older.txt")


def csv_column(rng):
    people = [(n, rng.choice(CITIES), rng.randint(18, 70)) for n in rng.sample(NAMES, rng.randint(6, 12))]
    city = rng.choice([c for _, c, _ in people])
    table = "name,city,age\n" + lines(f"{n},{c},{a}" for n, c, a in people) + "\n"
    return (f"people.csv has the columns name,city,age. Write the number of people who live in {city} to city.txt",
            {"people.csv": table}, same_number("city.txt", sum(c == city for _, c, _ in people)),
            f"awk -F, '$2==\"{city}\"' people.csv | wc -l > city.txt")


def sum_numbers(rng):
    numbers = [rng.randint(-50, 500) for _ in range(rng.randint(10, 40))]
    return ("numbers.txt holds one integer per line. Write their sum to sum.txt",
            {"numbers.txt": lines(numbers) + "\n"}, same_number("sum.txt", sum(numbers)),
            "awk '{s+=$1} END {print s}' numbers.txt > sum.txt")


def sort_unique(rng):
    words = [rng.choice(WORDS[:12]) for _ in range(rng.randint(15, 30))]
    return ("Write the distinct words of words.txt, sorted alphabetically, one per line, to unique.txt",
            {"words.txt": lines(words) + "\n"}, same_text("unique.txt", lines(sorted(set(words)))),
            "sort -u words.txt > unique.txt")


def replace_word(rng):
    old, new = rng.sample(WORDS, 2)
    body = [" ".join(rng.choice((old,) + WORDS[:5]) for _ in range(6)) for _ in range(5)]
    text = lines(body)
    return (f"Edit notes.txt in place: replace every occurrence of the word {old} with {new}",
            {"notes.txt": text + "\n"}, same_text("notes.txt", text.replace(old, new)),
            f"sed -i 's/{old}/{new}/g' notes.txt")


def move_logs(rng):
    logs = [f"{w}.log" for w in rng.sample(WORDS, rng.randint(2, 4))]
    keep = [f"{w}.txt" for w in rng.sample(WORDS, 2)]
    files = {name: f"{name} content {rng.randint(0, 999)}\n" for name in logs + keep}
    checks = "".join(f"[ -f logs/{n} ]\n[ ! -e {n} ]\ngrep -qx '{files[n].strip()}' logs/{n}\n" for n in logs)
    checks += "".join(f"[ -f {n} ]\n" for n in keep)
    return ("Move every .log file of this directory into a new directory named logs; leave the other files "
            "where they are", files, "set -e\n" + checks, "mkdir -p logs && mv *.log logs/")


def largest_file(rng):
    sizes = rng.sample(range(10, 400), 5)
    names = rng.sample(WORDS, 5)
    files = {f"data/{n}.bin": "x" * s for n, s in zip(names, sizes)}
    biggest = names[sizes.index(max(sizes))]
    return ("Write the name (file name only, e.g. name.bin) of the largest file in data/ to largest.txt",
            files, same_text("largest.txt", f"{biggest}.bin"), "ls -S data | head -n 1 > largest.txt")


def nth_line(rng):
    poem = [" ".join(rng.sample(WORDS, 4)) for _ in range(rng.randint(6, 12))]
    n = rng.randint(2, len(poem))
    return (f"Write line number {n} of poem.txt (counting from 1) to line.txt",
            {"poem.txt": lines(poem) + "\n"}, same_text("line.txt", poem[n - 1]), f"sed -n '{n}p' poem.txt > line.txt")


def word_count(rng):
    story = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(rng.randint(3, 8))]
    return ("Write the number of words in story.txt to words.txt",
            {"story.txt": lines(story) + "\n"}, same_number("words.txt", sum(len(s.split()) for s in story)),
            "wc -w < story.txt > words.txt")


def script_file(rng):
    text = f"{rng.choice(WORDS)} {rng.randint(100, 999)}"
    return (f"Create an executable shell script hello.sh that prints exactly `{text}` when run as ./hello.sh",
            {}, f"[ -x hello.sh ] && [ \"$(./hello.sh)\" = \"{text}\" ]\n",
            f"printf '#!/bin/sh\\necho {text}\\n' > hello.sh && chmod +x hello.sh")


def json_field(rng):
    config = {"name": rng.choice(WORDS), "port": rng.randint(1024, 65000), "workers": rng.randint(1, 32),
              "debug": rng.choice((True, False))}
    key = rng.choice(("port", "workers"))
    return (f"config.json is a JSON object. Write the value of its {key} field to value.txt",
            {"config.json": json.dumps(config, indent=2) + "\n"}, same_number("value.txt", config[key]),
            f"grep -o '\"{key}\": [0-9]*' config.json | grep -o '[0-9]*$' > value.txt")


def archive(rng):
    names = rng.sample(WORDS, 3)
    files = {f"src/{n}.txt": f"{n}\n" for n in names}
    checks = "".join(f"tar -tzf backup.tar.gz | grep -qx 'src/{n}.txt'\n" for n in names)
    return ("Create a gzip-compressed tar archive backup.tar.gz that contains the directory src (paths inside "
            "the archive start with src/)", files, "set -e\n" + checks, "tar -czf backup.tar.gz src")


def reverse_lines(rng):
    items = rng.sample(WORDS, rng.randint(4, 9))
    return ("Write the lines of list.txt in reverse order to reversed.txt",
            {"list.txt": lines(items) + "\n"}, same_text("reversed.txt", lines(reversed(items))),
            "tac list.txt > reversed.txt")


def uppercase(rng):
    text = lines(" ".join(rng.sample(WORDS, 3)) for _ in range(3))
    return ("Write the content of quiet.txt converted to upper case to loud.txt",
            {"quiet.txt": text + "\n"}, same_text("loud.txt", text.upper()), "tr a-z A-Z < quiet.txt > loud.txt")


def delete_backups(rng):
    names = rng.sample(WORDS, 6)
    backups, keep = names[:3], names[3:]
    files = {**{f"tmp/{n}.bak": "old\n" for n in backups}, **{f"tmp/{n}.txt": "new\n" for n in keep}}
    checks = "".join(f"[ ! -e tmp/{n}.bak ]\n" for n in backups) + "".join(f"[ -f tmp/{n}.txt ]\n" for n in keep)
    return ("Delete every file in tmp/ whose name ends in .bak and keep all other files",
            files, "set -e\n" + checks, "rm tmp/*.bak")


def find_file(rng):
    names = rng.sample(WORDS, 5)
    secret = "".join(rng.choice(string.ascii_lowercase) for _ in range(8))
    holder = rng.choice(names)
    files = {f"docs/{n}.md": f"# {n}\n" + (f"the code word is {secret}\n" if n == holder else "nothing here\n")
             for n in names}
    return (f"Exactly one file in docs/ contains the word {secret}. Write its file name (e.g. name.md) to found.txt",
            files, same_text("found.txt", f"{holder}.md"), f"grep -l {secret} docs/* | xargs -n1 basename > found.txt")


def count_tree(rng):
    files = {}
    for _ in range(rng.randint(5, 12)):
        path = "/".join(rng.sample(WORDS[:6], rng.randint(1, 3)))
        files[f"tree/{path}/{rng.choice(WORDS)}.{rng.choice(('txt', 'txt', 'md'))}"] = "x\n"
    count = sum(name.endswith(".txt") for name in files)
    return ("Write the number of .txt files anywhere under the directory tree (recursively) to count.txt",
            files, same_number("count.txt", count), "find tree -name '*.txt' | wc -l > count.txt")


TEMPLATES: dict[str, Callable] = {f.__name__: f for f in (
    write_text, count_matches, csv_filter, csv_column, sum_numbers, sort_unique, replace_word, move_logs,
    largest_file, nth_line, word_count, script_file, json_field, archive, reverse_lines, uppercase,
    delete_backups, find_file, count_tree)}


def generate(seed: int = 0, per_template: int = 4) -> list[dict]:
    tasks = []
    for template, make in TEMPLATES.items():
        for k in range(per_template):
            instruction, files, verifier, solution = make(random.Random(f"{seed}:{template}:{k}"))
            tasks.append({"task_id": f"{template}-{k}", "template": template, "instruction": instruction,
                          "files": files, "verifier": verifier, "solution": solution})
    return tasks


async def check(tasks: list[dict]) -> list[str]:
    """Problems found by running each task in the namespace sandbox ([] = all tasks sound)."""
    from envs.sdk.sandbox import SandboxConfig, make_sandbox_backend

    backend = make_sandbox_backend(SandboxConfig(command_timeout_s=10))
    await backend.probe()
    try:
        return [p for task in tasks for p in await check_one(backend, task)]
    finally:
        await backend.close()


async def check_one(backend, task: dict) -> list[str]:
    async with backend.session(task["task_id"]) as sandbox:
        if task["files"]:
            await sandbox.write_files(task["files"])
        before = await sandbox.run(["bash", "-s"], stdin=task["verifier"].encode())
        solved = await sandbox.run(task["solution"])
        after = await sandbox.run(["bash", "-s"], stdin=task["verifier"].encode())
    problems = []
    if before.exit_code == 0:
        problems.append(f"{task['task_id']}: the verifier passes before anything was done")
    if not (solved.ok and after.ok):
        problems.append(f"{task['task_id']}: the solution does not pass: {solved.output[-300:]} {after.output[-300:]}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-template", type=int, default=4)
    parser.add_argument("--out", type=Path, default=DATA)
    parser.add_argument("--no-check", action="store_true")
    args = parser.parse_args()
    tasks = generate(args.seed, args.per_template)
    problems = [] if args.no_check else asyncio.run(check(tasks))
    if problems:
        raise SystemExit("\n".join(problems))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text("".join(json.dumps(t, sort_keys=True) + "\n" for t in tasks))
    print(f"wrote {len(tasks)} tasks to {args.out}")


if __name__ == "__main__":
    main()
