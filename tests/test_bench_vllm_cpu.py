"""bench/vllm_cpu.py's DeepSeek-V3 copy of a GLM-5 checkpoint is the same model while contexts stay within
index_topk: transformers' DeepseekV3ForCausalLM on the copy gives asyncrl's log-probs on the original. (vLLM
itself is checked by the benchmark, which compares its greedy tokens and log-probs with asyncrl's engine.)"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from asyncrl.config import load_model_section
from asyncrl.model.io import load_pretrained, read_tensors
from bench.engine_bench import prompts
from bench.vllm_cpu import MODEL, deepseek_v3_config, deepseek_v3_copy, glm5_checkpoint


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm-bench")
    glm5, _ = glm5_checkpoint(work / "glm5")
    return glm5, work / "deepseek_v3", deepseek_v3_copy(glm5, work / "deepseek_v3")


def test_copy_drops_only_the_indexer_and_the_mtp_layer(checkpoints):
    glm5, copy, dropped = checkpoints
    ours, theirs = read_tensors(glm5), read_tensors(copy)
    assert dropped["dropped_kinds"] == ["indexer", "mtp"]
    assert all(".indexer." in n or n.startswith("model.layers.4.") for n in set(ours) - set(theirs))
    assert all(torch.equal(ours[n], t) for n, t in theirs.items())


def test_copy_computes_the_same_log_probs_in_transformers(checkpoints):
    transformers = pytest.importorskip("transformers")
    glm5, copy, _ = checkpoints
    ids = torch.tensor(prompts(3))
    deepseek = transformers.AutoModelForCausalLM.from_pretrained(copy, dtype=torch.float32).eval()
    assert type(deepseek).__name__ == "DeepseekV3ForCausalLM"
    with torch.no_grad():
        ours = load_pretrained(glm5).eval()(ids).log_softmax(-1)
        theirs = deepseek(ids).logits.float().log_softmax(-1)
    assert (ours - theirs).abs().max() < 1e-4


def test_config_refuses_what_deepseek_v3_computes_differently():
    arch = load_model_section(MODEL).arch
    config = deepseek_v3_config(arch)
    assert (config["topk_method"], config["scoring_func"], "index_topk" in config) == ("noaux_tc", "sigmoid", False)
    with pytest.raises(ValueError, match="rms_norm_eps"):
        deepseek_v3_config(dataclasses.replace(arch, rms_norm_eps=1e-5))
