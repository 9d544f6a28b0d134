"""Text generation with a KV cache: greedy, temperature and top-p sampling, batched prompts.

    python -m torchtitan_ext.generate --checkpoint outputs/debug --prompt "def main(" --max-new-tokens 64

The cached forward walks the Decoder's own modules (embedding, each block's norms, projections, QK-norm,
RoPE, FFN or MoDE, residual scalars, final norm, head, soft-cap; KV-sharing layers read their producer's
cache), so it computes what ``Decoder.forward`` computes with causal attention, one position at a time.
Prompts of different lengths are left-padded: each row has its own RoPE positions (counted from its first
real token) and its padding is masked out of attention.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch
import torch.nn.functional as F

from torchtitan_ext.models.decoder import Decoder


def _rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x (batch, seq, heads, head_dim) with per-row tables cos/sin (batch, seq, rope_dims / 2)."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class KVCache:
    """Keys and values of every layer for ``batch`` rows of up to ``max_len`` positions."""

    def __init__(self, model: Decoder, batch: int, max_len: int, pad: torch.Tensor):
        a = model.args
        dev, dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
        shape = (batch, max_len, a.kv_heads, a.hdim)
        self.k = [torch.zeros(shape, device=dev, dtype=dtype) for _ in model.layers]
        self.v = [torch.zeros(shape, device=dev, dtype=dtype) for _ in model.layers]
        self.pad = pad.to(dev)  # (batch,) left-padding of each row
        self.length = 0  # positions filled


def check_supported(model: Decoder) -> None:
    """Refuse, in one line, models the cached forward does not reproduce."""
    if getattr(model, "return_hidden", False):
        raise ValueError("generation: the model returns hidden states (fused linear cross-entropy is on)")


def _attention(attn, x: torch.Tensor, pos: torch.Tensor, cache: KVCache, layer: int, kv_layer: int,
               rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """One attention over the cache; a KV-sharing consumer (no wk / wv) reads layer ``kv_layer``'s entries."""
    b, t, _ = x.shape
    q = attn.wq(x).view(b, t, -1, attn.head_dim)
    computes_kv = getattr(attn, "wk", None) is not None
    k = attn.wk(x).view(b, t, -1, attn.head_dim) if computes_kv else None
    if attn.q_norm is not None:
        q = attn.q_norm(q)
        k = attn.k_norm(k) if computes_kv else None
    if attn.use_rope:
        p = pos.clamp(min=0)
        cos, sin = rope[0][p], rope[1][p]
        q = _rope_rows(q, cos, sin)
        k = _rope_rows(k, cos, sin) if computes_kv else None
    start = cache.length
    if computes_kv:
        cache.k[layer][:, start:start + t] = k
        cache.v[layer][:, start:start + t] = attn.wv(x).view(b, t, -1, attn.head_dim)
        kv_layer = layer
    # The whole cache every step (future slots masked): one shape per generation, so no attention kernel is
    # planned again for each new length.
    keys, values = cache.k[kv_layer], cache.v[kv_layer]
    q, keys, values = q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
    if keys.shape[1] != q.shape[1]:
        rep = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(rep, dim=1), values.repeat_interleave(rep, dim=1)
    kidx = torch.arange(keys.shape[2], device=x.device)
    qidx = torch.arange(start, start + t, device=x.device)
    causal = kidx[None, :] <= qidx[:, None]  # (t, keys)
    real = kidx[None, :] >= cache.pad[:, None]  # (batch, keys): padding is never attended to
    mask = causal[None] & real[:, None, :]
    # A padding query would attend to nothing (NaN); let it see itself, its output is never used.
    mask = mask | (kidx[None, None, :] == qidx[None, :, None])
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None])
    return attn.wo(out.transpose(1, 2).reshape(b, t, -1))


@torch.no_grad()
def forward_cached(model: Decoder, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (batch, t, vocab) of ``tokens`` (batch, t) placed after the ``cache.length`` cached ones."""
    t = tokens.shape[1]
    idx = torch.arange(cache.length, cache.length + t, device=tokens.device)
    pos = idx[None, :] - cache.pad[:, None]
    rope = (model.rope_cos, model.rope_sin)
    h = model.tok_embeddings(tokens)
    kv_layer = 0  # the latest layer that computed K/V (KV-sharing consumers read it)
    for i, block in enumerate(model.layers.values()):
        scale = getattr(block, "residual_scale", None)
        attn = _attention(block.attention, block.attention_norm(h), pos, cache, i, kv_layer, rope)
        if getattr(block.attention, "wk", None) is not None:
            kv_layer = i
        h = h + (attn if scale is None else attn * scale[0].to(attn.dtype))
        ffn = block.feed_forward(block.ffn_norm(h))
        h = h + (ffn if scale is None else ffn * scale[1].to(ffn.dtype))
    cache.length += t
    h = model.norm(h)
    logits = model.output(h) if model.output is not None else F.linear(h, model.tok_embeddings.weight)
    if model.args.logit_softcap > 0:
        logits = model.args.logit_softcap * torch.tanh(logits / model.args.logit_softcap)
    return logits


def sample(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator | None) -> torch.Tensor:
    """Next ids (batch,) from last-position logits (batch, vocab): argmax at temperature 0, else a draw
    from the smallest set of most likely tokens whose probability reaches ``top_p``."""
    if temperature <= 0:
        return logits.argmax(dim=-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(dim=-1) - sorted_p >= top_p  # tokens after the nucleus is complete
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


@torch.no_grad()
def generate(model: Decoder, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, use_cache: bool = True, stop_id: int | None = None,
             pad_id: int = 0) -> list[list[int]]:
    """The new tokens of each prompt. ``use_cache=False`` recomputes ``Decoder.forward`` on each row's
    whole sequence at every step (the reference the cache must equal)."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("generation needs at least one non-empty prompt")
    longest = max(map(len, prompts))
    if longest + max_new_tokens > model.args.max_seq_len:
        raise ValueError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_seq_len {model.args.max_seq_len}")
    check_supported(model)
    device = model.tok_embeddings.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    out: list[list[int]] = [[] for _ in prompts]
    done = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    if use_cache:
        pad = torch.tensor([longest - len(p) for p in prompts])
        cache = KVCache(model, len(prompts), longest + max_new_tokens, pad)
        tokens = torch.tensor([[pad_id] * (longest - len(p)) + list(p) for p in prompts], device=device)
        logits = forward_cached(model, tokens, cache)[:, -1]
    seqs = [list(p) for p in prompts]
    for _ in range(max_new_tokens):
        if not use_cache:
            logits = torch.cat([model(torch.tensor([s], device=device))[:, -1] for s in seqs])
        nxt = sample(logits, temperature, top_p, gen)
        for i, tok in enumerate(nxt.tolist()):
            if not done[i]:
                out[i].append(tok)
                seqs[i].append(tok)
        if stop_id is not None:
            done |= nxt == stop_id
            if bool(done.all()):
                break
        if use_cache:
            logits = forward_cached(model, nxt[:, None], cache)[:, -1]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtitan_ext.generate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True, help="dump folder (latest checkpoint) or a step-N folder")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    args = p.parse_args(argv)
    if args.max_new_tokens < 1 or not 0 < args.top_p <= 1 or args.temperature < 0:
        print("error: expected --max-new-tokens >= 1, 0 < --top-p <= 1, --temperature >= 0", file=sys.stderr)
        return 2
    from torchtitan_ext.config.loader import ConfigError
    from torchtitan_ext.eval.load import load_trained

    device = "cuda" if args.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if args.device == "auto" else args.device)
    try:
        model, tok, _, ckpt = load_trained(args.checkpoint, device)
        prompts = [[int(i) for i in tok.encode(text)] for text in args.prompt]
        start = time.perf_counter()
        new = generate(model, prompts, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                       stop_id=getattr(tok, "eot_id", None))
    except (ConfigError, ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    elapsed = time.perf_counter() - start
    texts = [tok.decode(ids) for ids in new]
    if args.json:
        print(json.dumps({"checkpoint": str(ckpt), "completions": texts,
                          "tokens_per_sec": sum(map(len, new)) / elapsed}))
    else:
        for prompt, text in zip(args.prompt, texts, strict=True):
            print(prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
