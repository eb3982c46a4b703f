"""Packed teacher-forced log-probs from a megatron GPTModel, with vocab-parallel logits.

A MicroBatch (flat tokens + cu_seqlens) runs as one THD-packed sequence: PackedSeqParams keep
sequences apart in attention and the indexer, and RoPE positions restart at every boundary. Under
sequence parallelism the token count must divide by the TP size, so a padding sequence is appended
(its rows are dropped from the outputs). The logits stay sharded over the vocabulary: log-probs come
from megatron's vocab_parallel_cross_entropy and the entropy from the same three TP all-reduces
(max, sum of exp, sum of p * logit), so no rank ever holds the [T, vocab] matrix.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.packing import MicroBatch

PAD_TOKEN = 0


@dataclass
class PackedInput:
    input_ids: Tensor      # [1, T + pad]
    position_ids: Tensor   # [1, T + pad]
    targets: Tensor        # [T + pad]
    temperatures: Tensor   # [T + pad] float32: the temperature each target was sampled at (1 on padding)
    packed_seq_params: object
    num_tokens: int        # T: rows that belong to the micro-batch


def pack_for_megatron(mb: MicroBatch, multiple: int, device: torch.device) -> PackedInput:
    """THD inputs of a micro-batch, padded with one extra sequence to a multiple of `multiple` tokens."""
    from megatron.core.packed_seq_params import PackedSeqParams

    num_tokens = mb.num_tokens
    pad = -num_tokens % multiple
    cu_seqlens = mb.cu_seqlens.to(torch.int32)
    if pad:
        cu_seqlens = torch.cat([cu_seqlens, cu_seqlens.new_tensor([num_tokens + pad])])
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    positions = torch.arange(num_tokens + pad) - torch.repeat_interleave(cu_seqlens[:-1].long(), lengths)
    padding = torch.full((pad,), PAD_TOKEN, dtype=torch.long)
    max_len = int(lengths.max())
    cu_seqlens = cu_seqlens.to(device)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=max_len, max_seqlen_kv=max_len)
    return PackedInput(
        input_ids=torch.cat([mb.input_ids.long(), padding])[None].to(device),
        position_ids=positions[None].to(device),
        targets=torch.cat([mb.targets.long(), padding]).to(device),
        temperatures=torch.cat([mb.temperatures.float(), torch.ones(pad)]).to(device),
        packed_seq_params=params,
        num_tokens=num_tokens,
    )


@dataclass
class TokenOutputs:
    logprobs: Tensor            # [T] (differentiable)
    entropy: Optional[Tensor]   # [T] (no grad), when asked


def token_logprobs(model: torch.nn.Module, packed: PackedInput, tp_group: Optional[dist.ProcessGroup],
                   with_entropy: bool = True) -> TokenOutputs:
    """Forward the packed micro-batch -> per-token log p(target) (and entropy), fp32, at each target's
    sampling temperature."""
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=None,
                   packed_seq_params=packed.packed_seq_params)  # [1, T + pad, vocab / TP]
    logits = logits[0].float() / packed.temperatures[:, None]  # [T + pad, vocab / TP], as the engine samples
    entropy = vocab_parallel_entropy(logits, tp_group)[: packed.num_tokens] if with_entropy else None
    # vocab_parallel_cross_entropy works on [s, b, v] and shifts its input in place: give it a view copy
    nll = vocab_parallel_cross_entropy(logits.clone()[:, None], packed.targets[:, None], tp_group=tp_group)
    return TokenOutputs(-nll[: packed.num_tokens, 0], entropy)


@torch.no_grad()
def vocab_parallel_entropy(logits: Tensor, tp_group: Optional[dist.ProcessGroup]) -> Tensor:
    """Entropy of softmax over the full vocabulary from vocab shards [T, vocab / TP] -> [T]."""
    top = logits.max(-1).values
    _all_reduce(top, dist.ReduceOp.MAX, tp_group)
    shifted = logits - top[:, None]
    exp = shifted.exp()
    sum_exp, weighted = exp.sum(-1), (exp * shifted).sum(-1)
    _all_reduce(sum_exp, dist.ReduceOp.SUM, tp_group)
    _all_reduce(weighted, dist.ReduceOp.SUM, tp_group)
    return sum_exp.log() - weighted / sum_exp  # H = log Z - E_p[logit - max]


def _all_reduce(tensor: Tensor, op, group: Optional[dist.ProcessGroup]) -> None:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(tensor, op=op, group=group)
