"""Build asyncrl/assets/tiny_tokenizer.json, the tokenizer of the tiny model, reproducibly.

A byte-level BPE of exactly 1024 ids: 256 byte tokens, 748 merges, then GLM-5.1's 20 reserved special
tokens at the end of the vocabulary (as in GLM's own vocabulary, see GLM_SPECIAL_TOKENS). Digits are
always split one per token, so the arithmetic / copy / sort tasks see numbers digit by digit.
The training corpus is generated here from a fixed seed: the text a chat-formatted episode holds
between special tokens (task prompts and answers, English, shell commands and their output, Python
code, tool definitions, tool-call arguments and tool results). Same bytes on every run:

    python scripts/build_tiny_tokenizer.py                # rewrites the committed asset
    python scripts/build_tiny_tokenizer.py --out /tmp/t.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Iterator

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from asyncrl.chat_template import (  # noqa: E402  (import after the repo is on sys.path)
    GLM_SPECIAL_TOKENS,
    TOOL_CALL_EXAMPLE,
    TOOLS_POSTAMBLE,
    TOOLS_PREAMBLE,
)

VOCAB_SIZE = 1024
SEED = 20240601
CORPUS_ROUNDS = 1500
"""Each round adds one item of every corpus kind (~9k texts, ~0.5 MB)."""

WORDS = (
    "the a an of to and in is it that for on with as was be by this are from at or not have one all "
    "time file data model code test value list number result error output input function agent user "
    "task answer first next last small large new old good fast slow start stop read write run check "
    "sort copy add sum count order line word text name path server token request response session "
    "reward step train learn open close find make use need want give take show keep move change"
).split()
SENTENCES = (
    "The quick brown fox jumps over the lazy dog.",
    "Please answer the question below and explain your reasoning briefly.",
    "I will read the file first, then run the tests to see what fails.",
    "The function returns the sum of all numbers in the list.",
    "Let me check the output of the command before making changes.",
    "All tests passed, so the task is complete.",
    "The error says the module could not be found; the import path is wrong.",
    "Sorting in ascending order puts the smallest number first.",
    "Copy the text exactly as it is written, including spaces.",
    "You are a helpful assistant.",
    "You are a coding agent working in a Linux terminal. Use the tools to inspect and edit files.",
    "You are a search agent. Search the web, read the results and answer with a short fact.",
    "Think step by step, then give the final answer on its own line.",
)
FILES = ("main.py", "utils.py", "README.md", "setup.py", "tests/test_main.py", "src/app.py", "config.yaml",
         "data.json", "Makefile", "requirements.txt", "src/model.py", "scripts/run.sh")  # fmt: skip
COMMANDS = (
    "ls -la {dir}", "cat {file}", "grep -rn \"{word}\" {dir}", "find . -name \"*.py\"", "cd {dir} && ls",
    "git status", "git diff {file}", "git log --oneline -n 5", "python -m pytest -q {test}", "python {file}",
    "sed -n '1,{n}p' {file}", "head -n {n} {file}", "tail -n {n} {file}", "wc -l {file}", "mkdir -p {dir}",
    "echo \"{word}\" > {file}", "pip install -e .", "rm -rf build dist", "chmod +x {file}", "pwd",
)  # fmt: skip
OUTPUTS = (
    "total {n}\ndrwxr-xr-x 2 user user 4096 Jan {d} 12:{d}0 src\n-rw-r--r-- 1 user user {n}0 Jan {d} 12:00 {file}",
    "{n} passed in 0.{d}{d}s", "{d} failed, {n} passed in 1.{d}s",
    "Traceback (most recent call last):\n  File \"{file}\", line {n}, in <module>\nNameError: name '{word}' is not defined",
    "{file}:{n}:    return {word}", "On branch main\nnothing to commit, working tree clean",
    "bash: {word}: command not found", "{n} {file}", "ModuleNotFoundError: No module named '{word}'",
)  # fmt: skip
PYTHON = (
    "def {name}({arg}):\n    \"\"\"Return the {word} of {arg}.\"\"\"\n    return {arg} + {n}\n",
    "def {name}(items):\n    total = 0\n    for item in items:\n        total += item\n    return total\n",
    "class {cls}:\n    def __init__(self, {arg}):\n        self.{arg} = {arg}\n\n    def {name}(self):\n        return self.{arg}\n",
    "import json\nimport os\n\nwith open(\"{file}\") as f:\n    data = json.load(f)\nprint(data[\"{word}\"])\n",
    "if __name__ == \"__main__\":\n    main()\n", "result = [x * {n} for x in range({n}) if x % 2 == 0]\n",
    "try:\n    {name}({arg})\nexcept ValueError as e:\n    print(f\"error: {{e}}\")\n",
    "assert {name}([{n}, {d}]) == {n}\n", "from typing import Any\n\n{arg}: dict[str, Any] = {{}}\n",
)  # fmt: skip
TOOLS = (
    {"name": "bash", "description": "Run a shell command and return its output.",
     "parameters": {"type": "object", "properties": {"command": {"type": "string", "description": "The command."}},
                    "required": ["command"]}},
    {"name": "read_file", "description": "Read a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "max_lines": {"type": "integer"}},
                    "required": ["path"]}},
    {"name": "write_file", "description": "Write content to a file.",
     "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "content": {"type": "string"}},
                    "required": ["path", "content"]}},
    {"name": "search", "description": "Search the web and return the top results.",
     "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"}},
                    "required": ["query"]}},
    {"name": "submit", "description": "Submit the final answer.",
     "parameters": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}},
)  # fmt: skip


def corpus(rng: random.Random) -> Iterator[str]:
    """The training texts, in a fixed order for a fixed seed."""
    yield TOOLS_PREAMBLE + "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS) + TOOLS_POSTAMBLE
    yield from filter(None, re.split(r"<[^>]*>", TOOL_CALL_EXAMPLE))  # the text between its markers
    for _ in range(CORPUS_ROUNDS):
        fill = _filler(rng)
        yield from _task_texts(rng)
        yield rng.choice(SENTENCES)
        yield " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 16))).capitalize() + "."
        yield rng.choice(COMMANDS).format(**fill)
        yield rng.choice(OUTPUTS).format(**fill)
        yield rng.choice(PYTHON).format(**fill)
        yield from _tool_texts(rng, fill)


def _filler(rng: random.Random) -> dict[str, object]:
    word = rng.choice(WORDS)
    return {"word": word, "file": rng.choice(FILES), "dir": rng.choice(("src", "tests", ".", "scripts", "/tmp")),
            "test": rng.choice(("tests", "tests/test_main.py", "-x")), "n": rng.randint(1, 300),
            "d": rng.randint(0, 9), "name": f"{rng.choice(('get', 'make', 'compute', 'parse', 'load'))}_{word}",
            "arg": rng.choice(("x", "items", "path", "value", "data", "n")), "cls": word.capitalize() + "Store"}  # fmt: skip


def _task_texts(rng: random.Random) -> Iterator[str]:
    """Prompts and answers of the learnable tasks: arithmetic, copy, sort."""
    a, b = rng.randint(0, 999), rng.randint(0, 999)
    op, result = rng.choice((("+", a + b), ("-", a - b), ("*", a * b)))
    yield rng.choice(("What is {a} {op} {b}?", "Compute {a} {op} {b}.", "{a} {op} {b} =")).format(a=a, op=op, b=b)
    yield rng.choice(("{r}", "The answer is {r}.", "{a} {op} {b} = {r}")).format(a=a, op=op, b=b, r=result)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 8)))
    yield f"Copy the following text exactly: {text}"
    yield text
    numbers = [rng.randint(0, 99) for _ in range(rng.randint(3, 8))]
    yield f"Sort these numbers in ascending order: {' '.join(map(str, numbers))}"
    yield " ".join(map(str, sorted(numbers)))


def _tool_texts(rng: random.Random, fill: dict[str, object]) -> Iterator[str]:
    """What sits between tool-call / tool-response markers: names, keys, values, results."""
    tool = rng.choice(TOOLS)
    yield tool["name"]
    yield from tool["parameters"]["properties"]
    yield rng.choice((COMMANDS[0].format(**fill), str(fill["file"]), str(fill["n"]), f"{fill['word']} {fill['name']}"))
    yield json.dumps({"results": [{"title": str(fill["word"]).title(), "url": f"https://example.com/{fill['word']}",
                                  "snippet": rng.choice(SENTENCES)}]}, ensure_ascii=False)  # fmt: skip
    yield json.dumps({"exit_code": fill["d"] % 2, "output": rng.choice(OUTPUTS).format(**fill)}, ensure_ascii=False)


def build() -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE - len(GLM_SPECIAL_TOKENS),
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus(random.Random(SEED)), trainer)
    tokenizer.add_special_tokens(list(GLM_SPECIAL_TOKENS))
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"built {tokenizer.get_vocab_size()} ids, expected {VOCAB_SIZE}: enlarge the corpus")
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "asyncrl" / "assets" / "tiny_tokenizer.json")
    out = parser.parse_args().out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(build().to_str(pretty=True) + "\n")
    print(f"wrote {out} ({VOCAB_SIZE} ids)")


if __name__ == "__main__":
    main()
