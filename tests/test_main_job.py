"""The main job (`make run`, experiment=file_lookup, its 30 RL steps): the agent's episodes are multi-turn with
tool calls executed in the namespace sandbox, the recorded samples keep every tool output out of the loss
mask, and the trained policy's held-out reward exceeds the warm-up's (`asyncrl eval`, the 100 held-out tasks x
4 samples). The warm-up's expert is lazy in half its demonstrations (it replies after reading one file), so
the base scores ~0.19 and RL's first lesson is to read both files (bench/results/main_job_runs.md lists the
runs of the main job's configs)."""

import asyncio
import json
import subprocess
import sys

import numpy as np
import pytest

from asyncrl.store import Store
from asyncrl.tokenizer import load_tokenizer
from tests.envs.isolation import NAMESPACES
from tests.services import ROOT
from tests.test_e2e_run import _in_copy, launch

STEPS = 30


async def _samples(url: str, run: str):
    store = Store.connect(url, run)
    try:
        return [sample for _, sample in await store.list_samples(count=100_000)]
    finally:
        await store.close()


def held_out_reward(model, out) -> float:
    proc = subprocess.run([sys.executable, "-m", "asyncrl_run.cli", "eval", "experiment=file_lookup", "--model", str(model),
                           "--tasks", "100", "--samples", "4", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())["mean_reward"]


def check_tool_outputs_are_outside_the_loss(sample, tokenizer) -> None:
    """Every token from an <|observation|> to the next <|assistant|> (the tool's output) has mask 0; the
    model's own tool calls (after the first <|assistant|>: the system block shows an example call) have mask 1."""
    observation, assistant = tokenizer.token_id("<|observation|>"), tokenizer.token_id("<|assistant|>")
    call = tokenizer.token_id("<tool_call>")
    replying, inside, outputs = False, False, 0
    for token, mask in zip(sample.tokens.tolist(), sample.loss_mask.tolist()):
        if token == observation and mask == 1:  # the model's stop token opens the observation
            inside = True
            continue
        if token == assistant:
            replying, inside = True, False
        if inside:
            assert mask == 0, tokenizer.decode(sample.tokens.tolist())
            outputs += 1
        if token == call and replying:
            assert mask == 1, tokenizer.decode(sample.tokens.tolist())
    assert outputs > 0


@pytest.mark.slow
@pytest.mark.timeout(1200)
@pytest.mark.skipif(not NAMESPACES, reason="the main job's env runs its tools in the namespace sandbox")
def test_the_main_job_trains_a_multi_turn_tool_using_agent(tmp_path):
    run_dir = tmp_path / "file_lookup"
    proc = launch(run_dir, "file_lookup", f"total_steps={STEPS}", experiment="file_lookup")
    assert proc.wait(700) == 0, (tmp_path / "file_lookup.log").read_text()[-4000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == STEPS and set(summary["outcomes"]["file-lookup"]) == {"model"}
    samples = asyncio.run(_in_copy(run_dir, tmp_path / "redis-copy", _samples))
    tools = [s.metadata["info"].get("tools", {}).get("calls", 0) for s in samples]
    early = [n for s, n in zip(samples, tools) if s.first_weight_version < STEPS // 3]
    late = [n for s, n in zip(samples, tools) if s.first_weight_version >= 2 * STEPS // 3]
    assert np.mean([s.num_turns for s in samples]) >= 2.0, np.mean([s.num_turns for s in samples])  # multi-turn
    # tool use rises under RL (the lazy expert's agent skips a file; measured 1.19 -> 1.73 calls per episode)
    assert np.mean(late) >= 1.5 and np.mean(late) > np.mean(early) + 0.2, (np.mean(early), np.mean(late))
    tokenizer = load_tokenizer("builtin:tiny")
    for sample in [s for s, n in zip(samples, tools) if n >= 2][:50]:
        check_tool_outputs_are_outside_the_loss(sample, tokenizer)
    base = held_out_reward(run_dir / "warmup", tmp_path / "base.json")
    trained = held_out_reward(run_dir / "final", tmp_path / "trained.json")
    print(f"held-out reward: warm-up {base:.3f}, trained {trained:.3f}")
    assert trained > base, (base, trained)
