"""The megatron backend: GLM-5 on megatron-core (MLA + DSA + MoE modules, DDP, optimizer, TP/EP).

Weights enter and leave as HF state dicts (hf_weights), so this backend starts from the same
checkpoint (or the same seeded random init) as the torch backend and pushes the same tensors to the
engines. Per step: every micro-batch runs forward (vocab-parallel log-probs: logprobs.py) and
backward into megatron DDP's grad buffers; `finalize_model_grads` reduces them (data parallel, and the
sequence-parallel norms over TP); the megatron optimizer clips and steps, unless the grad norm is not
finite. Loss terms share the step-wide `normalizer` and DDP sums (calculate_per_token_loss), so the
gradient is the single-process one whatever the parallel layout.

Processes: one (a private process group), or several under torchrun where tensor x expert parallel
ranks come from `trainer.megatron`. The RL loop runs on rank 0; other ranks call `follow()` and execute
the leader's calls (it broadcasts them with their micro-batches). On a CPU-only host the CUDA calls
megatron makes are redirected by cpu_shims.
"""

from __future__ import annotations

import math
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor

from asyncrl.config import ModelSection, TrainerConfig
from asyncrl.model.config import ModelConfig
from asyncrl.model.io import FP32_TENSORS, dtype_from_name, read_tensors
from asyncrl.model.model import Glm5ForCausalLM
from trainer.backends.megatron import cpu_shims
from trainer.backends.base import SampleTokens, StepResult, TrainerBackend, sample_tokens
from trainer.backends.data_parallel import shard_by_tokens
from trainer.backends.leader import STOP, announce, follow_leader
from trainer.losses import LossInputs, LossMetrics, build_loss
from trainer.packing import MicroBatch

METRIC_FIELDS = ("loss_tokens", "masked_tokens", "clipped_tokens", "ratio_sum", "mismatch_kl_sum", "entropy_sum")
"""LossMetrics sums carried in the step's totals vector, after (loss, tokens)."""
INDEXER = ".core_attention.indexer."


class MegatronBackend(TrainerBackend):
    def __init__(self, cfg: TrainerConfig, model: ModelSection, seed: int = 0) -> None:
        super().__init__(cfg, model, seed)
        if cfg.mtp_loss_coef > 0:
            raise ValueError("megatron backend: trainer.mtp_loss_coef must be 0 (online MTP training is torch-backend "
                             "only: megatron-core trains its MTP block jointly with the decoder; docs/trainer.md)")
        if cfg.optimizer != "adamw":
            raise ValueError(f"megatron backend: trainer.optimizer={cfg.optimizer} is not supported (it builds "
                             "megatron-core's Adam; Muon runs on the torch backend: trainer.backend=torch)")
        cpu_shims.install()
        from trainer.backends.megatron.hf_weights import Ranks
        from trainer.backends.megatron.model import ParallelSizes

        if not cfg.freeze_indexer:
            raise ValueError("megatron backend: only freeze_indexer=true is supported (RL keeps the DSA indexer "
                             "fixed; its KL alignment loss is not wired to megatron's DSAIndexerLossAutoScaler)")
        self.device = _device()
        self.parallel = ParallelSizes(cfg.megatron.tensor_parallel, cfg.megatron.expert_parallel)
        _init_parallel(self.parallel, self.device, seed)
        self.ranks = Ranks.from_megatron()
        self.arch, hf = initial_weights(model, seed)
        self.mtp_tensors = {name: hf.pop(name) for name in list(hf) if is_mtp(name, self.arch)}
        self.compute_dtype = dtype_from_name(model.dtype)
        self.model = _wrap_ddp(self._build_model(hf))
        self.routing = self._routing_replay()
        self.optimizer = self._new_optimizer()
        self.loss_fn = build_loss(cfg.loss)

    def _build_model(self, hf: dict[str, Tensor]) -> torch.nn.Module:
        """This rank's shards of the GPTModel, holding the HF weights; the indexer frozen."""
        from trainer.backends.megatron.hf_weights import load_hf_weights
        from trainer.backends.megatron.model import build_gpt_model

        module = build_gpt_model(self.arch, self.parallel, self.compute_dtype, self.device, self.cfg.grad_checkpointing)
        load_hf_weights(module, hf, self.ranks)
        for name, param in module.named_parameters():
            if INDEXER in name:  # frozen: no gradient, so DDP and the optimizer never see it
                param.requires_grad_(False)
        return module

    def _routing_replay(self):
        from megatron.core import parallel_state as ps
        from trainer.backends.megatron.routing_replay import RoutingReplay

        return RoutingReplay(self.model, self.arch, ps.get_tensor_model_parallel_rank(),
                             ps.get_tensor_model_parallel_world_size())

    def _new_optimizer(self):
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

        config = OptimizerConfig(
            optimizer="adam", lr=self.cfg.lr, min_lr=self.cfg.lr, weight_decay=self.cfg.weight_decay,
            adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,  # torch.optim.AdamW's defaults (torch backend)
            clip_grad=self.cfg.grad_clip if self.cfg.grad_clip > 0 else float("inf"),
            bf16=self.compute_dtype == torch.bfloat16, params_dtype=self.compute_dtype,
            use_distributed_optimizer=False,
        )
        with cpu_shims.cuda_on_cpu():
            return get_megatron_optimizer(config, [self.model])

    # Leader / followers --------------------------------------------------------------------------
    @property
    def is_leader(self) -> bool:
        return not dist.is_initialized() or dist.get_rank() == 0

    def follow(self) -> None:
        """Other ranks: run the leader's calls until it calls close()."""
        follow_leader(lambda method, args: getattr(self, f"_{method}")(*args))

    def close(self) -> None:
        if self.is_leader:
            announce(STOP)

    # Training ------------------------------------------------------------------------------------
    def train_step(self, micro_batches: list[MicroBatch], normalizer: int) -> StepResult:
        announce("train_step", micro_batches, normalizer)
        return self._train_step(micro_batches, normalizer)

    def _train_step(self, micro_batches: list[MicroBatch], normalizer: int) -> StepResult:
        from megatron.core import parallel_state as ps
        from megatron.core.distributed import finalize_model_grads

        self.model.train()
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        totals = torch.zeros(2 + len(METRIC_FIELDS), dtype=torch.float64, device=self.device)
        samples: dict[str, SampleTokens] = {}
        for mb, weight in self._data_parallel_share(micro_batches):
            totals += self._forward_backward(mb, normalizer, weight, samples if weight else {})
        finalize_model_grads([self.model])
        if ps.get_data_parallel_world_size() > 1:
            dist.all_reduce(totals, group=ps.get_data_parallel_group())
            samples = _merge_over(ps.get_data_parallel_group(), samples)
        with cpu_shims.cuda_on_cpu():
            self.optimizer.prepare_grads()
            grad_norm = float(self.optimizer.get_grad_norm())
            finite = math.isfinite(grad_norm)
            if finite:  # a NaN/inf gradient would poison the weights and the Adam moments: skip
                self.optimizer.step()  # clips to trainer.grad_clip, then steps (dense and expert groups)
        result = _result(totals, grad_norm, skipped=not finite)
        result.samples = samples
        return result

    def _data_parallel_share(self, micro_batches: list[MicroBatch]) -> list[tuple[MicroBatch, float]]:
        """This DP rank's micro-batches (token-balanced), as (micro-batch, loss weight). Expert
        parallelism runs collectives inside every MoE layer, so all ranks run the same number of
        passes: a rank short of micro-batches repeats one with weight 0."""
        from megatron.core import parallel_state as ps

        shares = shard_by_tokens(micro_batches, ps.get_data_parallel_world_size())
        mine = [(mb, 1.0) for mb in shares[ps.get_data_parallel_rank()]]
        if self.parallel.expert > 1 and micro_batches:
            mine += [(micro_batches[0], 0.0)] * (max(len(s) for s in shares) - len(mine))
        return mine

    def _forward_backward(self, mb: MicroBatch, normalizer: int, weight: float,
                          samples: dict[str, SampleTokens]) -> Tensor:
        """One micro-batch: backward its share of the step loss, its samples' forward values into `samples`;
        -> its totals vector (no grad)."""
        with self._replaying(mb) as (forward, routing):
            out = forward(True)
            mb = mb.to(self.device)
            old = out.logprobs.detach() if self.loss_fn.needs_old_logprobs else None
            loss, metrics = self.loss_fn(LossInputs(out.logprobs, mb.rollout_logprobs, mb.advantages, mb.loss_mask,
                                                    old_logprobs=old, entropy=out.entropy, cu_seqlens=mb.cu_seqlens,
                                                    normalizer=normalizer))
            routing.backward_phase()  # activation recomputation routes as the forward did
            (loss * weight).backward()
            samples.update(sample_tokens(mb, out.logprobs, out.entropy))
        values = [loss.detach(), loss.new_tensor(float(mb.num_tokens)), *(getattr(metrics, f) for f in METRIC_FIELDS)]
        return torch.stack([v.to(loss.dtype) for v in values]).double() * weight

    @contextmanager
    def _replaying(self, mb: MicroBatch):
        """-> (forward(with_entropy) of the micro-batch, the routing replay it runs under: the
        micro-batch's routing if it carries one)."""
        from megatron.core import parallel_state as ps
        from trainer.backends.megatron.logprobs import pack_for_megatron, token_logprobs

        packed = pack_for_megatron(mb, self.parallel.tensor, self.device)

        def forward(with_entropy: bool):
            return token_logprobs(self.model, packed, ps.get_tensor_model_parallel_group(), with_entropy)

        with self.routing.replaying(self.routing.local_targets(mb, packed.input_ids.shape[1])) as routing:
            yield forward, routing

    @torch.no_grad()
    def logprobs(self, micro_batch: MicroBatch) -> Tensor:
        announce("logprobs", micro_batch)
        return self._logprobs(micro_batch)

    @torch.no_grad()
    def _logprobs(self, micro_batch: MicroBatch) -> Tensor:
        self.model.eval()
        with self._replaying(micro_batch) as (forward, _):
            return forward(False).logprobs.float().cpu()

    def _reset_optimizer(self) -> None:
        """Adam's moments and step counts start over; the fp32 master weights stay. Building a new
        optimizer instead would re-create the masters from the model's bf16 parameters, rounding away,
        at every push, each update still smaller than a bf16 step."""
        for optimizer in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            optimizer.optimizer.state.clear()  # torch's Adam rebuilds a parameter's state at its next step

    # Weights and checkpoints -----------------------------------------------------------------------
    def hf_state_dict(self) -> dict[str, Tensor]:
        """HF-named weights in the compute dtype (router in fp32), MTP tensors included. Collective:
        the leader's call makes the followers gather too. Unsharded fp32 tensors are views of the live
        weights (as the torch backend's): use them before the next step."""
        announce("gather_hf")
        return self._gather_hf()

    def _gather_hf(self) -> dict[str, Tensor]:
        from trainer.backends.megatron.hf_weights import gather_hf_weights

        tensors = gather_hf_weights(self.model.module, self.ranks)
        tensors = {name: t.to(torch.float32 if name.endswith(FP32_TENSORS) else self.compute_dtype)
                   for name, t in tensors.items()}
        return {**tensors, **self.mtp_tensors}

    def save_checkpoint(self, path: Path) -> None:
        """<path>/model: HF checkpoint (config.json + model.safetensors, from the leader);
        <path>/optimizer_rank{r}.pt: each rank's optimizer state (its shards' moments and masters)."""
        announce("save_checkpoint", str(path))
        self._save_checkpoint(str(path))

    def _save_checkpoint(self, path: str) -> None:
        from safetensors.torch import save_file

        tensors = self._gather_hf()
        if self.is_leader:
            model_dir = Path(path) / "model"
            model_dir.mkdir(parents=True, exist_ok=True)
            self.arch.save(model_dir)
            save_file({name: t.contiguous().cpu() for name, t in tensors.items()}, model_dir / "model.safetensors",
                      metadata={"format": "pt"})
        _barrier()
        torch.save(self.optimizer.state_dict(), Path(path) / f"optimizer_rank{_rank()}.pt")

    def load_checkpoint(self, path: Path) -> None:
        announce("load_checkpoint", str(path))
        self._load_checkpoint(str(path))

    def _load_checkpoint(self, path: str) -> None:
        from trainer.backends.megatron.hf_weights import load_hf_weights

        hf = read_tensors(Path(path) / "model")
        self.mtp_tensors = {name: hf.pop(name) for name in list(hf) if is_mtp(name, self.arch)}
        load_hf_weights(self.model.module, hf, self.ranks)
        state = torch.load(Path(path) / f"optimizer_rank{_rank()}.pt", map_location=self.device, weights_only=False)
        with cpu_shims.cuda_on_cpu():
            self.optimizer.load_state_dict(state)


# Setup helpers --------------------------------------------------------------------------------------
def initial_weights(section: ModelSection, seed: int) -> tuple[ModelConfig, dict[str, Tensor]]:
    """(architecture, HF tensors): the checkpoint at `section.path`, else asyncrl's seeded random init
    (the torch backend's, so both backends start from identical weights)."""
    if section.path:
        return ModelConfig.from_pretrained(section.path), read_tensors(section.path)
    from asyncrl.model.io import checkpoint_tensors

    return section.arch, checkpoint_tensors(Glm5ForCausalLM.from_config(section.arch, seed=seed))


def is_mtp(name: str, arch: ModelConfig) -> bool:
    """MTP layers (model.layers.{num_hidden_layers + i}.*) ride along unchanged; megatron runs none."""
    parts = name.split(".")
    return name.startswith("model.layers.") and int(parts[2]) >= arch.num_hidden_layers


def _device() -> torch.device:
    if torch.cuda.is_available():
        index = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def _init_parallel(parallel, device: torch.device, seed: int) -> None:
    """torch.distributed (torchrun's env://, or a private one-process group), megatron's groups and
    its per-group RNG tracker."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            dist.init_process_group(backend)
        else:
            store = dist.FileStore(tempfile.mktemp(prefix="asyncrl-megatron-"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1)
    if ps.model_parallel_is_initialized():
        sizes = (ps.get_tensor_model_parallel_world_size(), ps.get_expert_model_parallel_world_size())
        if sizes != (parallel.tensor, parallel.expert):
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=parallel.tensor,
                                     expert_model_parallel_size=parallel.expert, expert_tensor_parallel_size=1)
    model_parallel_cuda_manual_seed(seed)


def _wrap_ddp(module: torch.nn.Module):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    module.config.finalize_model_grads_func = finalize_model_grads  # else DP grads are never reduced
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                               use_distributed_optimizer=False)
    with cpu_shims.cuda_on_cpu():
        return DistributedDataParallel(config=module.config, ddp_config=ddp_config, module=module)


def _merge_over(group, parts: dict) -> dict:
    """Every data-parallel rank's dict merged on the group's first rank (the leader's group: on the leader)."""
    ranks = dist.get_process_group_ranks(group)
    gathered = [None] * len(ranks) if dist.get_rank() == ranks[0] else None
    dist.gather_object(parts, gathered, dst=ranks[0], group=group)
    return {k: v for part in gathered for k, v in part.items()} if gathered else parts


def _result(totals: Tensor, grad_norm: float, skipped: bool) -> StepResult:
    loss, tokens, *sums = totals.tolist()
    metrics = LossMetrics(**{name: torch.tensor(v) for name, v in zip(METRIC_FIELDS, sums)}).summary()
    metrics["skipped_step"] = float(skipped)
    return StepResult(loss=loss, grad_norm=grad_norm, num_tokens=int(tokens), metrics=metrics)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.barrier()
