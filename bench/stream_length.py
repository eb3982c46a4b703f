"""Streaming against non-streaming throughput by output length: does a streamed token cost more late in a
long output than early? (It did, while every snapshot was rebuilt from scratch: docs/engine.md, Streaming.)

    python bench/stream_length.py            # writes bench/results/stream_length.{json,md}

One engine process per streaming mode (SGLang's default cumulative events, then
--incremental-streaming-output); 8 concurrent requests of N sampled tokens with log-probs, first without
streaming, then streamed (as the gateway streams), through the engine's own client on the same 2 cores.
Tiny model, one torch thread; median of 3 rounds each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from asyncrl.config import load_model_section  # noqa: E402
from asyncrl.engine_client import EngineClient  # noqa: E402
from asyncrl.model.io import save_pretrained  # noqa: E402
from asyncrl.model.model import Glm5ForCausalLM  # noqa: E402
from tests.services import ServiceProcess  # noqa: E402

LENGTHS = (256, 2048)
CONCURRENCY = 8
PROMPT = [1006, 1008, 5, 6, 7]
MODES = {"cumulative": [], "incremental": ["--incremental-streaming-output"]}


async def rounds(url: str, length: int, stream: bool, repeats: int = 3) -> float:
    """Median tokens/s of `repeats` rounds of CONCURRENCY requests."""
    params = {"max_new_tokens": length, "temperature": 1.0, "ignore_eos": True}

    async def one(client: EngineClient, seed: int) -> int:
        if not stream:
            return len((await client.generate(PROMPT, {**params, "sampling_seed": seed}, return_logprob=True)).output_ids)
        count = 0
        async for snapshot in client.generate_stream(PROMPT, {**params, "sampling_seed": seed}):
            count = len(snapshot.output_ids)
        return count

    rates = []
    async with EngineClient(url, timeout_s=600) as client:
        for _ in range(repeats):
            start = time.perf_counter()
            counts = await asyncio.gather(*(one(client, i) for i in range(CONCURRENCY)))
            assert counts == [length] * CONCURRENCY
            rates.append(sum(counts) / (time.perf_counter() - start))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = parser.parse_args()
    result = {"command": " ".join(["python", *sys.argv]), "machine": f"{platform.machine()}, {os.cpu_count()} cores",
              "load_avg_start": os.getloadavg(), "concurrency": CONCURRENCY, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        save_pretrained(Glm5ForCausalLM.from_config(load_model_section("tiny").arch, seed=0), work / "ckpt")
        for mode, flags in MODES.items():
            engine = ServiceProcess("rollout.server", ["--model", str(work / "ckpt"), *flags], work, name=f"engine-{mode}")
            try:
                asyncio.run(rounds(engine.url, 16, stream=True, repeats=1))  # warm-up
                for length in LENGTHS:
                    plain = asyncio.run(rounds(engine.url, length, stream=False))
                    streamed = asyncio.run(rounds(engine.url, length, stream=True))
                    result["rows"].append({"mode": mode, "length": length, "plain_tok_s": plain,
                                           "streamed_tok_s": streamed, "ratio": streamed / plain})
                    print(result["rows"][-1], flush=True)
            finally:
                engine.stop()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "stream_length.json").write_text(json.dumps(result, indent=2))
    lines = ["# Streaming by output length", "", f"Command: `{result['command']}`  ",
             f"Machine: {result['machine']}, load average {result['load_avg_start'][0]:.1f} at start; "
             f"{CONCURRENCY} concurrent requests, tiny model, log-probs on, median of 3 rounds.", "",
             "| stream events | output tokens | not streamed tok/s | streamed tok/s | streamed / not |",
             "|---|---|---|---|---|"]
    lines += [f"| {r['mode']} | {r['length']} | {r['plain_tok_s']:.0f} | {r['streamed_tok_s']:.0f} | {r['ratio']:.2f} |"
              for r in result["rows"]]
    (args.out / "stream_length.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
