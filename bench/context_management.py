"""Context management (envs/sdk/context.py) on one long agent episode: what each policy costs and saves.

    python bench/context_management.py [--calls 30] [--out bench/results/context_management]

One AgentLoop episode per policy through a real gateway and engine: the engine serves the scripted tiny
model of the gateway tests (tests/gateway/scripted.py: it calls `bash` on every turn, at temperature 0,
so every policy sees the same replies), each call answered by a 120-character observation. Per policy:
prompt tokens per call (the context), how many of them the engine's prefix cache served, the segments the
gateway recorded (each a training sample) and the tokens in them (what the trainer reads), and the wall
time. No policy at all is the baseline; `--calls` stays where its context fits the tiny model's 4096
positions.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import openai  # noqa: E402

from asyncrl.chat_template import GlmChatTemplate  # noqa: E402
from asyncrl.config import load_model_section  # noqa: E402
from asyncrl.tokenizer import load_tokenizer  # noqa: E402
from asyncrl_run.redis_server import EmbeddedRedis  # noqa: E402
from envs.sdk import AgentLoop, EpisodeContext, Tool  # noqa: E402
from envs.sdk.context import ContextConfig, ContextLog, build_policy  # noqa: E402
from tests.gateway.scripted import (AGENT_TASK, OBSERVATION_CHARS, TOOLS, observation,  # noqa: E402
                                    save_scripted_checkpoint)
from tests.services import ServiceProcess  # noqa: E402

POLICIES = {
    "none": ContextConfig(),
    "keep-recent-5": ContextConfig(keep_recent_k=5),
    "keep-recent-5, fold_every 5": ContextConfig(keep_recent_k=5, fold_every=5),
    "discard-all T=1500": ContextConfig(discard_at_tokens=1500),
    "keep-recent-5 + discard-all T=1500": ContextConfig(keep_recent_k=5, discard_at_tokens=1500),
}
async def episode(gateway: str, config: ContextConfig, calls: int) -> dict:
    async with httpx.AsyncClient(base_url=gateway, timeout=300) as http:
        session = (await http.post("/sessions", json={"group_id": "g", "task_id": "t", "env": "bench"})).json()
        log, done = ContextLog(), []

        async def bash(command: str) -> str:
            done.append(command)
            return observation(len(done))

        ctx = EpisodeContext(episode_id=session["session_id"], task_id="t", seed=0, max_turns=calls, deadline_s=600,
                             model="asyncrl", sampling={"temperature": 0.0, "max_tokens": 64},
                             context_policy=build_policy(config), context_log=log)
        tool = TOOLS[0]["function"]
        llm = openai.AsyncOpenAI(base_url=session["base_url"], api_key="unused")
        started = time.perf_counter()
        await AgentLoop(llm, ctx, [Tool("bash", tool["description"], tool["parameters"], bash)]).run(
            [dict(m) for m in AGENT_TASK])
        seconds = time.perf_counter() - started
        await llm.close()
        segments = (await http.get(f"/sessions/{session['session_id']}")).json()["segments"]
        await http.post(f"/sessions/{session['session_id']}/finish", json={"reward": 0.0})
    return {"calls": len(log.prompt_tokens), "max_prompt_tokens": max(log.prompt_tokens),
            "mean_prompt_tokens": round(sum(log.prompt_tokens) / len(log.prompt_tokens), 1),
            "prompt_tokens": log.prompt_tokens, "cached_share": round(sum(log.cached_tokens) / sum(log.prompt_tokens), 3),
            "prefilled_tokens": sum(log.prompt_tokens) - sum(log.cached_tokens), "folds": log.folds,
            "discards": log.discards, "segments": len(segments),
            "trained_tokens": sum(len(s["tokens"]) for s in segments), "seconds": round(seconds, 2)}


def table(results: dict) -> str:
    rows = ["| policy | max / mean prompt tokens | prefix-cache share | tokens prefilled | folds | discards | "
            "segments (samples) | tokens in the samples | wall s |", "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results["policies"].items():
        rows.append(f"| {name} | {r['max_prompt_tokens']} / {r['mean_prompt_tokens']:.0f} | {r['cached_share']:.1%} | "
                    f"{r['prefilled_tokens']} | {r['folds']} | {r['discards']} | {r['segments']} | "
                    f"{r['trained_tokens']} | {r['seconds']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--out", type=Path, default=ROOT / "bench/results/context_management")
    args = parser.parse_args()
    results = {"command": " ".join(["python", "bench/context_management.py", *sys.argv[1:]]),
               "load_avg_start": os.getloadavg(), "calls": args.calls, "observation_chars": OBSERVATION_CHARS,
               "policies": {}}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        template = GlmChatTemplate(load_tokenizer("builtin:tiny"))
        checkpoint = save_scripted_checkpoint(load_model_section("tiny").arch, template, work / "ckpt")
        redis = EmbeddedRedis(work / "redis").start()
        engine = ServiceProcess("rollout.server", ["--model", str(checkpoint)], work, name="engine")
        gateway = ServiceProcess("gateway.server", ["--engine", engine.url, "--redis-url", redis.url,
                                                    "--run", "bench-context"], work, name="gateway")
        try:
            for name, config in POLICIES.items():
                results["policies"][name] = asyncio.run(episode(gateway.url, config, args.calls))
                print(name, {k: v for k, v in results["policies"][name].items() if k != "prompt_tokens"}, flush=True)
        finally:
            gateway.stop()
            engine.stop()
            redis.stop()
    results["load_avg_end"] = os.getloadavg()
    args.out.with_suffix(".json").write_text(json.dumps(results, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(
        f"# Context management on one {args.calls}-call agent episode\n\n"
        f"`{results['command']}`; load average {results['load_avg_start'][0]:.1f} at start, "
        f"{results['load_avg_end'][0]:.1f} at the end (2 cores). The scripted tiny model of the gateway tests "
        f"(a `bash` call on every turn, temperature 0) behind a real engine and gateway; every call is answered "
        f"by a {OBSERVATION_CHARS}-character observation. Prompt tokens are the gateway's usage per call; the "
        "prefix-cache share is the engine's cached tokens over all prompt tokens; a segment is one training "
        "sample, and its tokens are what the trainer reads.\n\n" + table(results) + "\n")


if __name__ == "__main__":
    main()
