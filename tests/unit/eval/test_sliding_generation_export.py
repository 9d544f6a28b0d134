"""Sliding-window evaluation against a token-by-token reference, compiled generation against eager, and Hugging Face
export's logits against transformers (no trainer run)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from data_builders import random_decoder

from torchtitan_ext.eval.sliding import sliding_sums, windows
from torchtitan_ext.generate.decoding import generate
from torchtitan_ext.hf.export import export_model
from torchtitan_ext.hf.load import load_hf


def test_sliding_window_equals_token_by_token_reference():
    model = random_decoder().double()
    tokens = torch.randint(0, 97, (70,))
    seq_len, stride = 16, 5
    spans = windows(len(tokens), seq_len, stride)
    got = sliding_sums(model, tokens, seq_len, stride, batch_size=3, table=None)
    ref, scored = 0.0, []
    for start, first in spans:
        for j in range(first, seq_len):
            target = start + 1 + j
            context = tokens[start:target]  # exactly what the window's causal attention sees
            assert len(context) >= seq_len - stride or start == 0
            logits = model(context[None])[0, -1]
            ref += F.cross_entropy(logits[None], tokens[target][None]).item()
            scored.append(target)
    assert scored == list(range(1, len(tokens)))  # every target once, in order
    assert got[1].item() == len(scored)
    assert got[0].item() == pytest.approx(ref, rel=1e-10)


@pytest.mark.slow  # 20-35 s with a cold inductor cache on 2 busy cores, 8 s with a warm one
def test_compiled_generation_equals_eager():
    """compile=True (CPU inductor here; on CUDA the same one-token step graph replays as a CUDA graph) gives
    the eager cached path's tokens and the no-cache reference's: prompts of different lengths, a stop id
    that ends one row mid-way, sampling, on a random model (its tokens depend on the whole context, unlike
    the 6-step trained model's) with every block feature the cached forward walks: QK-norm, partial RoPE,
    NoPE layers, KV sharing, residual scalars, MoDE, tied head, soft-cap."""
    from torch._dynamo.utils import counters

    model = random_decoder(qk_norm=True, rope_fraction=0.5, nope_every=2, logit_softcap=20.0, n_layers=4,
                          kv_share="interleaved", residual_scalars=True, tie_embeddings=True, n_experts=4,
                          moe_every=2, moe_hidden=32)
    prompts = [[1, 2, 3, 4, 5], [7, 8], [9, 10, 11, 12, 13, 14, 15, 16, 17]]
    full = generate(model, prompts, 20)
    assert full == generate(model, prompts, 20, use_cache=False)
    # A token the last row makes (after its first two) that the other rows never make: it ends that row only.
    stop = next(t for t in full[2][2:] if not any(t in row for row in full[:2]))
    cut = full[2][:full[2].index(stop) + 1]
    assert len(cut) < 20
    graphs = counters["stats"]["unique_graphs"]
    assert generate(model, prompts, 20, compile=True) == full
    stopped = generate(model, prompts, 20, stop_id=stop, compile=True)
    assert stopped == generate(model, prompts, 20, stop_id=stop) == [full[0], full[1], cut]
    assert stopped == generate(model, prompts, 20, stop_id=stop, use_cache=False)
    sampled = generate(model, prompts, 12, temperature=0.8, top_p=0.9, seed=1, compile=True)
    assert sampled == generate(model, prompts, 12, temperature=0.8, top_p=0.9, seed=1)
    # One graph (at most: one of this shape may exist already) for every step and call: the position is a
    # tensor, not a constant of the graph.
    assert counters["stats"]["unique_graphs"] <= graphs + 1
    # Every row stopped: the loop ends at its next read of the device and trims as the eager loop did.
    assert generate(model, prompts[2:], 30, stop_id=stop) == [cut]


@pytest.mark.parametrize("features, arch", [({}, "LlamaForCausalLM"),
                                            ({"qk_norm": True, "tie_embeddings": True}, "Qwen3ForCausalLM"),
                                            ({"nope_every": 2}, "SmolLM3ForCausalLM")])
def test_export_logits_equal_transformers(tmp_path, features, arch):
    transformers = pytest.importorskip("transformers", reason="pip install -e .[dev] installs transformers")
    model = random_decoder(**features)
    export_model(model, tmp_path, dtype=torch.float32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert type(hf).__name__ == arch
    x = torch.randint(0, 97, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-5, atol=1e-5)
        back = load_hf(tmp_path)
        assert torch.equal(back(x), model(x))
