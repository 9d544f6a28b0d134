"""Closed-form parameter counts, checked against the built model by a test."""

from __future__ import annotations

from torchtitan_ext.models.args import ModelArgs


def count_params(a: ModelArgs) -> dict[str, int]:
    """``total``; ``active`` (used per token: k experts of each MoDE layer); ``embedding`` (the input table);
    ``kv_per_token`` (K and V values cached per token for generation: layers that compute their own K/V)."""
    hd = a.hdim
    kv_layers = sum(a.computes_kv(layer) for layer in range(a.n_layers))
    mats = 3 if a.activation == "swiglu" else 2
    dense_ffn = mats * a.dim * a.ffn_hidden
    expert = 3 * a.dim * a.expert_hidden
    total = active = 0
    for layer in range(a.n_layers):
        own_kv = a.computes_kv(layer)
        common = a.dim * a.n_heads * hd * 2 + (a.dim * a.kv_heads * hd * 2 if own_kv else 0) + \
            ((2 if own_kv else 1) * hd if a.qk_norm else 0) + 2 * a.dim  # attention and the two norms
        if a.is_moe(layer):
            common += a.dim * a.n_experts + (expert if a.shared_expert else 0)  # router and shared expert
            total += common + a.n_experts * expert
            active += common + a.top_k * expert
        else:
            total += common + dense_ffn
            active += common + dense_ffn
    embedding = a.vocab_size * a.dim
    rest = embedding + a.dim + (0 if a.tie_embeddings else embedding)
    return {"total": total + rest, "active": active + rest, "embedding": embedding,
            "kv_per_token": 2 * kv_layers * a.kv_heads * hd}
