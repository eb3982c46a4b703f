"""Hand-written samples as the gateway records them: a two-turn agent episode (a tool call, its result,
an answer) rendered with the GLM template and the tiny tokenizer, so the dashboard has turns, a tool
call and loss-mask runs to show."""

from __future__ import annotations

import numpy as np

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.tokenizer import BUILTIN_TINY, load_tokenizer
from asyncrl.types import Sample, TrainedTokens

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def template() -> GlmChatTemplate:
    return GlmChatTemplate(load_tokenizer(BUILTIN_TINY), thinking=False)


def agent_sample(i: int, env: str = "calc", reward: float = 1.0, status: str = "completed",
                 outcome: str = "model", reason: str = "completed", version: int = 3) -> Sample:
    """prompt | model: a tool call | observation: its result | model: the answer."""
    t = template()
    tok = t.tokenizer
    prompt = t.render([{"role": "user", "content": f"what is 2 + {i}?"}], TOOLS, add_generation_prompt=True)
    call = tok.encode(f"<tool_call>add<arg_key>a</arg_key><arg_value>2</arg_value><arg_key>b</arg_key>"
                      f"<arg_value>{i}</arg_value></tool_call><|observation|>")
    observation = tok.encode(f"<tool_response>{2 + i}</tool_response>") + t.generation_prompt()
    answer = tok.encode(f"The answer is {2 + i}.<|user|>")
    parts = [(prompt, 0), (call, 1), (observation, 0), (answer, 1)]
    tokens = [x for ids, _ in parts for x in ids]
    mask = np.array([m for ids, m in parts for _ in ids], dtype=np.uint8)
    logprobs = np.where(mask == 1, -0.25 - 0.01 * np.arange(len(tokens)), 0.0).astype(np.float32)
    versions = np.where(mask == 1, version, -1)
    return Sample(sample_id=f"s{i}", session_id=f"sess{i}", group_id=f"g{i // 2}", task_id=f"t{i}", env=env,
                  status=status, reward=reward, tokens=tokens, loss_mask=mask, rollout_logprobs=logprobs,
                  weight_versions=versions, num_turns=2,
                  metadata={"info": {"outcome": outcome, "reason": reason}})


def trained_record(ref: str, sample: Sample, step: int, masked_every: int = 5) -> TrainedTokens:
    """What the trainer records for a sample: its own log-probs, every `masked_every`-th loss token
    outside the trust band."""
    mask = sample.loss_mask
    kept = mask.copy()
    loss_positions = np.flatnonzero(mask)
    kept[loss_positions[::masked_every]] = 0
    trainer = np.where(mask == 1, sample.rollout_logprobs - 0.05, 0.0)
    return TrainedTokens(sample_ref=ref, step=step, weight_version=step - 1, trainer_logprobs=trainer, kept=kept)
