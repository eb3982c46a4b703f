"""Context management of the SDK's AgentLoop through a real gateway and engine (envs/sdk/context.py).

The scripted engine's model calls `bash` on every turn, so an episode of MAX_TURNS calls makes MAX_TURNS
tool calls, each answered by an observation of OBSERVATION_CHARS. The checks: each policy keeps every
request under the bound it implies; the gateway opens one segment per edit, each holding exactly the
tokens the engine saw and produced (its turns replay on the engine); later turns of a segment hit the
engine's prefix cache; every segment is a sample with the episode's reward and trains with its advantage.
"""

from __future__ import annotations

import json

import httpx
import pytest

from envs.sdk import AgentLoop, EpisodeContext, Tool
from envs.sdk.context import ContextConfig, ContextLog, build_policy, rounds
from tests.gateway.checks import assert_engine_replays, assert_ledger_consistent
from tests.gateway.scripted import AGENT_TASK, COMMAND, CONTENT, OBSERVATION_CHARS, TOOLS, observation
from tests.trainer.helpers import make_group
from trainer.advantages import score_group

MAX_TURNS = 44
TOOL = TOOLS[0]["function"]


class Episode:
    """One AgentLoop episode on a gateway session, with every message list it sent."""

    def __init__(self, session: dict, config: ContextConfig, max_turns: int):
        self.session, self.sent, self.max_turns, self.tools = session, [], max_turns, None
        self.ctx = EpisodeContext(episode_id=session["session_id"], task_id="t", seed=0, max_turns=max_turns,
                                  deadline_s=600, model="asyncrl", sampling={"temperature": 0.0, "max_tokens": 64},
                                  context_policy=build_policy(config), context_log=ContextLog())
        self.calls = 0

    async def run(self, openai_client) -> list[dict]:
        async def on_request(request: httpx.Request) -> None:
            if request.url.path.endswith("/chat/completions"):
                body = json.loads(request.content)
                self.sent.append(body["messages"])
                self.tools = body["tools"]

        async def bash(command: str) -> str:
            assert command == COMMAND
            self.calls += 1
            return observation(self.calls)

        http = httpx.AsyncClient(event_hooks={"request": [on_request]}, timeout=120)
        llm = openai_client(base_url=self.session["base_url"], http_client=http)
        tool = Tool("bash", TOOL["description"], TOOL["parameters"], bash)
        outcome = await AgentLoop(llm, self.ctx, [tool]).run([dict(m) for m in AGENT_TASK])
        await http.aclose()
        assert self.calls == outcome.turns == self.max_turns  # a tool call on every turn, ended by max_turns
        return outcome.messages

    @property
    def log(self) -> ContextLog:
        return self.ctx.context_log


def round_tokens(template, tool_content: str) -> int:
    """Tokens one round (the scripted call and an observation) adds to a fresh render."""
    call = {"role": "assistant", "content": CONTENT,
            "tool_calls": [{"id": "c", "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]}
    base = template.render(AGENT_TASK, TOOLS, add_generation_prompt=True)
    grown = template.render([*AGENT_TASK, call, {"role": "tool", "tool_call_id": "c", "content": tool_content}], TOOLS,
                            add_generation_prompt=True)
    return len(grown) - len(base)


async def check_segments(episode: Episode, client, engine, template, store, reward: float) -> list:
    """One segment per edit, token-exact and replayable; cache hits within a segment; samples with the reward."""
    record = await client.record(episode.session["session_id"])
    segments = record["segments"]
    assert len(segments) == episode.log.edits + 1
    prompts = iter(episode.log.prompt_tokens)
    cached = iter(episode.log.cached_tokens)
    call = 0
    for segment in segments:
        assert_ledger_consistent(segment)
        # the segment opens with a fresh render of exactly the (edited) messages of its first call
        first = segment["turns"][0]["prompt_len"]
        assert segment["tokens"][:first] == template.render(episode.sent[call], episode.tools,
                                                                       add_generation_prompt=True)
        previous_end = None
        for turn in segment["turns"]:
            assert turn["prompt_len"] == next(prompts)
            hit = next(cached)
            if previous_end is not None:  # everything the previous turn saw and said is served from the cache
                assert hit >= previous_end, (call, hit, previous_end)
            previous_end = turn["prompt_len"] + turn["output_len"] - 1
            call += 1
        await assert_engine_replays(engine.url, segment, lambda k: {
            "temperature": 0.0, "max_new_tokens": 64, "stop_token_ids": list(template.stop_token_ids)})
    assert call == episode.max_turns
    finished = await client.finish(episode.session["session_id"], reward=reward)
    samples = await store.get_samples(finished["sample_refs"])
    assert [s.tokens.tolist() for s in samples] == [s["tokens"] for s in segments]
    assert all(s.reward == reward and s.session_id == episode.session["session_id"] for s in samples)
    return samples


async def play(scripted_client, openai_client, config: ContextConfig, group_id: str,
               max_turns: int = MAX_TURNS) -> Episode:
    session = await scripted_client.create(group_id=group_id, task_id="t", env="ctx")
    episode = Episode(session, config, max_turns)
    await episode.run(openai_client)
    return episode


async def test_keep_recent_k_bounds_the_context_and_each_fold_is_a_segment(
        scripted_client, scripted_engine, template, store, openai_client):
    k, every = 3, 4
    episode = await play(scripted_client, openai_client, ContextConfig(keep_recent_k=k, fold_every=every), "g-keep")
    unfolded_max = k + every - 1
    for n, messages in enumerate(episode.sent):  # request n holds n rounds: only the last k..k+every-1 unfolded
        spans = rounds(messages)
        assert len(spans) == n
        full = [i for i, (start, end) in enumerate(spans) if messages[end - 1]["content"] == observation(i + 1)]
        assert full == list(range(max(0, n - len(full)), n)) and len(full) <= unfolded_max
        assert n < k or len(full) >= k
    full_round = max(round_tokens(template, observation(1)), episode.log.prompt_tokens[1] - episode.log.prompt_tokens[0])
    folded_round = round_tokens(template, ContextConfig.placeholder.format(chars=OBSERVATION_CHARS))
    base = episode.log.prompt_tokens[0]
    for n, tokens in enumerate(episode.log.prompt_tokens):
        bound = base + min(n, unfolded_max) * full_round + max(0, n - unfolded_max) * folded_round
        assert tokens <= bound, (n, tokens, bound)
    assert episode.log.prompt_tokens[-1] < base + (MAX_TURNS - 1) * full_round * 0.6  # far below no folding
    folds = MAX_TURNS - 1 - k - (MAX_TURNS - 1 - k) % every  # observations past the last k, in whole batches
    assert episode.log.folds == folds and episode.log.edits == folds // every and episode.log.discards == 0

    # the group's second member, unmanaged (44 unfolded rounds would pass the tiny model's 4096 positions)
    other = await play(scripted_client, openai_client, ContextConfig(), "g-keep", max_turns=6)
    assert other.log.edits == 0 and other.log.prompt_tokens == sorted(set(other.log.prompt_tokens))
    samples = await check_segments(episode, scripted_client, scripted_engine, template, store, reward=1.0)
    samples += await check_segments(other, scripted_client, scripted_engine, template, store, reward=0.0)
    scored = score_group(make_group(samples, group_size=2), weight_version=0, staleness_tau=2, advantage="group_mean")
    by_session = {(s.sample.session_id, s.sample.metadata["segment"]): s.advantage for s in scored.samples}
    assert len(by_session) == len(samples) == episode.log.edits + 2
    assert {a for (sid, _), a in by_session.items() if sid == episode.session["session_id"]} == {0.5}
    assert {a for (sid, _), a in by_session.items() if sid == other.session["session_id"]} == {-0.5}


@pytest.mark.parametrize("keep_recent_k", [None, 2], ids=["discard-all", "keep-recent-k+discard-all"])
async def test_discard_all_keeps_every_prompt_under_its_budget(
        scripted_client, scripted_engine, template, store, openai_client, keep_recent_k):
    budget = 900
    config = ContextConfig(discard_at_tokens=budget, keep_recent_k=keep_recent_k)
    episode = await play(scripted_client, openai_client, config, "g-discard")
    assert max(episode.log.prompt_tokens) <= budget
    assert max(episode.log.prompt_tokens) > budget * 0.6  # it does fill the budget before a discard
    assert episode.log.discards >= 2 and (episode.log.folds > 0) == (keep_recent_k is not None)
    discards = 0
    for n, (before, after) in enumerate(zip(episode.sent, episode.sent[1:]), start=1):
        if len(after) < len(before):  # request n after a discard: the task, the note, the latest round
            discards += 1
            assert after[:2] == AGENT_TASK and after[2]["role"] == "user" and "discarded" in after[2]["content"]
            assert [m["role"] for m in after[3:]] == ["assistant", "tool"] and after[4]["content"] == observation(n)
            assert after[3]["tool_calls"][0]["function"]["name"] == "bash"
    assert discards == episode.log.discards
    await check_segments(episode, scripted_client, scripted_engine, template, store, reward=1.0)
