"""A harness that runs its loop in-process (verifiers' Harness.launch allows it): one chat
completion offering a `bash` tool, sent to the rollout's interception endpoint, which records it
on the trace and forwards it to the run's model."""

import openai
import verifiers.v1 as vf

BASH = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}


class OneCallHarness(vf.Harness[vf.HarnessConfig]):
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            await client.chat.completions.create(model=ctx.model, tools=[BASH],
                                                 messages=[{"role": "user", "content": data.prompt}])
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")
