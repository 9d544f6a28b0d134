"""Document masking, attention / output Z-regularisation and interleaved KV sharing: against references
(one document alone, float64 autograd of the virtual loss, closed-form parameter counts) and, in real
gloo processes, every layout against one process."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F
from data_builders import write_trees

from torchtitan_ext.data.documents import document_batch
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Attention, Decoder, apply_rope, rope_tables
from torchtitan_ext.models.param_count import count_params
from torchtitan_ext.ops.visibility import visibility_mask

EOT = 1
ARGS = ModelArgs(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=64,
                 qk_norm=True, rope_fraction=0.5)


def _model(args: ModelArgs = ARGS, seed: int = 0) -> Decoder:
    torch.manual_seed(seed)
    model = Decoder(args).double()
    model.init_buffers(torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():  # random norms too, so QK-norm weights matter
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 1.0))
    return model


def _doc(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 50, (n - 1,), generator=g).tolist() + [EOT]


@pytest.mark.parametrize("kv_share", ["none", "interleaved"])
def test_packed_documents_equal_documents_alone(kv_share):
    args = dataclasses.replace(ARGS, kv_share=kv_share, n_layers=4)
    model = _model(args)
    docs = [_doc(1, 9), _doc(2, 14), _doc(3, 9)]
    packed = torch.tensor([sum(docs, [])])
    labels = torch.roll(packed, -1, 1)
    vis, pos = document_batch(packed, EOT)
    logits = model(packed, visibility=vis, positions=pos)
    other = [docs[0], _doc(4, 14), docs[2]]  # another middle document: the outer two must not notice
    logits_other = model(torch.tensor([sum(other, [])]), visibility=vis, positions=pos)
    at = 0
    for i, d in enumerate(docs):
        alone = model(torch.tensor([d]))
        part = logits[:, at:at + len(d)]
        torch.testing.assert_close(part, alone, atol=1e-10, rtol=1e-10)
        if i != 1:
            torch.testing.assert_close(logits_other[:, at:at + len(d)], part, atol=0, rtol=0)
        # per-token loss: the last token's label crosses into the next document, so compare the rest
        ce = F.cross_entropy(part[0, :-1], labels[0, at:at + len(d) - 1], reduction="none")
        ce_alone = F.cross_entropy(alone[0, :-1], torch.tensor(d[1:]), reduction="none")
        torch.testing.assert_close(ce, ce_alone, atol=1e-10, rtol=1e-10)
        at += len(d)
    # without the mask the documents do see each other
    assert not torch.allclose(model(packed)[:, 9:23], model(torch.tensor([docs[1]])))


def test_document_batch_cut_documents_continue():
    inputs = torch.tensor([[5, 6, EOT, 7, 8, EOT, 9], [EOT, 3, 4, 5, EOT, 6, 7]])
    (start, limit), pos = document_batch(inputs, EOT, offsets=torch.tensor([10, 4]))
    assert start.tolist() == [list(range(7))] * 2
    assert limit.tolist() == [[3, 3, 3, 6, 6, 6, 7], [1, 5, 5, 5, 5, 7, 7]]
    assert pos.tolist() == [[10, 11, 12, 0, 1, 2, 0], [4, 0, 1, 2, 3, 0, 1]]
    m = visibility_mask(start, limit)[0]
    assert m[4].tolist() == [False, False, False, True, True, False, False]


def test_loader_continues_positions_of_cut_documents():
    """The loader's windows: a document cut by the window start keeps counting its positions."""
    import numpy as np

    from torchtitan_ext.data.documents import Documents

    shard = np.array([5, 6, 7, EOT, 8, 9, 9, 9, 9, EOT, 4], dtype=np.int32)
    docs = Documents(EOT, position_reset=True)
    inputs = torch.from_numpy(np.stack([shard[6:10], shard[2:6]]).astype(np.int64))
    (_, limit), pos = docs.batch(inputs, [shard], [(0, 6), (0, 2)])
    assert pos.tolist() == [[2, 3, 4, 5], [2, 3, 0, 1]] and limit.tolist() == [[4, 4, 4, 4], [2, 2, 4, 4]]
    assert Documents(EOT, position_reset=False).batch(inputs, [shard], [(0, 6), (0, 2)])[1] is None


def _ref_attention_lse(attn: Attention, x: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Textbook float64 attention of one layer (heads repeated for GQA): (output before wo, lse)."""
    b, t, _ = x.shape
    hd = attn.head_dim
    q, k, v = attn.wq(x).view(b, t, -1, hd), attn.wk(x).view(b, t, -1, hd), attn.wv(x).view(b, t, -1, hd)
    q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = rope_tables(ARGS)
    q, k = apply_rope(q, cos[:t].double(), sin[:t].double()), apply_rope(k, cos[:t].double(), sin[:t].double())
    rep = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.repeat_interleave(rep, 2).transpose(1, 2), \
        v.repeat_interleave(rep, 2).transpose(1, 2)
    s = (q @ k.transpose(-1, -2) / math.sqrt(hd)).masked_fill(~mask[:, None], float("-inf"))
    lse = torch.logsumexp(s, -1)
    return (torch.softmax(s, -1) @ v).transpose(1, 2).reshape(b, t, -1), lse


@pytest.mark.parametrize("masked", [False, True])
def test_attention_zreg_gradient_one_layer(masked):
    torch.manual_seed(0)
    attn = Attention(ARGS, use_rope=True).double()
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn_like(p) * 0.5)
    b, t, coef = 2, 12, 0.3
    x = torch.randn(b, t, ARGS.dim, dtype=torch.float64)
    w = torch.randn(b, t, ARGS.dim, dtype=torch.float64)
    vis, _ = document_batch(torch.tensor([[3, 4, EOT, 5, 6, 7, EOT, 8, 9, 3, 4, 5]] * b), EOT)
    mask = visibility_mask(*vis) if masked else torch.ones(t, t, dtype=torch.bool).tril()[None].expand(b, t, t)
    cos, sin = rope_tables(ARGS)
    rope = (cos[:t][None].double(), sin[:t][None].double())
    attn.z_reg, attn.virtual_grad_scale = coef, 1.0
    out, _ = attn(x, rope, mask if masked else None)
    (out * w).sum().backward()
    got = {n: p.grad.clone() for n, p in attn.named_parameters()}
    attn.zero_grad()
    attn.z_reg = 0.0
    ref, lse = _ref_attention_lse(attn, x, mask)
    virtual = coef * lse.pow(2).sum() / (ARGS.n_heads * ARGS.n_layers * b * t)
    assert virtual.item() > 1e-3  # the regulariser is not negligible here
    ((attn.wo(ref) * w).sum() + virtual).backward()
    for n, p in attn.named_parameters():
        torch.testing.assert_close(got[n], p.grad, atol=1e-10, rtol=1e-9)


def test_attention_zreg_gradient_whole_model():
    """The whole model, float64: gradients with Z-reg equal autograd of CE + sum of the layers' virtual
    losses, each layer's LSE recomputed by the textbook reference from that layer's input."""
    model, coef = _model(), 0.2
    tokens = torch.randint(2, 50, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.roll(tokens, -1, 1)
    b, t = tokens.shape
    vis, pos = document_batch(tokens.masked_fill(torch.arange(t) % 7 == 6, EOT), EOT)
    mask = visibility_mask(*vis)
    for m in model.modules():
        if isinstance(m, Attention):
            m.z_reg = coef
    model.set_loss_scales(aux=0.5, virtual=0.5)  # as with two micro-batches: the main loss is divided by 2 too
    (F.cross_entropy(model(tokens, visibility=vis).flatten(0, 1), labels.flatten()) * 0.5).backward()
    got = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    virtual = []
    hooks = []
    for m in model.modules():
        if isinstance(m, Attention):
            m.z_reg = 0.0
            hooks.append(m.register_forward_pre_hook(
                lambda mod, args: virtual.append(_ref_attention_lse(mod, args[0], mask)[1].pow(2).sum())))
    loss = F.cross_entropy(model(tokens, visibility=vis).flatten(0, 1), labels.flatten())
    total = loss + coef * sum(virtual) / (ARGS.n_heads * ARGS.n_layers * b * t)
    (total * 0.5).backward()
    for h in hooks:
        h.remove()
    assert (total - loss).item() > 1e-3  # the regulariser is not negligible here
    for n, p in model.named_parameters():  # random weights of scale 0.3: float64 rounding reaches ~1e-9
        torch.testing.assert_close(got[n], p.grad, atol=1e-8, rtol=1e-6, msg=n)


def test_output_zreg_gradient_and_value():
    from torchtitan_ext.ops.zreg import output_z_term

    logits = torch.randn(2, 5, 11, dtype=torch.float64, requires_grad=True)
    term = output_z_term(logits, 0.1)
    assert term.item() == 0.0
    term.backward()
    ref = logits.detach().clone().requires_grad_()
    (0.1 * torch.logsumexp(ref, -1).pow(2).mean()).backward()
    torch.testing.assert_close(logits.grad, ref.grad.to(logits.grad.dtype), atol=1e-6, rtol=1e-6)


def test_zreg_lowers_attention_lse():
    """200 steps of a tiny model on a fixed stream: Z-reg ends with a lower mean attention LSE."""
    args = dataclasses.replace(ARGS, n_layers=1, dim=32)
    data = torch.randint(2, 50, (8, 33), generator=torch.Generator().manual_seed(0))

    def train(coef: float) -> float:
        torch.manual_seed(0)
        model = Decoder(args)
        model.init_buffers(torch.device("cpu"))
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn_like(p) * (0.1 if p.ndim > 1 else 1.0))
        attn = model.layers["0"].attention
        attn.z_reg = coef
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        for _ in range(200):
            opt.zero_grad()
            F.cross_entropy(model(data[:, :-1]).flatten(0, 1), data[:, 1:].flatten()).backward()
            opt.step()
        attn.record_lse = True
        with torch.no_grad():
            model(data[:, :-1])
        return attn.lse_mean.item()

    plain, reg = train(0.0), train(1.0)
    assert reg < plain - 0.3, (plain, reg)


def test_kv_share_param_counts():
    for args in (dataclasses.replace(ARGS, kv_share="interleaved"),
                 dataclasses.replace(ARGS, kv_share="interleaved", n_layers=5, kv_share_group=3),
                 dataclasses.replace(ARGS, n_layers=3, qk_norm=False, kv_share="interleaved")):
        model = Decoder(args)
        assert sum(p.numel() for p in model.parameters()) == count_params(args)["total"]
        plain = dataclasses.replace(args, kv_share="none")
        hd, kv_layers = args.hdim, math.ceil(args.n_layers / args.kv_share_group)
        saved = (args.n_layers - kv_layers) * (2 * args.dim * args.kv_heads * hd + (hd if args.qk_norm else 0))
        assert count_params(plain)["total"] - count_params(args)["total"] == saved
        assert count_params(args)["kv_per_token"] == 2 * kv_layers * args.kv_heads * hd
        consumers = [m for m in model.modules() if isinstance(m, Attention) and not m.computes_kv]
        assert len(consumers) == args.n_layers - kv_layers and all(m.wk is None for m in consumers)


def test_tree_shards_and_windows(tmp_path):
    from torchtitan_ext.data.sources.trees import TreeDataLoader, prepare_trees
    from torchtitan_ext.data.tokenizers import ByteTokenizer

    write_trees(tmp_path / "t.jsonl", 30, 0)
    tok = ByteTokenizer()
    counts = prepare_trees([tmp_path / "t.jsonl"], tmp_path / "out", tok)
    assert counts["trees"] == 30
    loader = TreeDataLoader(sorted((tmp_path / "out").glob("*.bin")), 64, 2, 0, 1, 0, True, eot_id=tok.eot_id)
    batch = loader.next_batch()
    start, limit = batch.visibility
    m = visibility_mask(start, limit)
    for row in range(2):
        inputs, labels, pos = batch.inputs[row], batch.labels[row], batch.positions[row]
        for q in range(64):
            seen = m[row, q].nonzero().flatten().tolist()
            # Along a path, positions count the visible tokens before q, and the visible tokens read in
            # order are exactly q's root-to-node text (a token sees its ancestors, never a sibling).
            if inputs[q] != tok.eot_id or labels[q] != -100:
                assert pos[q] == len(seen) - 1
            if labels[q] != -100:  # a label continues the path: the next token sees everything q sees
                assert m[row, q + 1, seen].all() and labels[q] == inputs[q + 1]
    # Each node's text follows its parent's on the path the model sees.
    ids = batch.inputs[0].tolist()
    last = max(q for q in range(64) if batch.labels[0, q] != -100 or pos[q] > 0)
    text = bytes(ids[k] for k in m[0, last].nonzero().flatten().tolist() if ids[k] < 256).decode()
    assert all(c in "abcdefghijklmnopqrstuvwxyz " for c in text)


def test_home_paths_expand_for_trees_and_chat(tmp_path, monkeypatch):
    """``~`` in a glob reaches the files: ``prepare --trees --input`` and ``data.train_path`` of chat data."""
    from torchtitan_ext.data.prepare.__main__ import main as data_prepare
    from torchtitan_ext.data.sources.chat import _files

    monkeypatch.setenv("HOME", str(tmp_path))
    write_trees(tmp_path / "t.jsonl", 5, 0)
    assert data_prepare(["--trees", "--input", "~/t*.jsonl", "--output-dir", str(tmp_path / "out"),
                         "--tokenizer", "byte"]) == 0
    assert list((tmp_path / "out").glob("*.bin"))
    # Options tree mode would ignore are refused, not dropped: one line, exit 2, nothing written.
    assert data_prepare(["--trees", "--input", "~/t.jsonl", "--output-dir", str(tmp_path / "none"),
                         "--val-shards", "1"]) == 2
    assert not (tmp_path / "none").exists()
    (tmp_path / "chats").mkdir()
    (tmp_path / "chats" / "a.jsonl").write_text("")
    expected = [tmp_path / "chats" / "a.jsonl"]
    assert _files("~/chats/*.jsonl", "data.train_path") == expected == _files("~/chats", "data.train_path")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_causal_lse_matches_float64_logits(dtype):
    """The LSE metric's causal path: the fused kernel's own log-sum-exp (GQA, a custom scale) equals the
    float64 log-sum-exp of the causally masked logits, and its output equals the dense reference."""
    from torchtitan_ext.ops.attention import attention, dense_attention

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 37, 8, generator=g, dtype=dtype) for heads in (4, 2, 2))
    logits = (q.double() @ k.double().repeat_interleave(2, dim=1).transpose(-1, -2)) * 0.3
    causal = torch.ones(37, 37, dtype=torch.bool).tril()
    expected = torch.logsumexp(logits.masked_fill(~causal, float("-inf")), dim=-1)
    out, lse = attention(q, k, v, None, scale=0.3)
    tol = 1e-5 if dtype == torch.float32 else 1e-10
    torch.testing.assert_close(lse.double(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(out, dense_attention(q, k, v, None, 0.3)[0], rtol=tol, atol=tol)


def test_lse_metric_keeps_one_graph_whatever_the_length_or_log_step():
    """The compiled block's graph is the same size at 64 and 512 tokens, and a log step (record_lse) needs no
    recompilation: the LSE comes with the attention output."""
    sizes = []

    def counting_backend(gm, example_inputs):
        sizes.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Decoder(dataclasses.replace(ARGS, max_seq_len=512))
    model.init_buffers(torch.device("cpu"))
    block = model.layers["0"]
    compiled = torch.compile(block, backend=counting_backend, dynamic=False)
    rope = (model.rope_cos[None], model.rope_sin[None])
    for seq, record in ((64, False), (64, True), (512, False), (512, True)):
        block.attention.record_lse = record
        compiled(torch.randn(1, seq, ARGS.dim), rope)
        assert block.attention.lse_mean is not None
    assert len(sizes) == 2 and sizes[0] == sizes[1], sizes  # one graph per length, no log-step recompile
    torch._dynamo.reset()


def _stage_shards(rank: int, world: int) -> tuple[int, int]:
    from torch.distributed.device_mesh import init_device_mesh

    from torchtitan_ext.parallel.tp import apply_tp

    mesh = init_device_mesh("cpu", (world,))
    shards = []
    for first_stage in (True, False):
        with torch.device("meta"):
            model = Decoder(ARGS)
        if not first_stage:
            model.tok_embeddings = None  # a later pipeline stage (parallel.pp.split_stages)
        apply_tp(model, mesh, False)
        shards.append(model.input_sequence_shards)
    return tuple(shards)


def test_a_later_pipeline_stage_sizes_its_causal_mask_for_the_whole_sequence():
    """Under TP x PP a later stage takes its rank's slice of each sequence (local length seq / tp): its causal
    mask must be built for the whole sequence, which its attention sees after the all-gather (on 4 H200s the
    stage built a mask for half the length and FlexAttention refused it). The first stage takes tokens."""
    from dist_utils import run_distributed

    assert run_distributed(_stage_shards, 2) == [(1, 2), (1, 2)]


def test_math_backend_refused_where_its_scores_would_not_fit():
    """On CUDA the math backend materialises batch x heads x seq^2 float32 scores: refused above 1 GiB with one
    line naming the key and the size; allowed below it, and never refused on a CPU (which ignores the key)."""
    from torchtitan_ext.errors import ConfigError
    from torchtitan_ext.ops.attention_backend import check_math_backend

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    check_math_backend("math", cuda, 1, 16, 2048)  # 256 MiB
    check_math_backend("math", cpu, 1, 32, 65536)
    check_math_backend("cudnn", cuda, 1, 32, 65536)
    with pytest.raises(ConfigError, match=r"attention_backend = 'math' .* 512\.0 GiB per layer .* seq_len 65536"):
        check_math_backend("math", cuda, 1, 32, 65536)
