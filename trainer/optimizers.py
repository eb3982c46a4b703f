"""The torch backend's optimizer (`trainer.optimizer`): AdamW, or Muon for the hidden matrices and AdamW for
the rest, as GLM-5 trains.

Muon is torch.optim.Muon (momentum orthogonalised by Newton-Schulz), with Moonlight's `match_rms_adamw` lr
scaling, so that one `trainer.lr` means the same step size for both optimizers. It updates every matrix of
the transformer blocks: attention projections, the dense and shared-expert MLPs, the router, and the routed
experts. Those are one 3-D tensor per layer ([experts, out, in]) and torch's Muon takes 2-D parameters only,
so each expert's matrix is its own Muon parameter: a 2-D view sharing the tensor's storage (ExpertViews).
Embeddings, the LM head, norms and biases stay on AdamW (Muon's and Moonlight's recipe: they are not hidden
linear maps), as does anything trained apart (the MTP layer).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from asyncrl.config import OPTIMIZERS

ADAMW_ONLY = ("embed_tokens", "lm_head", "mtp_layers")
"""Matrices Muon leaves to AdamW: the input embedding, the output head, and the MTP layer (trained apart, by
its own loss and gradient clip)."""


def build_optimizer(name: str, named_params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float):
    """-> an optimizer over `named_params` with step / zero_grad / state_dict / load_state_dict."""
    if name == "adamw":
        return torch.optim.AdamW([p for _, p in named_params], lr=lr, weight_decay=weight_decay)
    if name == "muon":
        return MuonWithAdamW(named_params, lr, weight_decay)
    raise ValueError(f"trainer.optimizer {name!r}: one of {', '.join(OPTIMIZERS)}")


def is_hidden_matrix(name: str, param: Tensor) -> bool:
    return param.dim() in (2, 3) and not any(part in name for part in ADAMW_ONLY)


class ExpertViews:
    """2-D views of 3-D weights, one per expert, that torch's Muon can own: they share the weights' storage (an
    update of a view is an update of its expert), and before each step they are given the matching slices of
    the weights' gradients."""

    def __init__(self, weights: list[Tensor]) -> None:
        self.pairs = [(w, [w.detach()[e] for e in range(w.shape[0])]) for w in weights]

    @property
    def views(self) -> list[Tensor]:
        return [view for _, views in self.pairs for view in views]

    def take_grads(self) -> None:
        for weight, views in self.pairs:
            for e, view in enumerate(views):
                view.grad = None if weight.grad is None else weight.grad[e]

    def zero_grad(self) -> None:
        """The weights are in no optimizer: their gradients are dropped here, or they would add up."""
        for weight, views in self.pairs:
            weight.grad = None
            for view in views:
                view.grad = None


class MuonWithAdamW:
    """Muon on the hidden matrices (ExpertViews for the 3-D ones), AdamW on every other parameter; one
    optimizer to the backend (its state_dict holds both)."""

    def __init__(self, named_params: list[tuple[str, nn.Parameter]], lr: float, weight_decay: float) -> None:
        hidden = [(n, p) for n, p in named_params if is_hidden_matrix(n, p)]
        ids = {id(p) for _, p in hidden}
        self.experts = ExpertViews([p for _, p in hidden if p.dim() == 3])
        matrices = [p for _, p in hidden if p.dim() == 2] + self.experts.views
        self.muon = torch.optim.Muon(matrices, lr=lr, weight_decay=weight_decay, adjust_lr_fn="match_rms_adamw")
        rest = [p for _, p in named_params if id(p) not in ids]
        self.adamw = torch.optim.AdamW(rest, lr=lr, weight_decay=weight_decay)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.experts.zero_grad()
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)

    def step(self) -> None:
        self.experts.take_grads()
        self.muon.step()
        self.adamw.step()

    def state_dict(self) -> dict[str, Any]:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state) != {"muon", "adamw"}:
            raise ValueError(f"optimizer state of {sorted(state)[:4]}: not a Muon + AdamW checkpoint "
                             "(a run started with trainer.optimizer=adamw resumes with adamw)")
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])
