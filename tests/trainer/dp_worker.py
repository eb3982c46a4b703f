"""One rank of the two-process data-parallel test (tests/trainer/test_torch_backend.py): the leader
runs step / reset / step on the saved micro-batches and writes its results; the follower follows."""

import json
import sys
from pathlib import Path

import torch

from asyncrl.config import TrainerConfig, load_model_section
from trainer.backends.base import make_backend


def main(workdir: Path) -> None:
    torch.set_num_threads(1)
    backend = make_backend(TrainerConfig(lr=1e-3), load_model_section("tiny"), seed=0)
    if not backend.is_leader:
        backend.follow()
        backend.close()
        return
    step = torch.load(workdir / "step.pt", weights_only=False)
    results = [backend.train_step(step["mbs"], step["norm"])]
    backend.reset_optimizer()
    results.append(backend.train_step(step["mbs"], step["norm"]))
    torch.save({k: v.detach().clone() for k, v in backend.model.state_dict().items()}, workdir / "weights.pt")
    torch.save({k: p.grad.clone() for k, p in backend.model.named_parameters() if p.grad is not None},
               workdir / "grads.pt")
    steps = [{"loss": r.loss, "grad_norm": r.grad_norm, "num_tokens": r.num_tokens,
              "samples": {sid: t.logprobs.tolist() for sid, t in r.samples.items()}} for r in results]
    (workdir / "result.json").write_text(json.dumps({"steps": steps}))
    backend.close()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
