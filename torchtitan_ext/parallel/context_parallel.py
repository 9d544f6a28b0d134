"""Context parallelism: each sequence split over the ``cp`` ranks (``parallel/cp_layout.py``), attention over
the whole sequence by one of two schemes, swapped into the plain model's attention cores and mask builders.

* ``ring``: the K/V of each rank travel around the CP ranks, one hop per step; at every step the rank's
  queries attend over the K/V it holds (``ops/block_attention.py``) while the next hop is in flight, and the
  partial outputs are merged by their LSE. The backward passes K/V around again, and the K/V gradients
  travel with them back to their owner. Each step's (query, key) block pairs come from the global
  positions: under plain causal attention the head-tail layout makes them whole blocks (the own block
  causal, others fully visible or skipped); a visibility mask gives each step's block its own mask.
* ``alltoall`` (Ulysses): an all-to-all trades heads for sequence, so each rank holds ``heads / cp`` heads of
  the whole sequence, runs the ordinary attention core with the whole sequence's mask, and trades back.
  GQA's K/V heads are repeated up to a multiple of cp first when cp does not divide them.

Interleaved KV sharing needs nothing of its own: a consumer layer hands its core the local K/V of its group's
first layer, which the ring passes around (returning its gradient to this rank) and the all-to-all trades like
the layer's own.

The trainer hands the model each rank's part of the batch (``shard_batch``): tokens, labels, RoPE positions
(global) and the visibility pair of the local keys (global coordinates).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Attention, Decoder
from torchtitan_ext.ops.attention import attention, attention_lse, build_mask
from torchtitan_ext.ops.block_attention import Block, block_backward, block_forward, merge
from torchtitan_ext.parallel.cp_layout import check_cp_seq_len, layout_order, local_indices, shard_sequence

SCHEMES = ("ring", "alltoall")
Steps = list[list[Block]]  # ring step s -> the blocks of the local queries against the K/V held at step s


def check_cp(cfg, args: ModelArgs, dims) -> None:
    """One ConfigError line for a layout context parallelism cannot cut: the sequence into 2 x cp equal chunks
    (``check_cp_seq_len``), the heads per TP rank over the CP ranks for the all-to-all scheme."""
    cp, p, t = dims.cp, cfg.parallelism, cfg.training
    if cp == 1:
        return
    check_cp_seq_len(t.seq_len, cp, dims.tp)
    if p.cp_scheme == "alltoall" and (args.n_heads // dims.tp) % cp:
        raise ConfigError(f"parallelism.cp_scheme = 'alltoall' needs the attention heads per rank "
                          f"(model n_heads {args.n_heads} / tp {dims.tp}) divisible by parallelism.cp = {cp}; "
                          "use cp_scheme = 'ring' or another cp")


def shard_batch(inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict, cp: int, rank: int
                ) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """This CP rank's part of a micro-batch: tokens, labels, the RoPE positions (0, 1, ... of the whole
    sequence when the batch has none) and the visibility pair of the local keys."""
    kwargs = dict(model_kwargs)
    positions = kwargs.get("positions")
    if positions is None:
        positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    kwargs["positions"] = shard_sequence(positions, cp, rank)
    if "visibility" in kwargs:
        kwargs["visibility"] = tuple(shard_sequence(x, cp, rank) for x in kwargs["visibility"])
    return shard_sequence(inputs, cp, rank), shard_sequence(labels, cp, rank), kwargs


def token_share(labels: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """This rank's scored labels (>= 0) over the CP ranks' mean (float64): a rank's mean loss times it, averaged over
    the CP ranks, is the whole sequence's mean (ranks may score different counts: trees, chat prompts)."""
    n = (labels >= 0).sum().to(torch.float64)
    total = n.clone()
    dist.all_reduce(total, group=group)
    return n * dist.get_world_size(group) / total.clamp(min=1)


# ---- ring ----------------------------------------------------------------------------------------------


class _Ring:
    """Point-to-point hops to the next CP rank (and from the previous one)."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.size, rank = dist.get_world_size(group), dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (rank - 1) % self.size)

    def pass_on(self, tensor: torch.Tensor, tag: int) -> _Hop:
        received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, self.next, self.group, tag),
               dist.P2POp(dist.irecv, received, self.prev, self.group, tag)]
        return _Hop(dist.batch_isend_irecv(ops), tensor, received)


class _Hop:
    """A transfer in flight; it holds the sent tensor, which must live until the send completes."""

    def __init__(self, requests, sent: torch.Tensor, received: torch.Tensor):
        self.requests, self.sent, self.received = requests, sent, received

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        return self.received


_KV_TAG, _DKV_TAG = 1, 2


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, steps: Steps, scale: float | None, ring: _Ring):
        ctx.set_materialize_grads(False)
        b, h, t, d = q.shape
        acc = _accumulation_dtype(q.dtype)
        out = torch.zeros(b, h, t, d, dtype=acc, device=q.device)
        lse = torch.full((b, h, t), float("-inf"), dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        for s, blocks in enumerate(steps):
            hop = ring.pass_on(kv, _KV_TAG) if s < len(steps) - 1 else None
            for blk in blocks:
                out_i, lse_i = block_forward(q[:, :, blk.q_rows], kv[0][:, :, blk.k_rows], kv[1][:, :, blk.k_rows],
                                             blk.kind, blk.mask, scale)
                merged, merged_lse = merge(out[:, :, blk.q_rows], lse[:, :, blk.q_rows], out_i, lse_i.to(acc))
                out[:, :, blk.q_rows], lse[:, :, blk.q_rows] = merged, merged_lse
            if hop is not None:
                kv = hop.wait()
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.steps, ctx.scale, ctx.ring = steps, scale, ring
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        steps, scale, ring = ctx.steps, ctx.scale, ctx.ring
        if dout is None:
            dout = torch.zeros_like(out)
        acc = _accumulation_dtype(q.dtype)
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        kv = torch.stack((k, v))
        travelling = None  # the K/V gradient accumulated by the ranks before, for the K/V held now
        for s, blocks in enumerate(steps):
            hop = ring.pass_on(kv, _KV_TAG) if s < len(steps) - 1 else None
            dkv = torch.zeros(kv.shape, dtype=acc, device=q.device)
            for blk in blocks:
                rows = blk.q_rows
                dq_i, dk_i, dv_i = block_backward(
                    dout[:, :, rows], q[:, :, rows], kv[0][:, :, blk.k_rows], kv[1][:, :, blk.k_rows],
                    out[:, :, rows], lse[:, :, rows], blk.kind, blk.mask, scale,
                    None if dlse is None else dlse[:, :, rows])
                dq[:, :, rows] += dq_i
                dkv[0][:, :, blk.k_rows] += dk_i
                dkv[1][:, :, blk.k_rows] += dv_i
            if travelling is not None:
                dkv += travelling.wait()
            travelling = ring.pass_on(dkv, _DKV_TAG)  # after the last step: back to the K/V's owner
            if hop is not None:
                kv = hop.wait()
        own = travelling.wait()
        return dq.to(q.dtype), own[0].to(k.dtype), own[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, steps: Steps, scale: float | None,
                   ring: _Ring) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (batch, heads, local seq, head_dim), lse (batch, heads, local seq)) of the local queries over
    every CP rank's keys; the LSE is differentiable (attention Z-reg)."""
    return _RingAttention.apply(q, k, v, steps, scale, ring)


def causal_steps(local_len: int, cp: int, rank: int) -> Steps:
    """The blocks of each ring step under plain causal attention. At step s the rank holds the K/V of rank
    j = rank - s (mod cp), chunks (j, 2cp-1-j); its queries are chunks (rank, 2cp-1-rank). Its own K/V: causal
    over the concatenation (its order is the global one). j < rank: both query chunks see chunk j whole and
    not chunk 2cp-1-j. j > rank: only the query chunk 2cp-1-rank sees anything, both key chunks whole."""
    half = local_len // 2
    every, first, second = slice(0, local_len), slice(0, half), slice(half, local_len)
    steps: Steps = [[Block(every, every, "causal")]]
    for s in range(1, cp):
        j = (rank - s) % cp
        steps.append([Block(every, first, "full")] if j < rank else [Block(second, every, "full")])
    return steps


def _gather_visibility(visibility: tuple[torch.Tensor, torch.Tensor], group: dist.ProcessGroup) -> torch.Tensor:
    """Every CP rank's (start, limit) of its local keys: (cp, 2, batch, local seq)."""
    mine = torch.stack(visibility).contiguous()
    parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, mine, group=group)
    return torch.stack(parts)


def masked_steps(q_index: torch.Tensor, keys: torch.Tensor, rank: int) -> Steps:
    """The blocks of each ring step under a visibility mask: ``keys`` (cp, 2, batch, local seq) every rank's
    (start, limit), ``q_index`` the global indices of the local queries. On CPU a block no query sees is
    skipped and one every query sees runs unmasked; on CUDA each step's BlockMask skips the masked tiles."""
    cp = keys.shape[0]
    local = slice(0, q_index.numel())
    steps: Steps = []
    for s in range(cp):
        start, limit = keys[(rank - s) % cp]
        if q_index.is_cuda:
            steps.append([Block(local, local, "masked", _step_block_mask(q_index, start, limit))])
            continue
        q = q_index[None, :, None]
        visible = (start[:, None, :] <= q) & (q < limit[:, None, :])
        if not visible.any():
            steps.append([])
        elif visible.all():
            steps.append([Block(local, local, "full")])
        else:
            steps.append([Block(local, local, "masked", visible)])
    return steps


def _step_block_mask(q_index: torch.Tensor, start: torch.Tensor, limit: torch.Tensor):
    from torch.nn.attention.flex_attention import create_block_mask

    batch, keys = start.shape

    def mask_mod(b, h, q, k):
        row = b if batch > 1 else 0
        position = q_index[q]
        return (start[row, k] <= position) & (position < limit[row, k])

    return create_block_mask(mask_mod, batch, None, q_index.numel(), keys, device=start.device)


class RingMask(nn.Module):
    """The ring's mask: every step's blocks, built once per forward for all layers."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group, self.cp, self.rank = group, dist.get_world_size(group), dist.get_rank(group)

    def forward(self, visibility, seq_len: int, device: torch.device) -> Steps:
        if visibility is None:
            return causal_steps(seq_len, self.cp, self.rank)
        q_index = local_indices(seq_len * self.cp, self.cp, self.rank, device)
        return masked_steps(q_index, _gather_visibility(visibility, self.group), self.rank)


class RingCore(nn.Module):
    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.ring = _Ring(group)

    def forward(self, q, k, v, steps: Steps, need_lse: bool, scale: float | None):
        return ring_attention(q, k, v, steps, scale, self.ring)  # the LSE always (the ring merges by it)


# ---- all-to-all -----------------------------------------------------------------------------------------


def _seq_to_heads(x: torch.Tensor, group: dist.ProcessGroup, natural: torch.Tensor) -> torch.Tensor:
    """(batch, heads, local seq, d) -> (batch, heads / cp, seq, d): head group g goes to CP rank g, and the
    gathered chunks are put in natural order (``natural``: the argsort of ``layout_order``)."""
    cp = dist.get_world_size(group)
    b, h, t, d = x.shape
    send = x.reshape(b, cp, h // cp, t, d).transpose(0, 1).contiguous()
    got = all_to_all_single_autograd(send.flatten(), None, None, group).view(cp, b, h // cp, t, d)
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * t, d).index_select(2, natural)


def _heads_to_seq(x: torch.Tensor, group: dist.ProcessGroup, layout: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_seq_to_heads``: (batch, heads / cp, seq, d) -> (batch, heads, local seq, d)."""
    cp = dist.get_world_size(group)
    b, hl, t, d = x.shape
    send = x.index_select(2, layout).reshape(b, hl, cp, t // cp, d).permute(2, 0, 1, 3, 4).contiguous()
    got = all_to_all_single_autograd(send.flatten(), None, None, group).view(cp, b, hl, t // cp, d)
    return got.transpose(0, 1).reshape(b, cp * hl, t // cp, d)


class AllToAllMask(nn.Module):
    """The whole sequence's mask for the all-to-all scheme: None (causal) or ``build_mask`` of the gathered
    visibility pair in natural order."""

    def __init__(self, group: dist.ProcessGroup):
        super().__init__()
        self.group, self.cp = group, dist.get_world_size(group)

    def forward(self, visibility, seq_len: int, device: torch.device):
        if visibility is None:
            return None
        keys = _gather_visibility(visibility, self.group)  # (cp, 2, b, local): ranks in layout order
        natural = layout_order(seq_len * self.cp, self.cp, device).argsort()
        start, limit = keys.permute(1, 2, 0, 3).flatten(2).index_select(2, natural)
        return build_mask(start.contiguous(), limit.contiguous())


class AllToAllCore(nn.Module):
    def __init__(self, group: dist.ProcessGroup, kernel: str):
        super().__init__()
        self.group, self.cp, self.kernel = group, dist.get_world_size(group), kernel

    def _exchange(self, q, k, v):
        seq = q.shape[2] * self.cp
        layout = layout_order(seq, self.cp, q.device)
        natural = layout.argsort()
        repeat = self.cp // math.gcd(k.shape[1], self.cp)  # K/V heads up to a multiple of cp
        if repeat > 1:
            k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        return tuple(_seq_to_heads(x, self.group, natural) for x in (q, k, v)), layout

    def forward(self, q, k, v, mask, need_lse: bool, scale: float | None):
        (qh, kh, vh), layout = self._exchange(q, k, v)
        out, lse = attention(qh, kh, vh, mask, need_lse=need_lse, scale=scale, kernel=self.kernel)
        out = _heads_to_seq(out, self.group, layout)
        return out, None if lse is None else _heads_to_seq(lse[..., None], self.group, layout)[..., 0]

    def lse(self, q, k, v, mask, scale: float | None) -> torch.Tensor:
        with torch.no_grad():
            (qh, kh, vh), layout = self._exchange(q, k, v)
            return _heads_to_seq(attention_lse(qh, kh, vh, mask, scale)[..., None], self.group, layout)[..., 0]


def apply_cp(model: nn.Module, group: dist.ProcessGroup, scheme: str) -> None:
    """Swap the CP scheme's attention cores and mask builder into a (meta) Decoder."""
    for module in model.modules():
        if isinstance(module, Attention):
            module.core = RingCore(group) if scheme == "ring" else AllToAllCore(group, module.core.kernel)
        elif isinstance(module, Decoder):
            module.attention_mask = RingMask(group) if scheme == "ring" else AllToAllMask(group)
