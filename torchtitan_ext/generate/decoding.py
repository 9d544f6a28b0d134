"""Text generation with a KV cache: greedy, temperature and top-p sampling, batched prompts (the command
line, ``tools/generate.py``, runs :func:`complete`).

The cached forward walks the Decoder's own modules (embedding, each block's norms, projections, QK-norm,
RoPE, attention scale, FFN or MoDE, residual scalars, final norm, muP's output multiplier, head, soft-cap;
KV-sharing layers read their producer's cache), so it computes what ``Decoder.forward`` computes with causal
attention, one position at a time. Prompts of different lengths are left-padded: each row has its own RoPE
positions (counted from its first real token) and its padding is masked out of attention.

Decoding one token per row through every layer is hundreds of small kernels with little arithmetic each, so
on a GPU it is bound by kernel launches, not by reading the weights. ``compile=True`` (the CLI's default on
CUDA) therefore runs each one-token step as one ``torch.compile`` graph, replayed as a CUDA graph on CUDA
("reduce-overhead"). For that the step has static shapes and addresses: the cache is preallocated (its
length rounded up to ``CACHE_SLOTS`` so nearby prompt lengths share one graph; each batch size and cache
length is compiled once per process), the next slot is a device tensor in the cache, and the masks are
computed from tensors. The loop never waits for the device: tokens stay there, and the host reads them
every ``STOP_CHECK_EVERY`` steps (to end once every row has met the stop id) and at the end. Compiled
kernels round where eager ones do but may sum in another order, so greedy tokens equal the eager path's
unless two logits are within rounding of each other (likelier in bf16).
"""

from __future__ import annotations

import functools
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F

from torchtitan_ext.errors import UserError
from torchtitan_ext.generate.options import check_sampling
from torchtitan_ext.models.decoder import Decoder

CACHE_SLOTS = 256  # cache lengths are a multiple of this (up to max_seq_len): fewer shapes to compile
STOP_CHECK_EVERY = 16  # decoding steps between host reads of "has every row met the stop id?"


class KVCache:
    """Keys and values (batch, kv_heads, max_len, head_dim) of every layer for ``batch`` rows; a KV-sharing
    consumer's entries are its producer's tensors. ``pad`` (batch,) is each row's left padding, ``pos`` (a
    0-d device tensor) the number of filled slots: a tensor, so a compiled step reads and advances it
    without being compiled again."""

    def __init__(self, model: Decoder, batch: int, max_len: int, pad: torch.Tensor):
        a = model.args
        dev, dtype = model.tok_embeddings.weight.device, model.tok_embeddings.weight.dtype
        shape = (batch, a.kv_heads, max_len, a.hdim)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []
        for block in model.layers.values():
            own = block.attention.computes_kv
            self.k.append(torch.zeros(shape, device=dev, dtype=dtype) if own else self.k[-1])
            self.v.append(torch.zeros(shape, device=dev, dtype=dtype) if own else self.v[-1])
        self.pad = pad.to(dev)
        self.pos = torch.zeros((), dtype=torch.long, device=dev)

    def fits(self, model: Decoder, batch: int, max_len: int) -> bool:
        """Whether this cache serves ``model`` (its dtype and device now) for ``batch`` rows of ``max_len`` slots."""
        k, w = self.k[0], model.tok_embeddings.weight
        shape = (batch, model.args.kv_heads, max_len, model.args.hdim)
        return k.shape == shape and k.dtype == w.dtype and k.device == w.device


# The last cache of each model that decoded compiled. A CUDA graph replays at the addresses it recorded, so
# a new cache at every call would have the graph recorded again; the cache is kept as long as its model.
_static_caches: weakref.WeakKeyDictionary[Decoder, KVCache] = weakref.WeakKeyDictionary()


def _static_cache(model: Decoder, batch: int, max_len: int, pad: torch.Tensor) -> KVCache:
    """The model's kept cache, emptied for ``pad``, or a new one (marked as a static input for CUDA graphs:
    the compiled step writes into it, and a graph may only mutate inputs whose address does not change)."""
    cache = _static_caches.get(model)
    if cache is not None and cache.fits(model, batch, max_len):
        cache.pad.copy_(pad)
        cache.pos.zero_()  # stale entries stay: the masks hide every slot not written by this call
        return cache
    cache = KVCache(model, batch, max_len, pad)
    for t in [*cache.k, *cache.v, cache.pad, cache.pos]:
        torch._dynamo.mark_static_address(t)
    _static_caches[model] = cache
    return cache


def _attention(attn, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor,
               cache: KVCache, layer: int, slots: torch.Tensor) -> torch.Tensor:
    """One attention over the whole cache, after writing this layer's keys and values into ``slots`` (a
    KV-sharing consumer has none: its cache entries are its producer's). ``mask`` is (batch, 1, group * t,
    max_len), as ``forward_cached`` folds it."""
    b, t, _ = x.shape
    q = attn.wq(x).view(b, t, -1, attn.head_dim)
    k = attn.wk(x).view(b, t, -1, attn.head_dim) if attn.computes_kv else None
    q, k = attn.norm_and_rotate(q, k, *rope)
    keys, values = cache.k[layer], cache.v[layer]
    if attn.computes_kv:
        keys.index_copy_(2, slots, k.transpose(1, 2))
        values.index_copy_(2, slots, attn.wv(x).view(b, t, -1, attn.head_dim).transpose(1, 2))
    # GQA without copying the cache: the `group` query heads of a KV head become group * t queries of it.
    q = q.transpose(1, 2).reshape(b, keys.shape[1], -1, attn.head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=attn.softmax_scale)
    return attn.wo(out.reshape(b, -1, t, attn.head_dim).transpose(1, 2).reshape(b, t, -1))


@torch.no_grad()
def forward_cached(model: Decoder, tokens: torch.Tensor, cache: KVCache) -> torch.Tensor:
    """Logits (batch, t, vocab) of ``tokens`` (batch, t) placed in the cache's next t slots (from
    ``cache.pos``, which it then advances). The whole cache is attended every step, its unwritten slots
    masked: one shape per cache, so a compiled step is traced once."""
    b, t = tokens.shape
    slots = cache.pos + torch.arange(t, device=tokens.device)  # (t,)
    pos = (slots[None, :] - cache.pad[:, None]).clamp(min=0)  # (batch, t) RoPE positions (padding: unused)
    rope = (model.rope_cos[pos], model.rope_sin[pos])
    kidx = torch.arange(cache.k[0].shape[2], device=tokens.device)
    seen = (kidx[None, :] <= slots[:, None])[None] & (kidx >= cache.pad[:, None])[:, None, :]  # (batch, t, keys)
    # A padding query would attend to nothing (NaN); let it see itself, its output is never used.
    seen = seen | (kidx[None, :] == slots[:, None])[None]
    group = model.args.n_heads // model.args.kv_heads  # query heads per KV head, folded as in `_attention`
    mask = seen[:, None, None].expand(b, 1, group, t, len(kidx)).reshape(b, 1, group * t, len(kidx))
    h = model.tok_embeddings(tokens)
    for layer, block in enumerate(model.layers.values()):
        h = h + block._scaled(0, _attention(block.attention, block.attention_norm(h), rope, mask, cache, layer,
                                            slots))
        h = h + block._scaled(1, block.feed_forward(block.ffn_norm(h)))
    cache.pos += t
    return model.head(model.head_input(h))


def _decode_step(model: Decoder, cache: KVCache, tokens: torch.Tensor) -> torch.Tensor:
    """Logits (batch, vocab) after one new token per row, ``tokens`` (batch,): the graph compile captures."""
    return forward_cached(model, tokens[:, None], cache)[:, -1]


@functools.cache
def _compiled_step(cuda: bool) -> Callable[[Decoder, KVCache, torch.Tensor], torch.Tensor]:
    """``_decode_step`` compiled for static shapes, with CUDA graphs on CUDA (``triton.cudagraphs``: what
    mode="reduce-overhead" sets, and a mode cannot be combined with options; CUDA graphs need CUDA). Graphs
    are kept per shape of the cache, so later calls of the same shape reuse them. ``emulate_precision_casts``
    rounds the fused kernels' intermediates to the model's dtype where eager rounds them, so bf16 greedy
    tokens follow the eager path's (without it they part on near-ties within a few dozen tokens). On CPU,
    MoDE's grouped GEMMs loop over groups whose sizes the host reads (``.tolist()``): captured as symbolic
    sizes they stay in the one graph, instead of a graph break and a recompilation for every new routing."""
    step = torch.compile(_decode_step, fullgraph=True, dynamic=False,
                         options={"triton.cudagraphs": cuda, "emulate_precision_casts": True})
    return step if cuda else torch._dynamo.config.patch(capture_scalar_outputs=True)(step)


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


def _until_stop(rows: list[list[int]], stop_id: int | None) -> list[list[int]]:
    """Each row up to and including its first ``stop_id``: a row that met it takes no more tokens."""
    return [row[:row.index(stop_id) + 1] if stop_id in row else row for row in rows]


@torch.no_grad()
def generate(model: Decoder, prompts: list[list[int]], max_new_tokens: int, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, use_cache: bool = True, stop_id: int | None = None,
             pad_id: int = 0, compile: bool = False) -> list[list[int]]:
    """The new tokens of each prompt, up to and including its first ``stop_id``. ``use_cache=False``
    recomputes ``Decoder.forward`` on each row's whole sequence at every step (the reference the cache must
    equal). ``compile=True`` compiles the one-token steps (see the module docstring); the prompt pass stays
    eager: it runs once per call, and compiled it would be compiled again for every prompt length."""
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("generation needs at least one non-empty prompt")
    if max_new_tokens < 1:
        raise UserError(f"max_new_tokens = {max_new_tokens}: expected >= 1")
    longest = max(map(len, prompts))
    if longest + max_new_tokens > model.args.max_seq_len:
        raise UserError(f"prompt ({longest} tokens) + max_new_tokens ({max_new_tokens}) exceeds the model's "
                         f"max_seq_len {model.args.max_seq_len}")
    if compile and not use_cache:
        raise UserError("generation: compile needs the KV cache (use_cache=True)")
    if getattr(model, "return_hidden", False):  # the cached forward computes logits
        raise UserError("generation: the model returns hidden states (fused linear cross-entropy is on)")
    device = model.tok_embeddings.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    batch = len(prompts)
    if use_cache:
        pad = torch.tensor([longest - len(p) for p in prompts])
        slots = min(model.args.max_seq_len, -(-(longest + max_new_tokens) // CACHE_SLOTS) * CACHE_SLOTS)
        cache = (_static_cache if compile else KVCache)(model, batch, slots, pad)
        tokens = torch.tensor([[pad_id] * (longest - len(p)) + list(p) for p in prompts], device=device)
        logits = forward_cached(model, tokens, cache)[:, -1]
        step = _compiled_step(device.type == "cuda") if compile else _decode_step
    else:
        rows = [torch.tensor(p, device=device) for p in prompts]
    new = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
    done = torch.zeros(batch, dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        if not use_cache:
            logits = torch.cat([model(torch.cat((row, new[r, :i]))[None])[:, -1] for r, row in enumerate(rows)])
        nxt = sample(logits, temperature, top_p, gen)
        new[:, i] = nxt
        if stop_id is not None:
            done |= nxt == stop_id
            if (i + 1) % STOP_CHECK_EVERY == 0 and bool(done.all()):  # the only host read in the loop
                break
        if use_cache and i + 1 < max_new_tokens:
            if compile:  # the last step's outputs have been read: its CUDA graph may run again
                torch.compiler.cudagraph_mark_step_begin()
            logits = step(model, cache, nxt)
    return _until_stop(new[:, :i + 1].tolist(), stop_id)


class Completions(NamedTuple):
    """What :func:`complete` returns; ``tokens_per_sec``: new tokens per second over the decoding."""
    checkpoint: Path
    texts: list[str]
    compiled: bool
    tokens_per_sec: float


def complete(checkpoint: str | Path, prompts: list[str], max_new_tokens: int = 64, temperature: float = 0.0,
             top_p: float = 1.0, seed: int = 0, device: str = "auto", compile: bool | None = None) -> Completions:
    """Load the model of a dump or ``step-N`` folder and continue each prompt. ``device`` "auto" is CUDA when
    available; ``compile`` None compiles on CUDA only. UserError (one line) for a bad checkpoint or request."""
    from torchtitan_ext.eval.load import load_trained

    check_sampling(max_new_tokens, temperature, top_p)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: this torch sees no CUDA device (a CPU build, or no GPU visible); use "
                        "--device cpu or auto")
    compiled = device == "cuda" if compile is None else compile
    model, tok, _, ckpt = load_trained(checkpoint, device)
    ids = [[int(i) for i in tok.encode(text)] for text in prompts]
    start = time.perf_counter()
    new = generate(model, ids, max_new_tokens, temperature, top_p, seed, stop_id=getattr(tok, "eot_id", None),
                   compile=compiled)
    elapsed = time.perf_counter() - start
    texts = [completion_text(tok, row, getattr(tok, "eot_id", None)) for row in new]
    return Completions(ckpt, texts, compiled, sum(map(len, new)) / elapsed)


def completion_text(tok, row: list[int], stop_id: int | None) -> str:
    """The text of one row of :func:`generate`. A row that the model ended (its last token ``stop_id``) stops
    cleanly there: the end-of-text token is not decoded (SentencePiece and Hugging Face tokenizers write it as a
    literal ``<|endoftext|>``) and the whitespace before it is dropped (a document ends with newlines, which
    printed as blank lines). A row cut by ``max_new_tokens`` is decoded as it is."""
    if stop_id is None or not row or row[-1] != stop_id:
        return tok.decode(row)
    return tok.decode(row[:-1]).rstrip()
