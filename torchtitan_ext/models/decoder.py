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

from torchtitan_ext.models.args import ComputeOptions, ModelArgs
from torchtitan_ext.models.ffn import FeedForward
from torchtitan_ext.models.mode import MoDE
from torchtitan_ext.ops.attention import attention, attention_lse, build_mask
from torchtitan_ext.ops.kernels import add_rms_norm, qk_norm_rope
from torchtitan_ext.ops.visibility import causal_block_mask
from torchtitan_ext.ops.zreg import add_virtual_loss, attention_z_virtual

PLAIN = ComputeOptions()  # eager torch kernels, no regulariser, logits out
KV = tuple[torch.Tensor, torch.Tensor]  # a KV-sharing group's (k, v): normalised, rotated, (batch, seq, heads, hdim)


def rope_inv_freq(args: ModelArgs, device: torch.device | None = None) -> torch.Tensor:
    """The inverse frequencies (rope_dims / 2,) in float64, which ``rope_tables`` and ``rope_at`` share so that
    both give bit-identical angles. With ``rope_scaling = "llama3"`` a frequency whose wavelength fits fewer
    than ``rope_low_freq_factor`` times into the original context is divided by the factor, one fitting more
    than ``rope_high_freq_factor`` times is kept, and those between blend the two linearly in that ratio."""
    half = args.rope_dims // 2
    inv_freq = 1.0 / (args.rope_theta ** (torch.arange(half, device=device, dtype=torch.float64) / max(half, 1)))
    if args.rope_scaling == "llama3":
        fits = args.rope_original_max_seq_len * inv_freq / (2 * math.pi)  # wavelengths per original context
        lo, hi = args.rope_low_freq_factor, args.rope_high_freq_factor
        keep = ((fits - lo) / (hi - lo)).clamp(0.0, 1.0)
        inv_freq = keep * inv_freq + (1.0 - keep) * inv_freq / args.rope_scaling_factor
    return inv_freq


def rope_tables(args: ModelArgs, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape (max_seq_len, rope_dims / 2), float32."""
    inv_freq = rope_inv_freq(args, device)
    angles = torch.outer(torch.arange(args.max_seq_len, device=device, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def rope_at(args: ModelArgs, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (batch, seq, rope_dims / 2) at explicit positions (batch, seq); the same float64 angles
    as ``rope_tables``, so position p gives bit-identical values, and positions past max_seq_len work."""
    angles = positions.double()[..., None] * rope_inv_freq(args, positions.device)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``2 * cos.shape[-1]`` dims of x (batch, seq, heads, head_dim); the rest pass.
    cos/sin are (seq, rope_dims / 2) or (batch or 1, seq, rope_dims / 2)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    if cos.ndim == 2:
        cos, sin = cos[None], sin[None]
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class AttentionCore(nn.Module):
    """softmax(scale q k^T + mask) v of (batch, heads, seq, head_dim) tensors over this process's whole
    sequence (``ops.attention``). Context parallelism swaps in cores that attend over a sequence split
    across ranks (``parallel/context_parallel.py``)."""

    def __init__(self, kernel: str = "sdpa"):
        super().__init__()
        self.kernel = kernel  # the causal CUDA kernel (``ops.attention``)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask, need_lse: bool,
                scale: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        return attention(q, k, v, mask, need_lse=need_lse, scale=scale, kernel=self.kernel)

    def lse(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
            scale: float | None) -> torch.Tensor:
        """The LSE alone (the metric) under a dense CPU mask, where the kernel returns none; no autograd."""
        return attention_lse(q, k, v, mask, scale)


class AttentionMask(nn.Module):
    """The mask all attention cores of one forward take, built once per forward outside the blocks: None
    for plain causal attention, ``build_mask`` of a visibility pair, or, when attention needs a differentiable
    LSE (Z-reg) on CUDA, a causal BlockMask (FlexAttention returns it). Context parallelism swaps in builders
    of its own masks (``parallel/context_parallel.py``)."""

    def __init__(self, causal_flex: bool):
        super().__init__()
        self.causal_flex = causal_flex

    def forward(self, visibility: tuple[torch.Tensor, torch.Tensor] | None, seq_len: int, device: torch.device):
        if visibility is not None:
            return build_mask(*visibility)
        if self.causal_flex and device.type == "cuda":
            return causal_block_mask(seq_len, device)
        return None


class Attention(nn.Module):
    """GQA attention. With interleaved KV sharing a consumer layer (``computes_kv`` false) has no wk / wv /
    k_norm and attends over the K (normalised, rotated) and V of its group's first layer."""

    def __init__(self, args: ModelArgs, use_rope: bool, computes_kv: bool = True,
                 options: ComputeOptions = PLAIN):
        super().__init__()
        self.head_dim, self.use_rope, self.computes_kv = args.hdim, use_rope, computes_kv
        self.shares_kv = args.kv_share != "none"  # forward hands on (k, v) for the next layers of the group
        self.wq = nn.Linear(args.dim, args.n_heads * args.hdim, bias=False)
        self.wk = nn.Linear(args.dim, args.kv_heads * args.hdim, bias=False) if computes_kv else None
        self.wv = nn.Linear(args.dim, args.kv_heads * args.hdim, bias=False) if computes_kv else None
        self.wo = nn.Linear(args.n_heads * args.hdim, args.dim, bias=False)
        self.q_norm = nn.RMSNorm(args.hdim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = nn.RMSNorm(args.hdim, eps=args.norm_eps) if args.qk_norm and computes_kv else None
        self.z_reg = options.attention_z_reg
        self.virtual_grad_scale = 1.0  # the main loss's scaling (``Decoder.set_loss_scales``)
        self.record_lse = False  # a log step (``Decoder.record_attention_lse``): the dense CPU path records too
        self.n_heads_total, self.n_layers = args.n_heads, args.n_layers
        self.lse_mean: torch.Tensor | None = None
        self.fused_kernels = options.fused_norm  # training.kernels = "triton": QK-norm + RoPE in one kernel
        self.softmax_scale = args.attention_scale  # None: 1 / sqrt(head_dim); muP: 1 / head_dim
        self.core = AttentionCore(options.attention_kernel)

    def norm_and_rotate(self, q: torch.Tensor, k: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """QK-norm then RoPE on q and (unless shared) k, (batch, seq, heads, head_dim); cos/sin are already
        gathered for the positions, (1 or batch, seq, rope_dims / 2)."""
        if self.fused_kernels and self.q_norm is not None and self.use_rope:  # one Triton pass each
            return qk_norm_rope(q, self.q_norm, cos, sin), None if k is None else qk_norm_rope(k, self.k_norm, cos, sin)
        if self.q_norm is not None:
            q = self.q_norm(q)
            k = self.k_norm(k) if k is not None else None
        if self.use_rope:
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin) if k is not None else None
        return q, k

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask=None,
                kv: KV | None = None) -> tuple[torch.Tensor, KV | None]:
        """x (batch, seq, dim); ``rope`` (cos, sin) at the tokens' positions; ``mask`` None (causal) or from
        ``ops.attention.build_mask``; ``kv`` the group's shared (k, v), read by a consumer layer. Returns
        (out, kv): kv is the (k, v) the group's next layers attend over, None without KV sharing (so that
        no block hands on, and activation checkpointing keeps, K and V nobody reads)."""
        b, t, _ = x.shape
        cos, sin = (r[None, :t] if r.ndim == 2 else r[:, :t] for r in rope)  # tables (seq, d) or (b, seq, d)
        q = self.wq(x).view(b, t, -1, self.head_dim)
        if self.computes_kv:
            k, v = self.wk(x).view(b, t, -1, self.head_dim), self.wv(x).view(b, t, -1, self.head_dim)
            q, k = self.norm_and_rotate(q, k, cos, sin)
        else:
            (k, v), (q, _) = kv, self.norm_and_rotate(q, None, cos, sin)
        qh, kh, vh = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        want_lse = self.z_reg > 0 and torch.is_grad_enabled()
        out, lse = self.core(qh, kh, vh, mask, want_lse, self.softmax_scale)
        if want_lse:
            out = add_virtual_loss(out, attention_z_virtual(lse, self.z_reg, self.n_heads_total, self.n_layers),
                                   self.virtual_grad_scale)
        # The fused kernels return their LSE on every step, so its mean is taken on every step and the graph
        # does not depend on whether this is a log step; only a dense CPU mask needs a pass of its own.
        if lse is None and isinstance(mask, torch.Tensor) and self.record_lse:
            lse = self.core.lse(qh, kh, vh, mask, self.softmax_scale)
        if lse is not None:
            self.lse_mean = lse.detach().float().mean()
        return self.wo(out.transpose(1, 2).reshape(b, t, -1)), ((k, v) if self.shares_kv else None)


class Block(nn.Module):
    def __init__(self, args: ModelArgs, layer: int, options: ComputeOptions = PLAIN):
        super().__init__()
        self.attention_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Attention(args, args.uses_rope(layer), args.computes_kv(layer), options)
        self.ffn_norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        if args.is_moe(layer):
            self.feed_forward = MoDE(args, options.fused_activation)
        else:
            self.feed_forward = FeedForward(args.dim, args.ffn_hidden, args.activation, options.fused_activation)
        self.fused_kernels = options.fused_norm  # training.kernels = "triton": residual add + ffn_norm, one kernel
        # [attention, ffn] branch scales (1-D: initialised to one, no weight decay)
        self.residual_scale = nn.Parameter(torch.ones(2)) if args.residual_scalars else None

    def _scaled(self, i: int, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_scale is None else branch * self.residual_scale[i].to(branch.dtype)

    def attend(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask=None,
               kv: KV | None = None) -> tuple[torch.Tensor, torch.Tensor, KV | None]:
        """The block's first half: (h = x + attention(norm(x)), ffn_norm(h), the group's (k, v) or None)."""
        attn, kv = self.attention(self.attention_norm(x), rope, mask, kv)
        if self.fused_kernels and self.residual_scale is None:
            h, normed = add_rms_norm(x, attn, self.ffn_norm)
        else:
            h = x + self._scaled(0, attn)
            normed = self.ffn_norm(h)
        return h, normed, kv

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask=None,
                kv: KV | None = None) -> tuple[torch.Tensor, KV | None]:
        """(h, kv); ``mask`` and ``kv`` (in and out) as in ``Attention.forward``."""
        h, normed, kv = self.attend(x, rope, mask, kv)
        return h + self._scaled(1, self.feed_forward(normed)), kv


class Decoder(nn.Module):
    """Embedding -> blocks -> norm -> head. A pipeline stage is a Decoder whose missing parts are None."""

    def __init__(self, args: ModelArgs, options: ComputeOptions = PLAIN):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleDict({str(i): Block(args, i, options) for i in range(args.n_layers)})
        self.norm = nn.RMSNorm(args.dim, eps=args.norm_eps)
        self.output = None if args.tie_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)
        self.return_hidden = options.return_hidden
        self.attention_mask = AttentionMask(causal_flex=options.attention_z_reg > 0)
        self.input_sequence_shards = 1  # a later pipeline stage's slice of the sequence (set_input_sequence_shards)
        cos, sin = rope_tables(args, device=torch.device("meta"))
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)

    def set_loss_scales(self, aux: float, virtual: float) -> None:
        """This step's gradient weights of the losses that enter only the backward pass: ``aux`` for the MoDE
        balancing losses, ``virtual`` for attention Z-reg (each the main loss's scaling, 1 / micro-batches,
        and for ``aux`` also 1 / TP ranks, which each average over their own slice of the sequence)."""
        for module in self.modules():
            if isinstance(module, MoDE):
                module.aux_grad_scale = aux
            elif isinstance(module, Attention):
                module.virtual_grad_scale = virtual

    def set_input_sequence_shards(self, n: int) -> None:
        """A pipeline stage without the embedding under sequence parallelism takes 1/n of each sequence's
        hidden states; its attention sees the whole (gathered) sequence, and its causal mask must too."""
        self.input_sequence_shards = n

    def record_attention_lse(self, on: bool) -> None:
        """Record each attention's mean LSE in the coming forward pass (``Attention.lse_mean``)."""
        for module in self.modules():
            if isinstance(module, Attention):
                module.record_lse, module.lse_mean = on, None

    def init_buffers(self, device: torch.device) -> None:
        """Fill the buffers after ``to_empty``: RoPE tables, MoDE routing bias and load counters."""
        self.rope_cos, self.rope_sin = rope_tables(self.args, device)
        for module in self.modules():
            if isinstance(module, MoDE):
                module.reset_buffers()

    def forward(self, tokens: torch.Tensor, *, visibility: tuple[torch.Tensor, torch.Tensor] | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """tokens (batch, seq) -> one tensor (batch, seq, ·): the logits, or the head's input where the loss
        applies the head (``ComputeOptions.return_hidden``). A middle or last pipeline stage takes the hidden
        states instead of tokens, and a stage without the head returns them. ``visibility`` is a
        (start, limit) pair (``ops/visibility.py``; None: causal), ``positions`` (batch, seq) the RoPE
        positions (None: 0, 1, ...)."""
        if positions is None:  # each attention takes the rows of its (all-gathered, under TP) sequence
            rope = (self.rope_cos[None], self.rope_sin[None])
        else:
            rope = rope_at(self.args, positions)
        mask = self.attention_mask(visibility, tokens.shape[1] * self.input_sequence_shards, tokens.device)
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        kv = None  # each KV-sharing group's (k, v), from its first layer to the rest
        for layer in self.layers.values():
            h, kv = layer(h, rope, mask, kv)
        if self.norm is None:
            return h
        h = self.head_input(h)
        if self.return_hidden:  # the trainer's fused linear cross-entropy applies the head itself
            return h
        return self.head(h)

    def head_input(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm, times muP's output multiplier: the head is linear, so scaling its input scales the
        logits, on every path that applies it (this forward, the fused linear cross-entropy, generation)."""
        h = self.norm(h)
        return h if self.args.output_multiplier == 1.0 else h * self.args.output_multiplier

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """Logits of ``head_input``'s output: the head (or the tied embedding), then the soft-cap."""
        logits = self.output(h) if self.output is not None else F.linear(h, self.tok_embeddings.weight)
        if self.args.logit_softcap > 0:
            logits = self.args.logit_softcap * torch.tanh(logits / self.args.logit_softcap)
        return logits

    def init_plan(self) -> dict[str, tuple[str, float]]:
        """FQN -> (kind, std): norms to one; residual-branch outputs (wo, w2) scaled by 1/sqrt(2 L).

        Under muP the blocks' matrices (``is_hidden_matrix``) have their std divided by sqrt(width_mult)
        (variance proportional to 1 / fan-in), and the head keeps its std at the base width,
        mup_base_dim^-0.5, whatever the width: with the output multiplier its initial logits shrink like
        1 / sqrt(width_mult), so the learnt part dominates them. The embedding's std does not depend on width
        (its fan-in is the vocabulary). At the base width the weights equal the standard ones."""
        a = self.args
        hidden = a.width_mult ** -0.5
        plan = {}
        for name, p in self.named_parameters():
            if p.ndim == 1:
                plan[name] = ("ones", 0.0)
            elif name == "tok_embeddings.weight":
                plan[name] = ("normal", 0.02 if a.tie_embeddings else 1.0)
            elif name == "output.weight":
                plan[name] = ("normal", (a.dim / a.width_mult) ** -0.5)
            elif name.endswith(("wo.weight", "w2.weight", ".w2")):
                plan[name] = ("normal", 0.02 / math.sqrt(2 * a.n_layers) * hidden)
            else:
                plan[name] = ("normal", 0.02 * hidden if is_hidden_matrix(name, p.ndim) else 0.02)
        return plan


def is_hidden_matrix(fqn: str, ndim: int) -> bool:
    """muP's hidden weights, whose fan-in and fan-out both grow with width: every matrix (or stack of expert
    matrices) inside the blocks, router included (its fan-in grows). Their AdamW learning rate and init std
    scale with width; the embedding, head, norms and residual scalars are not hidden. ``fqn`` is clean
    (``parallel.compile.clean_fqn``), so the choice is the same under any parallel layout."""
    return ndim >= 2 and fqn.startswith("layers.")


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
