"""torchrun worker of test_megatron_parallel.py: the megatron backend at TP=2, then EP=2, each without
and with replayed routing, on 2 CPU processes (gloo). Rank 0 drives the backend as the RL loop would (the other rank follows) and writes
what it measured as JSON to argv[1].

    torchrun --nproc-per-node 2 tests/trainer/megatron_parallel_worker.py OUT.json
"""

from __future__ import annotations

import json
import sys

import torch

from asyncrl.config import MegatronConfig, TrainerConfig, load_model_section
from tests.trainer.megatron_helpers import SEED, make_micro_batches, normalizer_of, with_replayed_routing
from trainer.backends.megatron.backend import MegatronBackend

LAYOUTS = {"tp2": MegatronConfig(tensor_parallel=2), "ep2": MegatronConfig(expert_parallel=2)}


def measure(layout: MegatronConfig, routed: bool) -> dict | None:
    """routed: the micro-batches carry routing to replay (tests.trainer.megatron_helpers)."""
    section = load_model_section("tiny")
    micro_batches = make_micro_batches(section.arch)
    if routed:
        micro_batches = with_replayed_routing(micro_batches, section.arch)
    backend = MegatronBackend(TrainerConfig(backend="megatron", lr=1e-3, megatron=layout), section, seed=SEED)
    if not backend.is_leader:
        backend.follow()
        return None
    logprobs = [backend.logprobs(mb).tolist() for mb in micro_batches]
    result = backend.train_step(micro_batches, normalizer_of(micro_batches))
    after = [backend.logprobs(mb).tolist() for mb in micro_batches]
    weights = backend.hf_state_dict()
    backend.close()
    return {"logprobs": logprobs, "loss": result.loss, "grad_norm": result.grad_norm,
            "num_tokens": result.num_tokens, "logprobs_after": after,
            "samples": {sid: t.logprobs.tolist() for sid, t in result.samples.items()}, "num_weights": len(weights),
            "indexer_wk_sum": float(weights["model.layers.0.self_attn.indexer.wk.weight"].double().sum())}


def main(out_path: str) -> None:
    results = {f"{name}{suffix}": measure(layout, routed) for name, layout in LAYOUTS.items()
               for suffix, routed in (("", False), ("_replayed_routing", True))}
    if torch.distributed.get_rank() == 0:
        with open(out_path, "w") as f:
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1])
