"""The one test double of the env tests: an OpenAI-compatible chat server that replays scripts.

Each script gets its own base URL (`http://127.0.0.1:PORT/scripts/<id>/v1`, shaped like a gateway
session) and answers its k-th POST /chat/completions with its k-th scripted reply: text, tool calls,
or a function of the request's messages. It records every request, so tests can check what the env
sent (tool schemas, tool observations). A script that runs out answers 500. It runs a real HTTP
server on 127.0.0.1 port 0 in a thread of its own, so any test event loop and any process can use it.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.envs.threaded_server import ThreadedServer


@dataclass
class Reply:
    content: Optional[str] = None
    tool_calls: list[tuple[str, Union[dict, str]]] = field(default_factory=list)
    """(tool name, arguments dict or a raw arguments string)"""
    delay_s: float = 0.0
    """Answer this late (for deadline and cancellation tests)."""
    finish_reason: Optional[str] = None
    """None: tool_calls or stop, as the reply is; "length": the reply was cut at max_tokens."""
    status: int = 200
    """Another status: this attempt fails with it (the OpenAI client retries a 503 as the next step)."""


def say(text: str, delay_s: float = 0.0) -> Reply:
    return Reply(content=text, delay_s=delay_s)


def call(name: str, arguments: Union[dict, str, None] = None, **kwargs: Any) -> Reply:
    return Reply(tool_calls=[(name, arguments if arguments is not None else kwargs)])


Step = Union[Reply, Callable[[list[dict]], Reply]]


@dataclass
class Script:
    steps: list[Step]
    requests: list[dict] = field(default_factory=list)
    """Bodies of the chat completion requests received, in order."""


class ScriptedLLM:
    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self._ids = itertools.count()
        self._server = ThreadedServer(self._app())

    @property
    def url(self) -> str:
        return self._server.url

    def script(self, *steps: Step) -> tuple[str, Script]:
        """Register a script; returns (base_url for the episode's llm block, the Script record)."""
        script_id = f"s{next(self._ids)}"
        self.scripts[script_id] = Script(list(steps))
        return f"{self.url}/scripts/{script_id}/v1", self.scripts[script_id]

    def start(self) -> "ScriptedLLM":
        self._server.start()
        return self

    def stop(self) -> None:
        self._server.stop()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/scripts/{script_id}/v1/chat/completions")
        async def chat(script_id: str, request: Request):
            script = self.scripts.get(script_id)
            if script is None:
                return JSONResponse({"error": {"message": f"no script {script_id}"}}, status_code=404)
            body = await request.json()
            script.requests.append(body)
            turn = len(script.requests) - 1
            if turn >= len(script.steps):
                return JSONResponse({"error": {"message": f"script {script_id} has only {len(script.steps)} "
                                                          f"replies"}}, status_code=500)
            step = script.steps[turn]
            reply = step(body["messages"]) if callable(step) else step
            if reply.delay_s:
                await asyncio.sleep(reply.delay_s)
            if reply.status != 200:
                return JSONResponse({"error": {"message": f"scripted {reply.status}"}}, status_code=reply.status)
            return completion(body.get("model", "scripted"), reply)

        return app


def completion(model: str, reply: Reply) -> dict:
    """A Chat Completions response body carrying `reply`."""
    tool_calls = [{"id": f"call_{uuid.uuid4().hex[:12]}", "type": "function",
                   "function": {"name": name, "arguments": args if isinstance(args, str) else json.dumps(args)}}
                  for name, args in reply.tool_calls]
    message = {"role": "assistant", "content": reply.content, **({"tool_calls": tool_calls} if tool_calls else {})}
    return {"id": f"chatcmpl-{uuid.uuid4().hex[:12]}", "object": "chat.completion", "created": int(time.time()),
            "model": model,
            "choices": [{"index": 0, "message": message,
                         "finish_reason": reply.finish_reason or ("tool_calls" if tool_calls else "stop")}],
            "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
