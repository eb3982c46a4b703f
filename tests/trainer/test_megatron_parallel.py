"""megatron backend on 2 CPU processes (torchrun, gloo): tensor parallel 2 (with sequence parallelism)
and expert parallel 2 give the single-process torch model's log-probs and first step, also when the
micro-batches bring routing to replay (each TP rank replays its share of the sequence).

Optional tier (`make test-megatron`); one torchrun runs all four (~15 s on 2 cores).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.config import TrainerConfig, load_model_section
from tests.trainer.megatron_helpers import make_micro_batches, reference_step, with_replayed_routing

pytestmark = [
    pytest.mark.megatron,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None,
                       reason="megatron-core is not installed (optional tier: make test-megatron)"),
]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("megatron-parallel") / "results.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "-m", "tests.trainer.megatron_parallel_worker", str(out)]
    job = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=280,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert job.returncode == 0, job.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def references():
    section = load_model_section("tiny")
    plain = make_micro_batches(section.arch)
    cfg = TrainerConfig(backend="megatron", lr=1e-3)
    return {routed: (reference_step(section.arch, cfg, batches), batches)
            for routed, batches in ((False, plain), (True, with_replayed_routing(plain, section.arch)))}


@pytest.mark.parametrize("routed", [False, True], ids=["", "replayed_routing"])
@pytest.mark.parametrize("layout", ["tp2", "ep2"])
def test_parallel_layout_matches_single_process_torch_model(measured, references, layout, routed):
    import torch

    ref, micro_batches = references[routed]
    got = measured[layout + ("_replayed_routing" if routed else "")]
    for logprobs, expected in zip(got["logprobs"], ref.logprobs_before):
        assert (torch.tensor(logprobs) - expected).abs().max() <= 1e-5
    assert got["loss"] == pytest.approx(ref.loss, abs=1e-6)
    assert got["grad_norm"] == pytest.approx(ref.grad_norm, rel=1e-5)
    assert got["num_tokens"] == sum(mb.num_tokens for mb in micro_batches)
    # the step's per-sample forward log-probs, gathered over the data-parallel ranks (ep2: 2 of them)
    spans = {sid: expected[a:b] for mb, expected in zip(micro_batches, ref.logprobs_before)
             for sid, a, b in zip(mb.sample_ids, mb.cu_seqlens[:-1].tolist(), mb.cu_seqlens[1:].tolist())}
    assert got["samples"].keys() == spans.keys()
    for sid, logprobs in got["samples"].items():
        assert (torch.tensor(logprobs) - spans[sid]).abs().max() <= 1e-5
    for logprobs, expected in zip(got["logprobs_after"], ref.logprobs_after):
        assert (torch.tensor(logprobs) - expected).abs().max() < 1e-4
    state = ref.model.state_dict()
    assert got["num_weights"] == len(state)
    wk = float(state["model.layers.0.self_attn.indexer.wk.weight"].double().sum())
    assert got["indexer_wk_sum"] == wk  # gathered from the shards, frozen: bit-identical
