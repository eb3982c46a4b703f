import pytest
import torch

from asyncrl.engine_client import EngineClient
from asyncrl.model.batch import ForwardBatch
from asyncrl.model.kv_cache import KVCache
from asyncrl.model.io import load_pretrained
from tests.services import ServiceProcess


def start_engine(checkpoint, workdir, *extra: str, name: str = "engine", port: int = 0) -> ServiceProcess:
    return ServiceProcess("rollout.server", ["--model", str(checkpoint), *extra], workdir, name=name, port=port)


@pytest.fixture(scope="module")
def engine(tiny_checkpoint, tmp_path_factory):
    """A real engine process serving the seed-0 tiny model."""
    proc = start_engine(tiny_checkpoint, tmp_path_factory.mktemp("engine"), "--max-total-tokens", "32768")
    yield proc
    assert proc.stop() == 0, proc.log()


@pytest.fixture
async def client(engine):
    async with EngineClient(engine.url, timeout_s=120) as c:
        yield c


@pytest.fixture(scope="session")
def reference_model(tiny_checkpoint):
    return load_pretrained(tiny_checkpoint).eval()


def teacher_forced(model, prompt: list[int], output: list[int]) -> torch.Tensor:
    """log p(output[i] | prompt + output[:i]) by one full forward (the trainer's view)."""
    ids = torch.tensor(prompt + output)
    with torch.no_grad():
        out = model.token_logprobs(ids, torch.tensor([0, len(ids)]), torch.cat([ids[1:], ids[:1]]))
    return out.logprobs[len(prompt) - 1:len(ids) - 1]


def recorded_routing(model, tokens: list[int]) -> torch.Tensor:
    """The experts one cached prefill of `tokens` routes each of them to: int32 [T, layers, k], -1 on dense
    layers (the engine's KVCache rows; the reference for routing replay)."""
    n = len(tokens)
    cache = KVCache(model.config, n, record_routing=True)
    with torch.inference_mode():
        model.forward_batch(ForwardBatch(torch.tensor(tokens), torch.tensor([n]), torch.arange(n)[None],
                                         torch.tensor([n])), cache)
    return cache.routed_experts.clone()


NEAR_TIE = 1e-5
"""Router choice values this close may rank either way (fp32 sums differ with the batch layout)."""


def reference_routing(model, tokens: list[int]) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """One prefill of `tokens` -> recorded experts [T, layers, k] and each MoE layer's masked router
    choice values [T, experts] (to tell a near-tie from a wrong answer)."""
    choices, hooks = {}, []
    for i, layer in enumerate(model.model.layers):
        if hasattr(layer.mlp, "gate"):
            def keep(gate, args, out, i=i):
                choices[i] = gate.scores(args[0])[1]
            hooks.append(layer.mlp.gate.register_forward_hook(keep))
    try:
        return recorded_routing(model, tokens), choices
    finally:
        for hook in hooks:
            hook.remove()


def assert_routing_replays(model, tokens: list[int], got: torch.Tensor) -> int:
    """Asserts that `got` [T, layers, k] (an engine's routing of `tokens`) is what a whole-sequence forward
    routes them to, up to near-ties; -> how many (token, layer) rows were near-ties."""
    config = model.config
    assert got.shape[0] == len(tokens)
    want, choices = reference_routing(model, tokens)
    dense = [i for i, kind in enumerate(config.layer_mlp_types) if kind == "dense"]
    assert (got[:, dense] == -1).all() and (got[:, list(choices)] >= 0).all()
    ties = 0
    for layer, choice in choices.items():
        differs = (got[:, layer].sort(-1).values != want[:, layer].sort(-1).values).any(-1)
        for t in differs.nonzero().flatten().tolist():  # the engine's pick must be as good as the best, within NEAR_TIE
            best, picked = choice[t, want[t, layer].long()].sum(), choice[t, got[t, layer].long()].sum()
            assert picked >= best - NEAR_TIE, (t, layer, got[t, layer].tolist(), want[t, layer].tolist())
            ties += 1
    return ties


def argmax_continuation(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]


DRAFT_PROMPTS = [[1000 + (7 * i + 3 * j) % 24 for j in range(6 + i % 5)] for i in range(48)]
"""Prompts the drafting checkpoint's MTP layer was trained on (its drafts are accepted there)."""
SHARPEN = 25.0
"""The drafting checkpoint's output head is the tiny model's times this (the greedy tokens are the same)."""


@pytest.fixture(scope="session")
def drafting_checkpoint(tiny_checkpoint, tmp_path_factory):
    """The seed-0 tiny model, its output head sharpened (SHARPEN), its MTP layer fitted for 40 steps to the
    model's own greedy continuations of DRAFT_PROMPTS (trainer/mtp_loss.py): drafts the target mostly accepts,
    then made overconfident."""
    from asyncrl.model.generate import greedy_generate
    from asyncrl.model.io import save_pretrained
    from trainer.mtp_loss import fit_mtp_layer

    model = load_pretrained(tiny_checkpoint).eval()
    with torch.no_grad():  # sharper next-token distributions (a random init's are near-uniform at temperature 1),
        model.lm_head.weight.mul_(SHARPEN)  # so that sampled tokens tell a right acceptance rule from a wrong one
    seqs = [p + o for p, o in zip(DRAFT_PROMPTS, greedy_generate(model, DRAFT_PROMPTS, 40))]
    assert fit_mtp_layer(model, seqs, steps=40) > 0.8  # the drafts it will make are mostly right
    with torch.no_grad():  # an overconfident drafter (q much sharper than p): a wrong acceptance rule shows
        model.model.mtp_layers[0].shared_head.norm.weight.mul_(4.0)
    path = tmp_path_factory.mktemp("tiny-drafting")
    save_pretrained(model, path)
    return path
