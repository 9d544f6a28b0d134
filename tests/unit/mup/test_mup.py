"""muP (``model.parametrization = "mup"``): the coordinate check (the logits' RMS after 5 steps within 2x
across an 8x width range under muP, growing under the standard parametrization) and its command line; the
lr multipliers chosen by name; the 1 / head_dim attention scale on every attention path against float64;
the logit multiplier; generation's cached forward; and the trainer: FSDP2 and TP2 equal one process, and a
resumed run equals the uninterrupted one."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from trainer_utils import TEST_CACHE

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.generate.decoding import KVCache, forward_cached, generate
from torchtitan_ext.models.args import ComputeOptions, ModelArgs
from torchtitan_ext.models.decoder import PLAIN, Decoder
from torchtitan_ext.mup import run_coord_check
from torchtitan_ext.mup.coord_check.__main__ import main as coord_check_main
from torchtitan_ext.ops.attention import attention
from torchtitan_ext.ops.visibility import document_visibility, visibility_mask
from torchtitan_ext.train.optim import Optimizers, lr_scale

# A 2-layer model with 16-dim heads on the byte-tokenized built-in corpus; widths 64..512 (8x) around base 64.
CHECK = ["--model.flavor", "debug", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "4", "--model.head_dim", "16", "--model.ffn_hidden", "192",
         "--data.tokenizer", "byte", "--data.cache_dir", str(TEST_CACHE), "--training.seq_len", "64",
         "--training.local_batch_size", "4", "--optimizer.lr", "1e-2", "--optimizer.weight_decay", "0"]
WIDTHS = [64, 128, 256, 512]
STEPS = 5


@pytest.fixture(scope="module")
def checks():
    try:
        return {p: run_coord_check(parse_args([*CHECK, "--model.parametrization", p]), WIDTHS, STEPS)
                for p in ("mup", "standard")}
    finally:
        if dist.is_initialized():  # the check ran in this process, as a world of one
            dist.destroy_process_group()


def test_coordinate_check(checks):
    """Under muP every layer's RMS (the logits' included) after 5 steps varies by less than 2x over the 8x
    widths (about 1.1x here); under the standard parametrization the logits grow with width (about 2.8x from
    64 to 512) and the blocks' outputs blow up (over 100x)."""
    mup, standard = checks["mup"], checks["standard"]
    assert mup.names == standard.names == ["embedding", "layers.0", "layers.1", "logits"]
    assert all(len(mup.rms[w]) == STEPS + 1 for w in WIDTHS)
    for name in mup.names:
        assert mup.spread(name, STEPS) < 2.0, (name, mup.rms)
    logits = [standard.rms[w][STEPS]["logits"] for w in WIDTHS]
    assert logits == sorted(logits) and logits[-1] > 2 * logits[0], logits
    assert standard.spread("layers.1", STEPS) > 20
    # At initialisation muP's logits shrink with width (the head's std is its base width's, times base / dim).
    init = [mup.rms[w][0]["logits"] for w in WIDTHS]
    assert init == sorted(init, reverse=True)


def test_coord_check_cli(tmp_path, capsys):
    png = tmp_path / "check.png"
    code = coord_check_main([*CHECK, "--model.parametrization", "mup", "--widths", "128,64", "--steps", "1",
                             "--plot", str(png)])
    out = capsys.readouterr().out
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    table = out[out.index("coordinate check"):].splitlines()
    assert table[1].split() == ["width", "step", "embedding", "layers.0", "layers.1", "logits"]
    assert [row.split()[:2] for row in table[2:7]] == [["64", "0"], ["64", "1"], ["128", "0"], ["128", "1"],
                                                       ["spread", "1"]]
    for argv, why in ((["--widths", "64,100"], "width 100: expected a multiple of the model's head_dim 16"),
                      (["--widths", "64"], "expected at least two different positive widths"),
                      (["--steps", "0"], "--steps 0: expected >= 1")):
        assert coord_check_main([*CHECK, *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and why in err[0], err


def _args(**kw) -> ModelArgs:
    """A small model at 4x its muP base width (64 over 16), its 4 heads' head_dim grown with it (4 -> 16)."""
    return ModelArgs(**{**dict(vocab_size=97, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96,
                               max_seq_len=48, rope_theta=500.0, parametrization="mup", mup_base_dim=16,
                               mup_base_head_dim=4), **kw})


def _random_model(args: ModelArgs, options: ComputeOptions = PLAIN, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(args, options)
    model.init_buffers(torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2) if p.ndim > 1 else p.uniform_(0.5, 1.5)
    return model.eval()


@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_lr_multipliers_by_name(optimizer):
    """AdamW: the blocks' matrices (attention, FFN, experts, router) at lr x base / dim = lr / 4; the embedding,
    head, norms and residual scalars at lr. Muon's matrices at lr / sqrt(4); its router stays on AdamW.
    Weight decay as in the standard parametrization. The standard parametrization keeps its two groups."""
    args = _args(n_experts=4, moe_every=2, moe_hidden=32, shared_expert=True, qk_norm=True, residual_scalars=True)
    model = Decoder(args)
    cfg = parse_args(["--optimizer.name", optimizer]).optimizer
    opts = Optimizers([model], cfg, args)
    opts.set_lr(1e-3)
    groups = {id(p): g for o in opts.optimizers for g in o.param_groups for p in g["params"]}
    muon = 0.5 if optimizer == "muon" else 0.25
    want = {"tok_embeddings.weight": (1.0, 0.0), "output.weight": (1.0, 0.1), "norm.weight": (1.0, 0.0),
            "layers.0.attention.wq.weight": (muon, 0.1), "layers.0.attention.wo.weight": (muon, 0.1),
            "layers.0.attention.q_norm.weight": (1.0, 0.0), "layers.0.attention_norm.weight": (1.0, 0.0),
            "layers.0.residual_scale": (1.0, 0.0), "layers.0.feed_forward.w2.weight": (muon, 0.1),
            "layers.1.feed_forward.router.weight": (0.25, 0.1), "layers.1.feed_forward.experts.w1": (muon, 0.1),
            "layers.1.feed_forward.shared_expert.w3.weight": (muon, 0.1)}
    named = dict(model.named_parameters())
    for name, (scale, decay) in want.items():
        group = groups[id(named[name])]
        assert group["lr"] == pytest.approx(1e-3 * scale, rel=1e-12) and group["weight_decay"] == decay, name
    for name, p in named.items():  # every parameter follows the rule: blocks' matrices scaled, nothing else
        hidden = p.ndim >= 2 and name.startswith("layers.")
        scale = (muon if ".router." not in name else 0.25) if hidden else 1.0
        assert groups[id(p)]["lr"] == pytest.approx(1e-3 * scale, rel=1e-12), name
    standard = dataclasses.replace(args, parametrization="standard")
    plain = Optimizers([Decoder(standard)], cfg, standard)
    plain.set_lr(1e-3)
    assert [g["weight_decay"] for g in plain.optimizers[0].param_groups] == [0.1, 0.0]
    assert {g["lr"] for o in plain.optimizers for g in o.param_groups} == {1e-3}


def test_bad_parametrization_is_one_line():
    with pytest.raises(ConfigError, match="model.parametrization"):
        parse_args(["--model.parametrization", "ntk"])
    with pytest.raises(ValueError, match="^parametrization = 'ntk'"):
        _args(parametrization="ntk").validate()
    assert _args(mup_base_dim=0).width_mult == 1.0 and _args(parametrization="standard").width_mult == 1.0
    assert _args().width_mult == 4.0 and _args().output_multiplier == 0.25 and _args().attention_scale == 2 / 16
    with pytest.raises(ValueError, match="^mup_base_head_dim = -1"):
        _args(mup_base_head_dim=-1).validate()
    with pytest.raises(ConfigError, match="model.mup_base_head_dim"):
        parse_args(["--model.mup_base_head_dim", "-2"])


def test_mup_at_its_base_width_is_the_standard_model():
    """At the base width (and the base head_dim, the default) muP changes nothing: the same initial weights,
    the same logits in float64 (the attention multiplier sqrt(base head_dim) makes its sqrt(hd) / hd the
    standard 1 / sqrt(hd)) and learning-rate multipliers of one. Above the base, head_dim fixed (more heads),
    the attention scale stays the standard one; with head_dim grown 4x it is half of it (1 / head_dim)."""
    base = _args(dim=16, n_heads=1, n_kv_heads=1, ffn_hidden=24, mup_base_head_dim=0, qk_norm=True)
    assert base.attention_scale == pytest.approx(16 ** -0.5) and base.width_mult == 1.0
    standard = dataclasses.replace(base, parametrization="standard")
    assert Decoder(base, PLAIN).init_plan() == Decoder(standard, PLAIN).init_plan()
    mup, std = (_random_model(a).double() for a in (base, standard))
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(mup(tokens), std(tokens), rtol=1e-12, atol=1e-12)
    for muon in (False, True):
        assert {lr_scale(base, name, p, muon) for name, p in mup.named_parameters()} == {1.0}
    wide_heads = _args(dim=64, n_heads=16, n_kv_heads=4, mup_base_head_dim=0)  # head_dim 4 at every width
    assert wide_heads.attention_scale == pytest.approx(4 ** -0.5)
    assert _args().attention_scale == pytest.approx(0.5 * 16 ** -0.5)


@pytest.mark.parametrize("scale", [None, 1 / 16], ids=["standard", "mup"])
@pytest.mark.parametrize("masked", [False, True], ids=["causal", "mask"])
@pytest.mark.parametrize("need_lse", [False, True], ids=["sdpa", "lse"])
def test_attention_core_scale_against_float64(scale, masked, need_lse):
    """Every CPU path of the attention core (the fused causal kernel, SDPA masked, the dense path with the LSE)
    applies the scale: out and LSE equal softmax(scale q k^T + mask) v computed directly in float64 (GQA: 4 over 2)."""
    g = torch.Generator().manual_seed(0)
    b, h, hk, t, d = 2, 4, 2, 12, 16
    q = torch.randn(b, h, t, d, generator=g, dtype=torch.float64) * 2
    k = torch.randn(b, hk, t, d, generator=g, dtype=torch.float64) * 2
    v = torch.randn(b, hk, t, d, generator=g, dtype=torch.float64)
    start, limit = (x.expand(b, t) for x in document_visibility([5, 7]))
    mask = visibility_mask(start, limit) if masked else None
    out, lse = attention(q, k, v, mask, need_lse=need_lse, scale=scale)
    allowed = mask if masked else torch.ones(t, t, dtype=torch.bool).tril()[None].expand(b, t, t)
    scores = q @ k.repeat_interleave(h // hk, dim=1).transpose(-1, -2) * (d ** -0.5 if scale is None else scale)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    torch.testing.assert_close(out, scores.softmax(-1) @ v.repeat_interleave(h // hk, dim=1))
    if need_lse or not masked:  # the fused causal kernel returns its LSE too (not differentiable)
        torch.testing.assert_close(lse, scores.logsumexp(-1))
    else:
        assert lse is None


@pytest.mark.parametrize("qk_norm, tie", [(False, False), (True, True)])
def test_mup_decoder_equals_standard_with_folded_scales(qk_norm, tie):
    """A muP model equals a standard one whose weights absorb muP's two multipliers: the queries' (wq, or the
    QK-norm weight) times sqrt(base head_dim / head_dim), the final norm's times base / dim (the head is linear,
    tied or not). It holds on every attention path Decoder.forward takes on CPU (causal SDPA, a visibility
    mask, the LSE metric, attention Z-reg's differentiable LSE), so each applies the scale."""
    args = _args(qk_norm=qk_norm, tie_embeddings=tie)
    mup = _random_model(args).double()
    folded = Decoder(dataclasses.replace(args, parametrization="standard"))
    folded.init_buffers(torch.device("cpu"))
    folded.load_state_dict(mup.state_dict())
    folded = folded.double().eval()
    tokens = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(1))
    assert not torch.allclose(mup(tokens), folded(tokens), rtol=1e-3)
    with torch.no_grad():
        for block in folded.layers.values():
            (block.attention.q_norm.weight if qk_norm else block.attention.wq.weight).mul_(
                (args.mup_base_head_dim / args.hdim) ** 0.5)
        folded.norm.weight.mul_(args.output_multiplier)
    torch.testing.assert_close(mup(tokens), folded(tokens))
    start, limit = (x.expand(2, 24) for x in document_visibility([10, 14]))
    torch.testing.assert_close(mup(tokens, visibility=(start, limit)), folded(tokens, visibility=(start, limit)))
    for model in (mup, folded):
        model.record_attention_lse(True)
        model(tokens)
    for a, b in zip(mup.layers.values(), folded.layers.values(), strict=True):
        torch.testing.assert_close(a.attention.lse_mean, b.attention.lse_mean)
    zreg = ComputeOptions(attention_z_reg=1e-3)
    with_zreg = [_random_model(m.args, zreg).double() for m in (mup, folded)]
    for model, source in zip(with_zreg, (mup, folded), strict=True):
        model.load_state_dict(source.state_dict())
    torch.testing.assert_close(with_zreg[0](tokens), with_zreg[1](tokens))  # grad on: the dense path with LSE


def test_generation_cache_equals_no_cache_under_mup():
    """The cached forward applies muP's attention scale and logit multiplier: its logits equal
    Decoder.forward's (prefill and per step), and greedy tokens equal the no-cache reference's."""
    model = _random_model(_args(qk_norm=True, rope_fraction=0.5, nope_every=2, logit_softcap=20.0,
                                tie_embeddings=True, n_layers=3))
    seq = torch.randint(0, 97, (2, 24), generator=torch.Generator().manual_seed(2))
    cache = KVCache(model, 2, 24, torch.zeros(2, dtype=torch.long))
    parts = [forward_cached(model, seq[:, :10], cache)] + [forward_cached(model, seq[:, i:i + 1], cache)
                                                           for i in range(10, 24)]
    torch.testing.assert_close(torch.cat(parts, dim=1), model(seq), rtol=1e-5, atol=1e-5)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11]]
    assert generate(model, prompts, 12) == generate(model, prompts, 12, use_cache=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("need_lse", [False, True])
def test_flex_attention_scale_on_gpu(need_lse):
    """FlexAttention (a visibility mask on CUDA, or the causal LSE) applies the scale too."""
    from torchtitan_ext.ops.attention import build_mask

    g = torch.Generator("cuda").manual_seed(0)
    b, h, hk, t, d = 2, 4, 2, 256, 64
    q, k, v = (torch.randn(b, n, t, d, generator=g, device="cuda") for n in (h, hk, hk))
    start, limit = (x.expand(b, t).contiguous().cuda() for x in document_visibility([100, 156]))
    ref_scores = (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2)) / d
    ref_scores = ref_scores.masked_fill(~visibility_mask(start, limit)[:, None], float("-inf"))
    ref = ref_scores.softmax(-1) @ v.double().repeat_interleave(2, dim=1)
    out, lse = attention(q, k, v, build_mask(start, limit), need_lse=need_lse, scale=1 / d)
    torch.testing.assert_close(out.double(), ref, rtol=2e-3, atol=2e-3)
    if need_lse:
        torch.testing.assert_close(lse.double(), ref_scores.logsumexp(-1), rtol=2e-3, atol=2e-3)
    causal, lse = attention(q, k, v, None, need_lse=True, scale=1 / d)  # FlexAttention's causal BlockMask
    causal_scores = (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2) / d).masked_fill(
        ~torch.ones(t, t, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    torch.testing.assert_close(lse.double(), causal_scores.logsumexp(-1), rtol=2e-3, atol=2e-3)
