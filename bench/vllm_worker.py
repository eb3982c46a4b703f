"""vLLM side of bench/vllm_cpu.py: runs in the vLLM venv (.venv-vllm, bench/setup_vllm_cpu.sh), imports
nothing of asyncrl, reads its jobs from a JSON file and writes its results to another.

    .venv-vllm/bin/python bench/vllm_worker.py --model DIR --jobs jobs.json --out result.json

jobs.json: {"llm": {extra LLM(...) kwargs}, "greedy": {"prompts": [[ids]], "max_tokens": N},
            "throughput": {"new_tokens": 64, "warmup_prompt": [ids], "rounds": {"1": [[ids]], "8": ...}}}
Prompts go in as token ids (skip_tokenizer_init: the checkpoint has no tokenizer). Each throughput round
is one LLM.generate call with all of its prompts (offline batch: vLLM's own scheduler keeps up to
max_num_seqs of them running), after a one-prompt warm-up call.
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--jobs", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    jobs = json.loads(open(args.jobs).read())

    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    out: dict = {"vllm_version": vllm.__version__, "torch_version": torch.__version__,
                 "env": {k: v for k, v in os.environ.items() if k.startswith(("VLLM_", "OMP_", "KMP_"))}}
    llm_kwargs = {"model": args.model, "skip_tokenizer_init": True, "dtype": "float32", "seed": 0,
                  "max_model_len": 256, "max_num_seqs": 128, **jobs.get("llm", {})}
    out["llm_kwargs"] = llm_kwargs
    start = time.perf_counter()
    llm = LLM(**llm_kwargs)
    out["init_s"] = time.perf_counter() - start

    def tokens(prompts: list[list[int]]) -> list:
        return [TokensPrompt(prompt_token_ids=p) for p in prompts]

    if "greedy" in jobs:
        g = jobs["greedy"]
        params = SamplingParams(temperature=0.0, max_tokens=g["max_tokens"], ignore_eos=True, logprobs=1)
        start = time.perf_counter()
        results = llm.generate(tokens(g["prompts"]), params, use_tqdm=False)
        out["greedy"] = {"elapsed_s": time.perf_counter() - start, "outputs": [
            {"token_ids": list(r.outputs[0].token_ids),
             "logprobs": [step[t].logprob for step, t in zip(r.outputs[0].logprobs, r.outputs[0].token_ids)]}
            for r in results]}

    if "throughput" in jobs:
        t = jobs["throughput"]
        params = SamplingParams(temperature=1.0, max_tokens=t["new_tokens"], ignore_eos=True)
        rounds = {}
        for concurrency, prompts in t["rounds"].items():
            llm.generate(tokens([t["warmup_prompt"]]), params, use_tqdm=False)  # warm-up
            start = time.perf_counter()
            results = llm.generate(tokens(prompts), params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            counts = [len(r.outputs[0].token_ids) for r in results]
            assert counts == [t["new_tokens"]] * len(prompts), counts
            rounds[concurrency] = {"tokens_per_s": sum(counts) / elapsed, "elapsed_s": elapsed}
            print(f"vllm concurrency {concurrency}: {rounds[concurrency]['tokens_per_s']:.0f} tok/s", flush=True)
        out["throughput"] = rounds

    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
