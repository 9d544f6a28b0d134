"""The op-level selective activation checkpointing, compiled: the same gradients as no checkpointing, fewer saved
bytes (it keeps GEMM and attention outputs and recomputes the rest)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.float8_utils import TORCHAO_ERROR
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Block, rope_tables
from torchtitan_ext.parallel.activation_checkpoint import apply_activation_checkpointing

AC_ARGS = ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32,
                    qk_norm=True, rope_fraction=0.5)
BATCH, SEQ = 4, 32


def _compiled_blocks(mode: str) -> tuple[torch.Tensor, list[torch.Tensor], int]:
    """(input gradient, parameter gradients, bytes of activations the compiled blocks save) in float64."""
    torch.manual_seed(0)
    holder = nn.Module()
    holder.layers = nn.ModuleDict({str(i): Block(AC_ARGS, i) for i in range(2)}).double()
    apply_activation_checkpointing(holder, mode, every=0)
    for name, block in list(holder.layers.items()):
        holder.layers[name] = torch.compile(block, fullgraph=True)
    cos, sin = rope_tables(AC_ARGS)
    rope = (cos[None].double(), sin[None].double())
    x = torch.randn(BATCH, SEQ, AC_ARGS.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(1),
                    requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in holder.parameters()}
    saved: dict[int, int] = {}  # storage -> bytes; weights (saved for the input gradients) are not activations

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        h = x
        for block in holder.layers.values():
            h, _ = block(h, rope)
    h.square().mean().backward()
    return x.grad, [p.grad for p in holder.parameters()], sum(saved.values())


@pytest.mark.slow
def test_selective_ac_compiled_same_gradients_fewer_saved_bytes():
    ref_x, ref_params, bytes_none = _compiled_blocks("none")
    got_x, got_params, bytes_sac = _compiled_blocks("selective")
    torch.testing.assert_close(got_x, ref_x, rtol=1e-12, atol=1e-14)
    for got, ref in zip(got_params, ref_params, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-14)
    # Per block, what the policy keeps: its input, the q/k/v, wo, w1, w3 GEMM outputs and the attention output
    # with its log-sum-exp (float64); w2's output feeds only the residual add and is not needed by backward.
    a, tokens = AC_ARGS, BATCH * SEQ
    per_token = a.dim + a.n_heads * a.hdim + 2 * a.kv_heads * a.hdim + a.dim + 2 * a.ffn_hidden + a.n_heads * a.hdim
    expected = a.n_layers * (tokens * per_token * 8 + BATCH * a.n_heads * SEQ * 8)
    assert expected <= bytes_sac <= expected + a.n_layers * 8192, (bytes_sac, expected)  # + RoPE rows, RNG state
    assert bytes_none > 1.4 * bytes_sac, (bytes_none, bytes_sac)  # no AC also keeps norm outputs, q/k after RoPE


@pytest.mark.skipif(TORCHAO_ERROR is not None, reason=str(TORCHAO_ERROR))
def test_selective_ac_keeps_float8_amaxes(monkeypatch):
    """An emulated float8 block under the op-level policy: the backward's recomputation takes no whole-tensor
    maximum of its own (the forward's amaxes are kept); with them dropped from the kept ops it takes some."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from torchtitan_ext.config.job_config import Float8Section
    from torchtitan_ext.parallel import activation_checkpoint as ac
    from torchtitan_ext.quant.float8 import convert_to_float8

    class CountMax(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls += func is torch.ops.aten.max.default
            return func(*args, **(kwargs or {}))

    def maxima_in_backward() -> int:
        torch.manual_seed(0)
        holder = nn.Module()
        holder.layers = nn.ModuleDict({"0": Block(AC_ARGS, 0)})
        convert_to_float8(holder, Float8Section(enabled=True, min_dim=16), emulate=True, log=lambda s: None)
        apply_activation_checkpointing(holder, "selective", every=0)
        cos, sin = rope_tables(AC_ARGS)
        x = torch.randn(BATCH, SEQ, AC_ARGS.dim, requires_grad=True)
        out = holder.layers["0"](x, (cos[None], sin[None]))[0]
        counter = CountMax()
        with counter:
            out.square().mean().backward()
        return counter.calls

    kept = maxima_in_backward()
    monkeypatch.setattr(ac, "_SAVE_OPS", ac._SAVE_OPS - {torch.ops.aten.max.default})
    recomputed = maxima_in_backward()
    assert recomputed > kept, (kept, recomputed)
