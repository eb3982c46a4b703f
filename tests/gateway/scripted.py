"""A tiny model whose greedy reply is a fixed tool call, built by hand rather than trained.

A random tiny model never writes a tool call, and training one to memorise a conversation takes
minutes on two cores. So this model is a bigram lookup: every layer's output projection is zero
(the residual stream stays the current token's embedding), chain tokens get orthogonal
embeddings, and lm_head maps each chain token to its successor with a logit margin of ~30. From
the generation prompt `<|assistant|><think>` the model therefore says REPLY (reasoning, content,
one `bash` tool call) and stops with <|observation|>, at temperature 0 and, with probability
~1 - 1e-10 per token, at temperature 1 too. Its log-probs are still real model log-probs.
REPLY's reasoning and content each hold a character split over several byte tokens.
"""

from __future__ import annotations

import torch

from asyncrl.chat_template import GlmChatTemplate
from asyncrl.model.io import save_pretrained
from asyncrl.model.model import Glm5ForCausalLM

TOOLS = [{"type": "function", "function": {
    "name": "bash", "description": "Run a command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}]

REASONING = "Run ls\u2192."
CONTENT = "Listing \u00e9:"
"""Both hold a character the tiny tokenizer splits into byte tokens (-> three, e two): a stream sees partial
UTF-8 characters mid-reply, as byte-level BPE models produce them."""
COMMAND = "ls"
REPLY = {"role": "assistant", "content": CONTENT, "reasoning_content": REASONING,
         "tool_calls": [{"type": "function", "function": {"name": "bash", "arguments": {"command": COMMAND}}}]}
AGENT_TASK = [{"role": "system", "content": "You run shell commands."},
              {"role": "user", "content": "Explore the files."}]
"""The task of the long agent episodes played with this model (context management's test and bench)."""
OBSERVATION_CHARS = 120


def observation(n: int) -> str:
    """What the n-th `ls` of those episodes returns: OBSERVATION_CHARS characters of a listing."""
    line = f"-rw-r--r-- 1 root root {n:04d} file_{n:03d}.py\n"
    return (line * (OBSERVATION_CHARS // len(line) + 1))[:OBSERVATION_CHARS]


LOGIT_MARGIN = 30.0
_ZEROED = ("o_proj.weight", "mlp.down_proj.weight", "experts.down_proj", "shared_experts.down_proj.weight")


def reply_ids(template: GlmChatTemplate) -> list[int]:
    """What the model says after the generation prompt: REPLY's rendering minus `<|assistant|><think>`,
    then its stop token."""
    rendered = template.render([REPLY])[2:]  # drop [gMASK]<sop>
    prompt = template.generation_prompt()
    assert rendered[:len(prompt)] == prompt
    return rendered[len(prompt):] + [template.stop_token_for(REPLY)]


def scripted_model(arch, template: GlmChatTemplate, seed: int = 0) -> Glm5ForCausalLM:
    chain = [template.generation_prompt()[-1], *reply_ids(template)]
    assert len(set(chain[:-1])) == len(chain) - 1, "a bigram chain needs distinct tokens"
    model = Glm5ForCausalLM.from_config(arch, seed=seed)
    hidden = arch.hidden_size
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(_ZEROED):
                param.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        head.zero_()
        for i, (token, successor) in enumerate(zip(chain, chain[1:])):
            embed[token] = 0.0
            embed[token, i] = 1.0  # unit vector e_i; after the final RMSNorm it is sqrt(hidden) e_i
            head[successor, i] = LOGIT_MARGIN / hidden ** 0.5
    return model


def save_scripted_checkpoint(arch, template: GlmChatTemplate, path):
    save_pretrained(scripted_model(arch, template), path)
    return path
