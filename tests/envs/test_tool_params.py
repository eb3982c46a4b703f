"""Typed tool parameters (envs/sdk/param.py): the JSON schemas the model is shown, the check of its
arguments, and what the AgentLoop makes of a bad call (an observation, not a crash), played through
the SDK's runner against the scripted LLM."""

import itertools

import pytest

from asyncrl.protocols.env_service import EpisodeRequest, LLMEndpoint
from envs.sdk import AgentLoop, Environment, EpisodeResult, Tool, ToolResult, check_arguments, param, schema
from envs.sdk.metrics import ServiceMetrics
from envs.sdk.runner import EpisodeRunner
from tests.envs.scripted_llm import call, say

SEEK = schema({
    "path": "file to read",
    "line": param.integer("1-based line", minimum=1),
    "mode": param.enum(["text", "hex"], "how to show it"),
    "context": param.integer("lines around it", minimum=0, maximum=50, default=3),
    "timeout_s": param.number("seconds at most", minimum=0, optional=True),
    "tags": param.array(param.string(min_length=1), "labels", max_items=3, optional=True),
    "follow": param.boolean("follow symlinks", default=False),
    "origin": param.obj({"x": param.integer(), "y": param.integer(default=0)}, "a point", optional=True),
})


def test_schema_is_the_openai_parameters_object():
    assert SEEK == {
        "type": "object",
        "properties": {
            "path": {"type": "string", "description": "file to read"},
            "line": {"type": "integer", "description": "1-based line", "minimum": 1},
            "mode": {"type": "string", "enum": ["text", "hex"], "description": "how to show it"},
            "context": {"type": "integer", "description": "lines around it", "minimum": 0, "maximum": 50,
                        "default": 3},
            "timeout_s": {"type": "number", "description": "seconds at most", "minimum": 0},
            "tags": {"type": "array", "items": {"type": "string", "minLength": 1}, "description": "labels",
                     "maxItems": 3},
            "follow": {"type": "boolean", "description": "follow symlinks", "default": False},
            "origin": {"type": "object", "description": "a point", "additionalProperties": False,
                       "properties": {"x": {"type": "integer"}, "y": {"type": "integer", "default": 0}},
                       "required": ["x"]},
        },
        "required": ["path", "line", "mode"],
        "additionalProperties": False,
    }
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(SEEK)  # a valid JSON schema, not just a dict that looks like one

    async def seek(path: str, line: int, mode: str, context: int = 3, timeout_s=None, tags=(), follow=False,
                   origin=None):
        return ""

    assert Tool("seek", "Show a line.", SEEK, seek).schema() == {
        "type": "function", "function": {"name": "seek", "description": "Show a line.", "parameters": SEEK}}


def test_plain_descriptions_stay_required_strings():
    assert schema({"text": "the answer"}) == {
        "type": "object", "properties": {"text": {"type": "string", "description": "the answer"}},
        "required": ["text"], "additionalProperties": False}
    assert schema({"a": "x", "b": "y"}, required=["b"])["required"] == ["b"]
    with pytest.raises(ValueError, match=r"required names \['c'\]"):
        schema({"a": "x"}, required=["c"])
    assert param.enum([1, 2, 3]).json == {"type": "integer", "enum": [1, 2, 3]}
    assert param.enum(["a", 1]).json == {"enum": ["a", 1]}  # mixed: no single type
    with pytest.raises(ValueError, match="does not fit its own schema"):
        param.integer(minimum=1, default=0)


GOOD = {"path": "a.py", "line": 3, "mode": "hex"}
CASES = [
    GOOD,
    {**GOOD, "line": 3.0},                         # JSON 3.0 is an integer
    {**GOOD, "line": "3"},                         # a string is not
    {**GOOD, "line": 3.5},
    {**GOOD, "line": True},                        # nor is true
    {**GOOD, "line": 0},                           # below minimum
    {**GOOD, "mode": "bin"},                       # not in the enum
    {**GOOD, "mode": 1},
    {**GOOD, "context": 51},
    {**GOOD, "context": 50},
    {**GOOD, "timeout_s": 0.5},
    {**GOOD, "timeout_s": -1},
    {**GOOD, "timeout_s": "soon"},
    {**GOOD, "tags": ["x", "y"]},
    {**GOOD, "tags": ["x", 2]},
    {**GOOD, "tags": ["x", ""]},
    {**GOOD, "tags": ["a", "b", "c", "d"]},
    {**GOOD, "tags": "x"},
    {**GOOD, "follow": True},
    {**GOOD, "follow": "yes"},
    {**GOOD, "origin": {"x": 1}},
    {**GOOD, "origin": {"y": 1}},
    {**GOOD, "origin": {"x": 1, "z": 2}},
    {**GOOD, "origin": {"x": "1"}},
    {**GOOD, "extra": 1},
    {"path": "a.py", "line": 3},
    {},
]


@pytest.mark.parametrize("args", CASES, ids=lambda a: ",".join(f"{k}={v!r}" for k, v in a.items())[:60] or "empty")
def test_the_check_agrees_with_a_json_schema_validator(args):
    jsonschema = pytest.importorskip("jsonschema")
    _, problems = check_arguments(SEEK, args)
    assert (not problems) == jsonschema.Draft202012Validator(SEEK).is_valid(args), problems


def test_problems_name_each_argument_and_what_is_wrong():
    _, problems = check_arguments(SEEK, {"line": "5", "mode": "bin", "tags": ["ok", 7], "origin": {"z": 1},
                                         "colour": "red"})
    assert problems == [
        "missing argument(s) ['path']",
        "unknown argument(s) ['colour'] (expected: path, line, mode, context, timeout_s, tags, follow, origin)",
        'line: expected an integer, got "5" (a string)',
        'mode: expected one of ["text", "hex"], got "bin" (a string)',
        "tags[1]: expected a string, got 7 (an integer)",
        "origin: missing argument(s) ['x']",
        "origin: unknown argument(s) ['z'] (expected: x, y)",
    ]
    assert check_arguments(SEEK, [1, 2])[1] == ["the arguments must be a JSON object, got [1, 2] (an array)"]
    assert check_arguments(SEEK, {**GOOD, "line": 0})[1] == ["line: must be >= 1, got 0"]
    assert check_arguments(SEEK, {**GOOD, "path": None})[1] == ["path: expected a string, got null"]


def test_valid_arguments_get_defaults_ints_and_optional_nulls_dropped():
    args, problems = check_arguments(SEEK, {**GOOD, "line": 7.0, "timeout_s": None, "origin": {"x": 2.0}})
    assert problems == []
    assert args == {"path": "a.py", "line": 7, "mode": "hex", "context": 3, "follow": False,
                    "origin": {"x": 2, "y": 0}}
    assert type(args["line"]) is int and type(args["origin"]["x"]) is int


def test_a_tool_whose_function_cannot_take_its_arguments_is_refused_at_construction():
    async def two(a: str, b: str) -> str:
        return a + b

    with pytest.raises(ValueError, match=r"does not take the argument\(s\) \['c'\]"):
        Tool("t", "", schema({"a": "", "b": "", "c": ""}), two)
    with pytest.raises(ValueError, match=r"needs the argument\(s\) \['b'\], which its parameters make optional"):
        Tool("t", "", schema({"a": "", "b": param.string(optional=True)}), two)
    with pytest.raises(ValueError, match=r"needs the argument\(s\) \['b'\], which its parameters do not declare"):
        Tool("t", "", schema({"a": ""}), two)
    Tool("t", "", schema({"a": "", "b": param.string(default="x")}), two)  # the default fills it in

    async def anything(**kwargs) -> str:
        return ""

    Tool("t", "", schema({"a": "", "b": param.integer(optional=True)}), anything)


class SeekEnv(Environment):
    """One `seek` tool with typed parameters; the episode records what the tool received."""

    name, domain = "seek", "test"

    def __init__(self) -> None:
        self.received: list[dict] = []

    async def list_tasks(self):
        return ["t"]

    async def run_episode(self, task_id, llm, sandbox, ctx):
        async def seek(path: str, line: int, mode: str, context: int, follow: bool, timeout_s=None, tags=None,
                       origin=None) -> ToolResult:
            self.received.append(dict(path=path, line=line, mode=mode, context=context, follow=follow, tags=tags))
            return ToolResult(f"{path}:{line} shown", done=line == 9)

        outcome = await AgentLoop(llm, ctx, [Tool("seek", "Show a line of a file.", SEEK, seek)]).run(
            [{"role": "user", "content": "show line 9"}])
        return EpisodeResult(1.0 if self.received else 0.0, status=outcome.status, reason=outcome.reason)


async def test_bad_arguments_come_back_to_the_model_and_a_good_call_reaches_the_tool(scripted_llm):
    env = SeekEnv()
    runner = EpisodeRunner(env, capacity=1, sandboxes=None, metrics=ServiceMetrics("seek", "none"))
    await runner.load_tasks()
    url, script = scripted_llm.script(
        call("seek", path="a.py", line="9", mode="binary"),   # wrong type, not in the enum
        call("seek", path="a.py", line=9, mode="text", tags="x", colour=1),  # wrong type, unknown argument
        call("seek", path="a.py", line=9.0, mode="hex", tags=["x"], timeout_s=None),  # fine
        say("unused"))
    response = await runner.run(EpisodeRequest(episode_id=f"e-{next(IDS)}", task_id="t", max_turns=5,
                                               llm=LLMEndpoint(base_url=url, model="scripted")))
    assert (response.status.value, response.reason.value, response.num_turns) == ("completed", "completed", 3)
    assert env.received == [{"path": "a.py", "line": 9, "mode": "hex", "context": 3, "follow": False,
                             "tags": ["x"]}]
    assert type(env.received[0]["line"]) is int
    assert script.requests[0]["tools"] == [{"type": "function", "function": {
        "name": "seek", "description": "Show a line of a file.", "parameters": SEEK}}]
    first, second = (request["messages"][-1] for request in script.requests[1:3])
    assert first["role"] == "tool" and first["content"] == (
        'error: seek: line: expected an integer, got "9" (a string); '
        'mode: expected one of ["text", "hex"], got "binary" (a string)')
    assert second["content"] == (
        "error: seek: unknown argument(s) ['colour'] (expected: path, line, mode, context, timeout_s, tags, follow, "
        'origin); tags: expected an array, got "x" (a string)')


IDS = itertools.count()
