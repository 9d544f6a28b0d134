"""Output head + cross-entropy over chunks of tokens, never holding the whole batch's float32 logits.

At the ``1b`` shape (16 x 2048 tokens, vocabulary 32,000) the float32 logits alone are 4 GiB, and the
unfused path keeps them (and their gradient) alive through the backward. Here the forward walks the tokens in
chunks: logits of one chunk (float32), optional soft-cap ``c * tanh(z / c)``, logsumexp, loss, z-loss
``coef * lse^2``, and at once that chunk's gradients, ``dh = dz @ W`` and ``dW += dz^T h`` (on GPU a chunk's
elementwise work is one compiled kernel); only ``dh`` (the size of the hidden states) and ``dW`` (the size of
the head) are kept for the backward, which scales them by the incoming gradient. Peak extra memory is one
chunk's logits.

``vocab_parallel_linear_cross_entropy`` is the tensor-parallel form: each rank holds a slice of the
vocabulary (rows of W); the per-token max, sum of exponentials and target logit are all-reduced over the TP
group, so no rank ever sees the whole vocabulary's logits.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

IGNORE_INDEX = -100


def _local_chunk(raw: torch.Tensor, labels: torch.Tensor, z_loss: float,
                 softcap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One chunk's summed loss and d(loss)/d(raw logits), whole vocabulary on this rank (one fused kernel
    when compiled): softmax * (1 + 2 z lse) - onehot(label), times the soft-cap's derivative."""
    logits = raw.float()
    if softcap > 0:
        t = torch.tanh(logits / softcap)
        logits = softcap * t
    lse = torch.logsumexp(logits, dim=-1)
    valid = (labels != IGNORE_INDEX).float()
    target = logits.gather(1, labels.clamp(min=0)[:, None]).squeeze(1)
    loss = ((lse - target + z_loss * lse * lse) * valid).sum()
    onehot = torch.arange(logits.shape[1], device=raw.device)[None, :] == labels[:, None]
    grad = torch.exp(logits - lse[:, None]) * ((1 + 2 * z_loss * lse) * valid)[:, None] - onehot.float()
    if softcap > 0:
        grad = grad * (1 - t * t)
    return loss, grad.to(raw.dtype)


@functools.cache
def _compiled_local_chunk():
    """``_local_chunk`` compiled, for GPU (the elementwise passes over a chunk's logits fuse); CPU runs it eagerly."""
    return torch.compile(_local_chunk, dynamic=False)


def _chunk_grads(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_loss: float, softcap: float,
                 chunk: int, vocab_start: int, group: dist.ProcessGroup | None):
    """Summed loss and its gradients w.r.t. h and weight (unnormalised: sums over tokens)."""
    n = h.shape[0]
    dh = torch.empty_like(h)
    dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    total = torch.zeros((), dtype=torch.float32, device=h.device)
    v_local = weight.shape[0]
    for start in range(0, n, chunk):
        hc, yc = h[start:start + chunk], labels[start:start + chunk]
        if group is None:
            local_chunk = _compiled_local_chunk() if h.is_cuda else _local_chunk
            loss_sum, grad = local_chunk(hc @ weight.t(), yc, z_loss, softcap)
            total += loss_sum
            dh[start:start + chunk] = grad @ weight
            dw += grad.t() @ hc
            continue
        logits = (hc @ weight.t()).float()
        if softcap > 0:
            t = torch.tanh(logits / softcap)
            logits = softcap * t
        local_max = logits.max(dim=-1).values
        # a max over the whole vocabulary keeps exp() in range on every rank
        dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        exp = torch.exp(logits - local_max[:, None])
        sumexp = exp.sum(-1)
        valid = yc != IGNORE_INDEX
        local_y = yc - vocab_start
        mine = valid & (local_y >= 0) & (local_y < v_local)
        target = torch.where(mine, logits.gather(1, local_y.clamp(0, v_local - 1)[:, None]).squeeze(1), 0.0)
        dist.all_reduce(sumexp, group=group)
        dist.all_reduce(target, group=group)
        lse = local_max + sumexp.log()
        validf = valid.float()
        total += ((lse - target) * validf).sum()
        if z_loss > 0:
            total += z_loss * (lse.pow(2) * validf).sum()
        # d/dlogits: softmax * (1 + 2 z lse) - onehot(target), zero on ignored tokens.
        grad = exp / sumexp[:, None] * ((1 + 2 * z_loss * lse) * validf)[:, None]
        rows = torch.nonzero(mine).squeeze(1)
        grad[rows, local_y[rows]] -= 1.0
        if softcap > 0:
            grad = grad * (1 - t * t)
        grad = grad.to(h.dtype)
        dh[start:start + chunk] = grad @ weight
        dw += grad.t() @ hc  # a GEMM in the activations' dtype, summed over chunks in float32
    if group is not None:  # every rank's vocabulary slice contributes to each token's hidden gradient
        dist.all_reduce(dh, group=group)
    return total, dh, dw.to(weight.dtype)


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, labels, z_loss, softcap, chunk, vocab_start, group):
        total, dh, dw = _chunk_grads(h, weight, labels, z_loss, softcap, chunk, vocab_start, group)
        count = (labels != IGNORE_INDEX).sum().clamp(min=1)
        ctx.save_for_backward(dh, dw, count)
        return total / count

    @staticmethod
    def backward(ctx, grad_out):
        dh, dw, count = ctx.saved_tensors
        scale = grad_out / count
        return dh * scale.to(dh.dtype), dw * scale.to(dw.dtype), None, None, None, None, None, None


def linear_cross_entropy(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0,
                         softcap: float = 0.0, chunk: int = 8192) -> torch.Tensor:
    """Mean over tokens of CE(softcap(h @ W^T), labels) + z_loss * lse^2; h (..., dim), labels (...)."""
    return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight, labels.reshape(-1), z_loss, softcap,
                                     chunk, 0, None)


def vocab_parallel_linear_cross_entropy(h: torch.Tensor, weight_shard: torch.Tensor, labels: torch.Tensor,
                                        group: dist.ProcessGroup, z_loss: float = 0.0, softcap: float = 0.0,
                                        chunk: int = 8192) -> torch.Tensor:
    """The same loss with W's rows (the vocabulary) split evenly over ``group``; h and labels replicated.
    Returns the full loss on every rank; h's gradient is summed over the group, W's stays local."""
    vocab_start = dist.get_rank(group) * weight_shard.shape[0]
    return _LinearCrossEntropy.apply(h.reshape(-1, h.shape[-1]), weight_shard, labels.reshape(-1), z_loss,
                                     softcap, chunk, vocab_start, group)


def reference_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, z_loss: float = 0.0,
                            softcap: float = 0.0) -> torch.Tensor:
    """The unfused definition (what the model's head and ``train.losses`` compute)."""
    logits = logits.flatten(0, -2).float()
    if softcap > 0:
        logits = softcap * torch.tanh(logits / softcap)
    labels = labels.flatten()
    loss = torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    if z_loss > 0:
        valid = labels != IGNORE_INDEX
        loss = loss + z_loss * torch.logsumexp(logits, dim=-1)[valid].pow(2).mean()
    return loss
