"""Visibility masks: the published examples, trees against an ancestor-set construction, and the attention
paths (dense, SDPA, FlexAttention forward) against a float64 reference."""

from __future__ import annotations

import random

import pytest
import torch

from torchtitan_ext.ops.attention import attention, dense_attention
from torchtitan_ext.ops.visibility import (
    document_visibility,
    prefix_visibility,
    tree_visibility,
    visibility_mask,
)


def _t(x):
    return torch.tensor([x])


def test_published_examples():
    s, lim = torch.arange(5)[None], torch.full((1, 5), 5)
    assert torch.equal(visibility_mask(s, lim)[0], torch.ones(5, 5, dtype=torch.bool).tril())  # 1: causal
    s, lim = document_visibility([3, 3])  # 2: two documents
    assert s.tolist() == [[0, 1, 2, 3, 4, 5]] and lim.tolist() == [[3, 3, 3, 6, 6, 6]]
    s, lim = tree_visibility([-1, 0, 0], [3, 3, 3])  # 3: A parent of B and C
    assert s.tolist() == [list(range(9))] and lim.tolist() == [[9, 9, 9, 6, 6, 6, 9, 9, 9]]
    s, lim = prefix_visibility(3, 6)  # 5: bidirectional prefix
    assert s.tolist() == [[0, 0, 0, 3, 4, 5]] and lim.tolist() == [[6] * 6]
    # The dense masks these pairs stand for, written out by hand.
    m = visibility_mask(*tree_visibility([-1, 0, 0], [3, 3, 3]))[0].int()
    expect = torch.zeros(9, 9, dtype=torch.int)
    for q in range(9):
        for k in range(q + 1):
            if not (3 <= k < 6 <= q):  # C's tokens never see B's
                expect[q, k] = 1
    assert torch.equal(m, expect)
    m = visibility_mask(*prefix_visibility(3, 6))[0].int()
    assert m[:3, :3].eq(1).all() and m[:3, 3:].eq(0).all() and torch.equal(m[3:, 3:], torch.ones(3, 3).tril().int())
    # 4: beam search with two empty paged slots: [A B C _ _ D' D'' D''']
    m = visibility_mask(_t([0, 1, 2, 8, 8, 5, 6, 7]), _t([8, 8, 8, 8, 8, 6, 7, 8]))[0].int()
    assert m[:, 3:5].eq(0).all()  # empty slots are never attended
    assert m[7].tolist() == [1, 1, 1, 0, 0, 0, 0, 1] and m[5].tolist() == [1, 1, 1, 0, 0, 1, 0, 0]
    assert m[2].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    m = visibility_mask(*document_visibility([3, 3]))[0].int()
    assert m[3:, :3].eq(0).all() and torch.equal(m[3:, 3:], torch.ones(3, 3).tril().int())


def _random_tree(rng: random.Random, n: int) -> list[int]:
    """Parents of a random tree in depth-first pre-order: each new node hangs off the current path."""
    parents, path = [], []
    for i in range(n):
        if path and rng.random() < 0.15:
            path = []  # a new root
        while path and rng.random() < 0.4:
            path.pop()
        parents.append(path[-1] if path else -1)
        path.append(i)
    return parents


@pytest.mark.parametrize("seed", range(20))
def test_tree_equals_ancestor_sets(seed):
    rng = random.Random(seed)
    n = rng.randint(1, 12)
    parents, lengths = _random_tree(rng, n), [rng.randint(0, 4) for _ in range(n)]
    node = [i for i in range(n) for _ in range(lengths[i])]
    ancestors = []
    for i in range(n):  # a node's ancestor set, itself included
        a, j = {i}, parents[i]
        while j >= 0:
            a.add(j)
            j = parents[j]
        ancestors.append(a)
    total = len(node)
    expect = torch.zeros(total, total, dtype=torch.bool)
    for q in range(total):
        for k in range(total):
            same = node[q] == node[k]
            expect[q, k] = (same and k <= q) or (not same and node[k] in ancestors[node[q]])
    assert torch.equal(visibility_mask(*tree_visibility(parents, lengths))[0], expect)


def test_bad_trees_are_refused():
    with pytest.raises(ValueError, match="parent"):
        tree_visibility([-1, 2, 0], [1, 1, 1])
    with pytest.raises(ValueError, match="lengths"):
        tree_visibility([-1], [1, 2])


def _reference(q, k, v, mask):
    """float64 attention with the GQA heads repeated (the plain textbook form)."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    s = s.masked_fill(~mask[:, None], float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def test_attention_paths_match_float64():
    torch.manual_seed(0)
    b, h, hk, t, d = 2, 4, 2, 24, 8
    q, k, v = (torch.randn(b, n, t, d) for n in (h, hk, hk))
    start, limit = tree_visibility([-1, 0, 1, 0, -1], [5, 4, 3, 6, 6])
    mask = visibility_mask(start.expand(b, t), limit.expand(b, t))
    ref, ref_lse = _reference(q, k, v, mask)
    out, lse = dense_attention(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)
    out, lse = attention(q, k, v, mask)  # masked SDPA (no LSE asked)
    assert lse is None
    torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None].expand(b, t, t)
    ref, ref_lse = _reference(q, k, v, causal)
    torch.testing.assert_close(attention(q, k, v, None)[0].double(), ref, atol=1e-5, rtol=1e-5)
    out, lse = attention(q, k, v, None, need_lse=True)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


def test_flex_forward_matches_float64():
    """FlexAttention's forward (which does run on CPU) with the BlockMask built from (start, limit)."""
    from torchtitan_ext.ops.visibility import flex_block_mask

    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(1)
    b, h, hk, t, d = 2, 4, 2, 256, 16
    q, k, v = (torch.randn(b, n, t, d) for n in (h, hk, hk))
    start = torch.stack([document_visibility([100, 56, 100])[0][0], prefix_visibility(40, t)[0][0]])
    limit = torch.stack([document_visibility([100, 56, 100])[1][0], prefix_visibility(40, t)[1][0]])
    block = flex_block_mask(start, limit)
    try:
        out, lse = flex.flex_attention(q, k, v, block_mask=block, enable_gqa=True, return_lse=True)
    except Exception as e:  # noqa: BLE001 - some torch builds refuse eager CPU FlexAttention
        pytest.skip(f"FlexAttention forward does not run on this CPU torch: {e}")
    ref, ref_lse = _reference(q, k, v, visibility_mask(start, limit))
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)


def test_flex_causal_mask_is_shared_by_every_batch_row():
    """The causal BlockMask is built once (batch 1) and broadcast over the batch, but FlexAttention calls its
    mask function with each row's own batch index: the function must not read a batch dimension it lacks.
    (Reading ``start[b, k]`` for b >= 1 went past the tensor: on CPU an index error, in the CUDA kernel a
    silent read of other memory, which gave compiled MoDE runs non-finite gradients.)"""
    from torchtitan_ext.ops.visibility import causal_block_mask

    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    torch.manual_seed(2)
    b, h, t, d = 3, 2, 256, 16
    q, k, v = (torch.randn(b, h, t, d) for _ in range(3))
    try:
        out, lse = flex.flex_attention(q, k, v, block_mask=causal_block_mask(t, q.device), return_lse=True)
    except NotImplementedError as e:  # some torch builds refuse eager CPU FlexAttention
        pytest.skip(f"FlexAttention forward does not run on this CPU torch: {e}")
    causal = torch.ones(t, t, dtype=torch.bool).tril()[None].expand(b, t, t)
    ref, ref_lse = _reference(q, k, v, causal)
    torch.testing.assert_close(out.double(), ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
