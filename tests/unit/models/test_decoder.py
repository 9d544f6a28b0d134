"""The decoder's pieces against float64 references, and the closed-form parameter counts."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder, apply_rope, fill_param_, rope_tables
from torchtitan_ext.models.flavors import FLAVORS
from torchtitan_ext.models.mode import MoDE
from torchtitan_ext.models.param_count import count_params
from torchtitan_ext.train.losses import cross_entropy_loss

TINY = ModelArgs(vocab_size=97, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)


def _build(args: ModelArgs, seed: int = 0) -> Decoder:
    model = Decoder(args)
    for name, p in model.named_parameters():
        kind, std = model.init_plan()[name]
        fill_param_(name, p.data, kind, std, seed)
    model.init_buffers(torch.device("cpu"))
    return model


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_param_count_matches_closed_form(flavor):
    args = FLAVORS[flavor]
    args = dataclasses.replace(args, vocab_size=args.vocab_size or 4096)
    with torch.device("meta"):
        model = Decoder(args)
    assert count_params(args)["total"] == sum(p.numel() for p in model.parameters())


def test_named_sizes():
    """The issue's shapes, and totals that match their names."""
    assert (FLAVORS["600m"].n_layers, FLAVORS["600m"].dim, FLAVORS["600m"].n_heads) == (24, 1024, 16)
    assert (FLAVORS["7b"].n_layers, FLAVORS["7b"].dim, FLAVORS["7b"].n_heads) == (32, 4096, 32)
    assert (FLAVORS["32b"].n_layers, FLAVORS["32b"].dim, FLAVORS["32b"].n_heads) == (64, 7168, 56)
    assert count_params(FLAVORS["llama3_8b"])["total"] == 8_030_261_248  # Meta's published figure
    assert 6.5e9 < count_params(FLAVORS["7b"])["total"] < 7e9
    assert 0.55e9 < count_params(FLAVORS["600m"])["total"] < 0.65e9


def test_rope_matches_complex_rotation_and_partial_leaves_the_rest():
    args = dataclasses.replace(TINY, rope_fraction=0.5)  # head_dim 8: rotate 4 dims
    cos, sin = rope_tables(args)
    x = torch.randn(2, 16, 3, 8, dtype=torch.float64)
    out = apply_rope(x, cos.double(), sin.double())
    half = args.rope_dims // 2
    pos = torch.arange(16, dtype=torch.float64)[:, None]
    freq = 1.0 / 10000 ** (torch.arange(half, dtype=torch.float64) / half)
    rot = torch.polar(torch.ones(16, half, dtype=torch.float64), pos * freq)[None, :, None, :]
    ref = torch.view_as_complex(torch.stack((x[..., :half], x[..., half:2 * half]), -1).contiguous()) * rot
    torch.testing.assert_close(out[..., :half], ref.real, atol=1e-6, rtol=0)
    torch.testing.assert_close(out[..., half:2 * half], ref.imag, atol=1e-6, rtol=0)
    assert torch.equal(out[..., 2 * half:], x[..., 2 * half:])


def test_nope_every_nth_layer():
    args = dataclasses.replace(TINY, n_layers=8, nope_every=4)
    model = Decoder(args)
    assert [b.attention.use_rope for b in model.layers.values()] == [True, True, True, False] * 2


def _reference_attention(attn, x: torch.Tensor, rope, kv=None):
    """(out, (k, v)) by explicit per-head softmax, each KV head shared by its group of query heads; ``kv`` the
    producer's (k, v) for a KV-sharing consumer."""
    b, t, _ = x.shape
    q = attn.wq(x).view(b, t, -1, attn.head_dim)
    if kv is None:
        k, v = attn.wk(x).view(b, t, -1, attn.head_dim), attn.wv(x).view(b, t, -1, attn.head_dim)
        k = attn.k_norm(k) if attn.k_norm is not None else k
        k = apply_rope(k, *rope)
    else:
        k, v = kv
    q = apply_rope(attn.q_norm(q) if attn.q_norm is not None else q, *rope)
    group = q.shape[2] // k.shape[2]
    heads = []
    for h in range(q.shape[2]):
        scores = q[:, :, h] @ k[:, :, h // group].transpose(1, 2) / math.sqrt(attn.head_dim)
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        heads.append(scores.softmax(-1) @ v[:, :, h // group])
    return attn.wo(torch.cat(heads, -1)), (k, v)


def test_attention_is_causal_and_matches_float64_reference():
    torch.manual_seed(0)
    args = dataclasses.replace(TINY, qk_norm=True, n_layers=1)
    model = _build(args).double()
    attn = model.layers["0"].attention
    x = torch.randn(2, 10, 32, dtype=torch.float64)
    rope = (model.rope_cos[:10].double(), model.rope_sin[:10].double())
    out, kv = attn(x, rope)
    assert kv is None  # without KV sharing no (k, v) is handed on
    torch.testing.assert_close(out, _reference_attention(attn, x, rope)[0], atol=1e-10, rtol=0)
    # Changing the future leaves the past untouched.
    x2 = x.clone()
    x2[:, 6:] += 1.0
    torch.testing.assert_close(attn(x2, rope)[0][:, :6], out[:, :6], atol=1e-12, rtol=0)


def test_kv_sharing_decoder_matches_float64_reference():
    """Interleaved KV sharing in groups of 2: layers 1 and 3 attend over the normalised, rotated K and the V of
    layers 0 and 2; each block returns (h, the group's (k, v)), a consumer the very (k, v) it was given."""
    args = dataclasses.replace(TINY, qk_norm=True, n_layers=4, kv_share="interleaved", kv_share_group=2)
    model = _build(args).double()
    tokens = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(1))
    rope = (model.rope_cos[:12].double(), model.rope_sin[:12].double())
    h, kv = model.tok_embeddings(tokens), None
    for i, block in enumerate(model.layers.values()):
        given = kv if i % 2 else None
        got_h, got_kv = block(h, rope, None, given)
        attn, kv = _reference_attention(block.attention, block.attention_norm(h), rope, given)
        h = h + attn
        h = h + block.feed_forward(block.ffn_norm(h))
        torch.testing.assert_close(got_h, h, atol=1e-10, rtol=0)
        torch.testing.assert_close(got_kv, kv, atol=1e-10, rtol=0)
        assert given is None or (got_kv[0] is given[0] and got_kv[1] is given[1])
    torch.testing.assert_close(model(tokens), model.head(model.head_input(h)), atol=1e-10, rtol=0)


def test_tied_softcapped_head():
    args = dataclasses.replace(TINY, tie_embeddings=True, logit_softcap=2.0)
    model = _build(args)
    assert model.output is None
    logits = model(torch.randint(0, 97, (2, 16)))
    assert logits.shape == (2, 16, 97) and logits.abs().max() < 2.0


def test_init_depends_on_seed_not_layout():
    """Any row slice filled on its own equals those rows of the whole tensor (FSDP shards are row slices)."""
    full = torch.empty(1000, 4500)  # rows span several generator blocks
    fill_param_("layers.0.attention.wq.weight", full, "normal", 0.02, seed=3)
    for lo, hi in [(0, 1), (250, 500), (333, 1000), (931, 932)]:
        part = torch.empty(hi - lo, 4500)
        fill_param_("layers.0.attention.wq.weight", part, "normal", 0.02, seed=3, rows=slice(lo, hi))
        assert torch.equal(part, full[lo:hi])
    assert full.std().item() == pytest.approx(0.02, rel=0.05) and full.abs().max() <= 0.06 + 1e-7
    other = torch.empty(1000, 4500)
    fill_param_("layers.0.attention.wq.weight", other, "normal", 0.02, seed=4)
    assert not torch.equal(other, full)


def test_z_loss_adds_squared_log_normaliser():
    logits = torch.randn(3, 5, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (3, 5))
    lse = torch.logsumexp(logits, -1)
    ce = (lse - logits.gather(-1, labels[..., None]).squeeze(-1)).mean()
    got = cross_entropy_loss(logits, labels, z_loss=1e-2)
    torch.testing.assert_close(got.double(), ce + 1e-2 * lse.square().mean(), atol=1e-6, rtol=0)


def test_mode_is_dropless_gate_weighted_sum_of_k_experts():
    torch.manual_seed(0)
    args = dataclasses.replace(TINY, n_experts=6, top_k=2, moe_hidden=24)
    layer = MoDE(args).double()
    for name, p in layer.named_parameters():
        fill_param_(name, p.data, "normal", 0.3, seed=1)
    layer.eval()
    x = torch.randn(5, 7, 32, dtype=torch.float64)
    out = layer(x).reshape(-1, 32)
    flat = x.reshape(-1, 32)
    probs = (flat @ layer.router.weight.t()).softmax(-1)
    gates, idx = probs.topk(2, dim=-1)
    gates = gates / gates.sum(-1, keepdim=True)
    e = layer.experts
    for t in range(flat.shape[0]):
        ref = sum(g * ((torch.nn.functional.silu(flat[t] @ e.w1[i].t()) * (flat[t] @ e.w3[i].t())) @ e.w2[i].t())
                  for g, i in zip(gates[t], idx[t], strict=True))
        torch.testing.assert_close(out[t], ref, atol=2e-6, rtol=0)  # the router runs in float32
    assert int(layer.load.sum()) == 0  # evaluation does not count expert load
    layer.train()
    with torch.no_grad():
        layer(x)
    assert int(layer.load.sum()) == 2 * flat.shape[0]  # every token reached k = 2 experts


def test_mode_active_parameters_by_hand():
    """The Zen sizes, counted by hand: per layer attention (q, k, v, o), the two QK-norm vectors, the two
    block norms, the router, and E SwiGLU experts of which k are active per token; plus embedding, head and
    final norm. The trainer prints these two numbers at start ("N parameters (M active per token ...)")."""
    def by_hand(layers, dim, heads, kv, hd, experts, k, hidden, vocab):
        shared = dim * heads * hd * 2 + dim * kv * hd * 2 + 2 * hd + 2 * dim + dim * experts
        expert = 3 * dim * hidden
        rest = 2 * vocab * dim + dim
        return layers * (shared + experts * expert) + rest, layers * (shared + k * expert) + rest

    assert by_hand(94, 7168, 56, 8, 128, 128, 2, 864, 151936) == (236_853_201_408, 16_798_124_544)
    assert by_hand(128, 8192, 64, 8, 128, 256, 2, 576, 151936) == (485_943_713_792, 25_711_124_480)
    for name, (total, active) in {"mode_235b": (236_853_201_408, 16_798_124_544),
                                  "mode_480b": (485_943_713_792, 25_711_124_480)}.items():
        counts = count_params(FLAVORS[name])
        assert (counts["total"], counts["active"]) == (total, active), name


@pytest.mark.parametrize("overrides", [{}, {"shared_expert": True, "moe_every": 2}, {"top_k": 3}])
def test_mode_active_count_matches_the_built_model(overrides):
    """Active = every parameter except the expert weights, plus k / E of those; from the meta-device model."""
    args = dataclasses.replace(FLAVORS["mode_debug"], vocab_size=512, **overrides)
    with torch.device("meta"):
        model = Decoder(args)
    routed = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    others = sum(p.numel() for n, p in model.named_parameters() if ".experts." not in n)
    assert routed % args.n_experts == 0
    counts = count_params(args)
    assert counts["total"] == routed + others
    assert counts["active"] == others + routed // args.n_experts * args.top_k
