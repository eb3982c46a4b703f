import pytest
import torch

from asyncrl.engine_client import EngineClient
from asyncrl.model.io import load_pretrained
from tests.services import ServiceProcess


def start_engine(checkpoint, workdir, *extra: str, name: str = "engine") -> ServiceProcess:
    return ServiceProcess("rollout.server", ["--model", str(checkpoint), *extra], workdir, name=name)


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


def argmax_continuation(model, prompt: list[int], steps: int) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    return ids[len(prompt):]
