"""The decoder's causal CUDA kernels, called through their aten ops for the LSE they return: the output and
gradients equal SDPA's, and the LSE equals the float32 log-sum-exp of the causal logits, with GQA, up to 64k
tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from torchtitan_ext.ops.attention import attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _reference_lse(q: torch.Tensor, k: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """float32 LSE of the causal logits of the given query rows (batch 1), K/V heads shared by groups."""
    group = q.shape[1] // k.shape[1]
    keys = k[0].float().repeat_interleave(group, dim=0)  # (heads, seq, d)
    out = []
    for row in rows.tolist():
        logits = (q[0, :, row].float()[:, None] @ keys[:, :row + 1].transpose(-1, -2))[:, 0] * q.shape[-1] ** -0.5
        out.append(torch.logsumexp(logits, dim=-1))
    return torch.stack(out, dim=-1)  # (heads, rows)


@pytest.mark.parametrize("kernel", ["cudnn", "flash"])
@pytest.mark.parametrize("seq", [2048, 65536])
def test_fused_causal_kernel_matches_sdpa_and_returns_its_lse(kernel, seq):
    if kernel == "cudnn" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("cuDNN attention is the auto choice on Hopper only")
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, heads, seq, 128, device="cuda", dtype=torch.bfloat16, generator=g)
               for heads in (16, 8, 8))
    leaves = [x.transpose(1, 2).contiguous().transpose(1, 2).requires_grad_() for x in (q, k, v)]  # (b, s, h, d) memory
    ref_leaves = [x.detach().clone().requires_grad_() for x in leaves]
    out, lse = attention(*leaves, None, kernel=kernel)
    ref = F.scaled_dot_product_attention(*ref_leaves, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    grad = torch.randn_like(out)
    out.backward(grad)
    ref.backward(grad)
    for mine, theirs in zip(leaves, ref_leaves, strict=True):
        torch.testing.assert_close(mine.grad, theirs.grad, atol=5e-2, rtol=5e-2)
    rows = torch.linspace(0, seq - 1, 64).long()
    assert lse.shape == (1, 16, seq) and lse.dtype == torch.float32 and not lse.requires_grad
    torch.testing.assert_close(lse[0][:, rows], _reference_lse(q, k, rows), atol=2e-2, rtol=1e-3)
