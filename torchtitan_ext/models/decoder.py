"""A Llama-style decoder in plain PyTorch, with no parallelism inside (parallel/ lays it out).

Blocks are pre-norm: ``h = x + attention(norm(x)); out = h + ffn(norm(h))``. Attention has GQA, RoPE on a
fraction of each head's dims (partial RoPE), no positional encoding on every Nth layer (RNoPE) and optional
QK-norm; the FFN is SwiGLU or squared ReLU, or a MoDE expert layer. The head may be tied to the embedding
and its logits soft-capped. Modules read head counts from their weights' shapes, so tensor parallelism
(which shards those weights) needs no change here.
"""

from __future__ import annotations

import math
import zlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.ffn import FeedForward
from torchtitan_ext.models.mode import MoDE


def rope_tables(args: ModelArgs, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, rope_dims / 2), float32."""
    half = args.rope_dims // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(half, device=device, dtype=torch.float64) / max(half, 1)))
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of x (batch, seq, heads, head_dim); the rest pass."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    cos, sin = cos[None, :, None, :].to(x.dtype), sin[None, :, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, use_rope: bool):
        super().__init__()
        self.head_dim, self.use_rope = args.hdim, use_rope
        self.wq = nn.Linear(args.dim, args.n_heads * args.hdim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.hdim, bias=False)
        self.wv = nn.Linear(args.dim, args.kv_heads * args.hdim, bias=False)
        self.wo = nn.Linear(args.n_heads * args.hdim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.hdim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.hdim, eps=args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x (batch, seq, dim); ``rope`` the (cos, sin) tables from position 0."""
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, self.head_dim)
        k = self.wk(x).view(b, t, -1, self.head_dim)
        v = self.wv(x).view(b, t, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            cos, sin = rope[0][:t], rope[1][:t]
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if k.shape[1] != q.shape[1]:  # GQA: each KV head serves n_heads / n_kv_heads query heads
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, args.uses_rope(layer))
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if args.is_moe(layer):
            self.feed_forward = MoDE(args)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden, args.activation)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), rope)
        return h + self.feed_forward(self.ffn_norm(h))


class Decoder(nn.Module):
    """Embedding -> blocks -> norm -> head. A pipeline stage is a Decoder whose missing parts are None."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args, i) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        cos, sin = rope_tables(args, device=torch.device("meta"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def init_buffers(self, device: torch.device) -> None:
        """Fill the buffers after ``to_empty``: RoPE tables, MoDE routing bias and load counters."""
        self.rope_cos, self.rope_sin = rope_tables(self.args, device)
        for module in self.modules():
            if isinstance(module, MoDE):
                module.reset_buffers()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens (batch, seq) -> logits (batch, seq, vocab); a middle or last pipeline stage takes the
        hidden states instead, and a stage without the head returns hidden states."""
        rope = (self.rope_cos, self.rope_sin)  # each attention takes the rows of its sequence length
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, rope)
        if self.norm is None:
            return h
        h = self.norm(h)
        logits = self.output(h) if self.output is not None else F.linear(h, self.tok_embeddings.weight)
        if self.args.logit_softcap > 0:
            logits = self.args.logit_softcap * torch.tanh(logits / self.args.logit_softcap)
        return logits

    def init_plan(self) -> dict[str, tuple[str, float]]:
        """FQN -> (kind, std): norms to one; residual-branch outputs (wo, w2) scaled by 1/sqrt(2 L)."""
        a = self.args
        plan = {}
        for name, p in self.named_parameters():
            if p.ndim == 1:
                plan[name] = ("ones", 0.0)
            elif name == "tok_embeddings.weight":
                plan[name] = ("normal", 0.02 if a.tie_embeddings else 1.0)
            elif name == "output.weight":
                plan[name] = ("normal", a.dim ** -0.5)
            elif name.endswith(("wo.weight", "w2.weight", ".w2")):
                plan[name] = ("normal", 0.02 / math.sqrt(2 * a.n_layers))
            else:
                plan[name] = ("normal", 0.02)
        return plan


_BLOCK_ELEMS = 1 << 22


@torch.no_grad()
def fill_param_(fqn: str, t: torch.Tensor, kind: str, std: float, seed: int, rows: slice | None = None) -> None:
    """Initialise ``t``, which holds ``rows`` (along dim 0) of the parameter ``fqn``.

    Rows are drawn in fixed blocks, each from a generator seeded by (seed, fqn, block), so any shard of a
    parameter gets the same numbers as the matching rows of the unsharded one: the weights depend on the
    seed only, never on the world size or layout. Normal draws are truncated at 3 standard deviations.
    """
    if kind == "ones":
        t.fill_(1.0)
        return
    if kind == "zeros":
        t.zero_()
        return
    start, stop = (0, t.shape[0]) if rows is None else (rows.start, rows.stop)
    rest = tuple(t.shape[1:])
    block_rows = max(1, _BLOCK_ELEMS // max(1, math.prod(rest)))
    name_hash = zlib.crc32(fqn.encode())
    for block in range(start // block_rows, -(-stop // block_rows)):
        gen = torch.Generator(device=t.device)
        gen.manual_seed((seed * 1_000_003 + name_hash * 65_537 + block) % (1 << 63))
        values = torch.randn((block_rows, *rest), generator=gen, device=t.device, dtype=torch.float32)
        values = values.clamp_(-3.0, 3.0).mul_(std)
        lo, hi = max(start, block * block_rows), min(stop, (block + 1) * block_rows)
        t[lo - start:hi - start].copy_(values[lo - block * block_rows:hi - block * block_rows])
