"""MoDE (Mixture of Distilled Experts): top-k routed SwiGLU experts with dropless token-choice routing.

Routing: softmax over the router's logits, top-k (selection may add a per-expert bias, the auxiliary-
loss-free balancing of DeepSeek-V3, which moves toward equal load without touching the gradients), gates
optionally renormalised over the k chosen. Every token reaches its k experts (no capacity, no drops): the
token copies are sorted by expert and run through one grouped GEMM per weight (``GroupedExperts``), then
scattered back weighted by their gates. ``GroupedExperts`` is the unit expert parallelism distributes.

Balancing losses (Switch load-balancing, router z-loss) do not change the forward value; they enter the
backward pass through ``add_aux_loss`` so they reach the router from any pipeline stage. The Switch loss is
the whole sequence's: where a layer sees a part of each sequence (context or sequence parallelism), its
``routed_counts`` part sums the routed copies over the parts (``parallel/sequence_balance.py``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.ffn import FeedForward


class _AddAuxGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.aux_dtype, ctx.scale = aux.dtype, scale
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.full((), ctx.scale, dtype=ctx.aux_dtype, device=grad.device), None


def add_aux_loss(out: torch.Tensor, aux: torch.Tensor, scale: float) -> torch.Tensor:
    """Identity on ``out``; in backward, adds d(aux)/d(router) scaled by ``scale`` (the main loss's scaling).
    The scale is a plain float read when the forward runs: compile traces the backward ahead of time, so a
    changed scale recompiles."""
    return _AddAuxGrad.apply(out, aux, scale)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """Row block g of ``x`` (rows ends[g-1]:ends[g]) times ``w[g].T``; w is (groups, out, in).

    On CUDA one ``torch._grouped_mm`` in bf16 (no host sync, no loop), whose result stays bf16 under autocast
    as a Linear's does; elsewhere a loop over groups."""
    if x.is_cuda:
        out = torch._grouped_mm(x.bfloat16(), w.bfloat16().transpose(-2, -1), offs=ends.int())
        return out if torch.is_autocast_enabled("cuda") else out.to(x.dtype)
    outs, start = [], 0
    for g, end in enumerate(ends.tolist()):
        outs.append(x[start:end] @ w[g].t())
        start = end
    return torch.cat(outs) if outs else x.new_zeros(0, w.shape[1])


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """``inv`` with ``inv[perm[i]] = i``."""
    return torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))


class _PermuteRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inv)
        return x[perm]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inv,) = ctx.saved_tensors
        return grad[inv], None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """``x[perm]`` for a permutation ``perm`` with inverse ``inv``; the backward is the gather ``grad[inv]``
    (autograd's own backward of indexing is an accumulating scatter, which sorts and uses atomics)."""
    return _PermuteRows.apply(x, perm, inv)


class _DispatchCopies(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, order: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
        ctx.save_for_backward(inv)
        ctx.k = k
        return x[order // k]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (inv,) = ctx.saved_tensors
        return grad[inv].view(-1, ctx.k, grad.shape[-1]).sum(dim=1), None, None, None


def dispatch_copies(x: torch.Tensor, order: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
    """Row ``order[i] // k`` of ``x`` (tokens, dim) for each i: the k copies of every token, sorted by expert
    (``order`` sorts the (token, copy) pairs, ``inv`` is its inverse). The backward gathers each token's k
    gradient rows back and sums them, with no atomics."""
    return _DispatchCopies.apply(x, order, inv, k)


class ScaleGrad(torch.autograd.Function):
    """Identity whose backward multiplies the gradient by ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad * ctx.scale, None


def _to_dtype_scaled(grad: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    return (grad.to(dtype) * scale).contiguous()


# One Triton pass, compiled at the first backward per weight shape. Eagerly, torch's bf16 -> fp32 copy is an
# unrolled kernel at about half the speed of its fp32 -> bf16 one, and the scaling would be a second pass over
# every expert weight's gradient.
_to_dtype_scaled_kernel = torch.compile(_to_dtype_scaled, dynamic=False, fullgraph=True)


class _CastForExperts(torch.autograd.Function):
    """``w.bfloat16()`` whose backward casts the gradient back to ``w``'s dtype and multiplies it by
    ``scale`` in one compiled pass (eagerly: a slow cast, then a separate scaling pass)."""

    @staticmethod
    def forward(ctx, w: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.dtype, ctx.scale = w.dtype, scale
        return w.bfloat16()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _to_dtype_scaled_kernel(grad, ctx.dtype, ctx.scale), None


class GroupedExperts(nn.Module):
    """E SwiGLU experts in stacked weights; input rows sorted by expert, ``counts[e]`` rows each.

    ``grad_scale`` multiplies the weights' gradients: expert parallelism sets it to 1 / ep, because an
    expert's gradient then sums the losses of all its EP peers' tokens, which data parallelism averages."""

    grad_scale = 1.0
    # Expert parallelism's dispatch can run other work while the rows travel (``parallel/ep.py``): when
    # ``overlaps_side_work``, the MoDE layer sets ``side_work`` (a callable) before calling the experts and
    # reads its result from ``side_result`` after.
    overlaps_side_work = False
    side_work = None
    side_result = None

    def __init__(self, n_experts: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n_experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n_experts, dim, hidden))

    def local_weights(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w1, w2, w3) of this rank's experts (under expert parallelism the weights are DTensors sharded by
        expert), their gradients scaled by ``grad_scale``. On CUDA in bf16, the grouped GEMMs' dtype (already
        so when FSDP holds them): the scaling then runs over bf16 gradients, half the bytes of fp32 ones. Eager
        experts with fp32 weights (expert parallelism, float8 experts) cast through ``_CastForExperts``, whose
        backward widens and scales in one pass."""
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        if w1.is_cuda and w1.dtype != torch.bfloat16 and not torch.compiler.is_compiling():  # experts run eagerly
            return tuple(_CastForExperts.apply(w, self.grad_scale) for w in (w1, w2, w3))
        if w1.is_cuda:
            w1, w2, w3 = w1.bfloat16(), w2.bfloat16(), w3.bfloat16()
        if self.grad_scale != 1.0:
            w1, w2, w3 = (ScaleGrad.apply(w, self.grad_scale) for w in (w1, w2, w3))
        return w1, w2, w3

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        ends = counts.cumsum(0)
        w1, w2, w3 = self.local_weights()
        h = F.silu(grouped_mm(x, w1, ends)) * grouped_mm(x, w3, ends)
        return grouped_mm(h, w2, ends)


class RoutedCounts(nn.Module):
    """Routed copies per expert over every token of the sequences the layer's input is part of: the Switch
    loss's load fractions. Here the input's own counts (the layer sees whole sequences); parallelism that
    hands each rank a part of every sequence swaps in a part that sums them (``parallel/sequence_balance.py``)."""

    def forward(self, counts: torch.Tensor) -> torch.Tensor:
        return counts


class MoDE(nn.Module):
    MAX_DOMAINS = 16

    def __init__(self, args: ModelArgs, fused_activation: bool = False):
        super().__init__()
        self.n_experts, self.top_k, self.renormalize = args.n_experts, args.top_k, args.renormalize_gates
        self.aux_coef, self.z_coef = args.aux_loss_coef, args.router_z_loss_coef
        self.bias_update_rate = args.bias_update_rate
        self.force_balanced_routing = args.force_balanced_routing
        self.router = nn.Linear(args.dim, args.n_experts, bias=False)
        self.experts = GroupedExperts(args.n_experts, args.dim, args.expert_hidden)
        self.shared_expert = FeedForward(args.dim, args.expert_hidden, fused=fused_activation) \
            if args.shared_expert else None
        self.routed_counts = RoutedCounts()
        # The balancing losses' gradient weight: the main loss's scaling (``Decoder.set_loss_scales``).
        self.aux_grad_scale = 1.0
        # Auxiliary-loss-free balancing: added to the scores for selection only; saved in checkpoints.
        self.register_buffer("expert_bias", torch.zeros(args.n_experts), persistent=True)
        # Routed token copies per expert since the last read (metrics, bias updates); per rank. Integers:
        # exact at any count, and ``module.to(dtype)`` leaves them alone (a bf16 counter stops at 256).
        self.register_buffer("load", torch.zeros(args.n_experts, dtype=torch.long), persistent=False)
        # Per-domain routed copies (the Zen report's specialisation analysis) when the caller sets
        # ``token_domains``, one id below MAX_DOMAINS per sequence (batch,), before the forward pass; the
        # layer may see a slice of each sequence (sequence parallel), so it expands them to its own input.
        self.register_buffer("domain_load", torch.zeros(self.MAX_DOMAINS, args.n_experts, dtype=torch.long),
                             persistent=False)
        self.token_domains: torch.Tensor | None = None
        self.last_aux_loss = self.last_z_loss = None
        # Where each expert's weights sit in ``experts`` (row of w1 / w2 / w3): expert parallelism's placement
        # by load (``parallel/expert_placement.py``) moves experts between ranks; the identity otherwise.
        # Not saved: checkpoints hold the experts in their own order.
        self.register_buffer("expert_slot", torch.arange(args.n_experts), persistent=False)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        self.expert_bias.zero_()
        self.load.zero_()
        self.domain_load.zero_()
        torch.arange(self.n_experts, out=self.expert_slot)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (tokens, dim) -> expert ids (tokens, k), gates (tokens, k), router logits (tokens, E) fp32."""
        logits = self.router(x).float()
        probs = logits.softmax(dim=-1)
        if self.force_balanced_routing:  # copy j of token t to expert (t * k + j) mod E: every expert alike
            copies = torch.arange(x.shape[0] * self.top_k, device=x.device)
            idx = (copies % self.n_experts).view(x.shape[0], self.top_k)
        else:
            scores = probs + self.expert_bias if self.bias_update_rate > 0 else probs
            idx = scores.topk(self.top_k, dim=-1).indices
        gates = probs.gather(1, idx)
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        return idx, gates, logits

    def balancing_loss(self, logits: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Switch loss ``E * sum_e f_e * P_e`` (f: fraction of routed copies, P: mean router probability)
        times its coefficient, plus the router z-loss times its coefficient.

        f counts the whole sequences (``routed_counts``; no gradient), P this input's tokens: where each rank
        holds an equal part of every sequence, the ranks' mean of this loss is the whole sequences' loss and
        the mean of their gradients its gradient (each rank's part of P_e is its tokens' share). The z-loss is
        a per-token mean, which the ranks' mean makes the whole sequences' likewise."""
        probs = logits.softmax(dim=-1)
        total = self.routed_counts(counts)
        frac = total.to(probs.dtype) / total.sum()
        aux = self.n_experts * (frac * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        self.last_aux_loss, self.last_z_loss = aux.detach(), z.detach()
        return self.aux_coef * aux + self.z_coef * z

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        copies, counts, plan = self.dispatch_tokens(x, shape)
        if self.shared_expert is not None and self.experts.overlaps_side_work:
            # The shared expert runs while expert parallelism's all-to-all carries the copies.
            self.experts.side_work = lambda: self.shared_expert(x)
            y = self.experts(copies, counts)
            shared, self.experts.side_result = self.experts.side_result, None
            return self.combine_outputs(y, x, plan, shared).reshape(shape)
        y = self.experts(copies, counts)
        return self.combine_outputs(y, x, plan).reshape(shape)

    def dispatch_tokens(self, x: torch.Tensor, shape: torch.Size) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """Route x (tokens, dim) and copy each token to its k experts: (the copies in the order the experts
        sit in ``experts``, copies per expert in that order, what ``combine_outputs`` needs). Also counts the
        load (per expert) and builds the balancing loss."""
        idx, gates, logits = self.route(x)
        if torch.is_autocast_enabled(x.device.type):  # the copies travel in the dtype the experts compute in
            x = x.to(torch.get_autocast_dtype(x.device.type))
        flat = idx.flatten()  # copy j of token t sits at t * k + j
        # Routed copies per expert, as a comparison and a sum: a static shape (bincount's output size depends
        # on the data, which torch.compile cannot trace in one graph), as cheap as an int64 scatter-add.
        counts = (flat[:, None] == torch.arange(self.n_experts, device=flat.device)).sum(dim=0)
        slots = self.expert_slot[flat]
        order = slots.argsort(stable=True)  # token copies sorted by where their expert sits
        inv = inverse_permutation(order)
        slot_counts = torch.zeros_like(counts).scatter_(0, self.expert_slot, counts)
        aux = None
        if self.training:  # loads steer the balancing bias and the metrics: training tokens only
            self._count_load(counts, flat, shape)
            if self.aux_coef > 0 or self.z_coef > 0:
                aux = self.balancing_loss(logits, counts)
        return dispatch_copies(x, order, inv, self.top_k), slot_counts, (order, inv, gates, aux)

    def combine_outputs(self, y: torch.Tensor, x: torch.Tensor, plan: tuple,
                        shared: torch.Tensor | None = None) -> torch.Tensor:
        """The experts' rows ``y`` back in (token, copy) order, then each token's gate-weighted sum of its k
        copies (gathers and a reduction, no atomic scatter-adds: deterministic, and fast in bf16), plus the
        shared expert (``shared``: its output, when computed already); the balancing loss rides along into
        the backward pass."""
        order, inv, gates, aux = plan
        y = permute_rows(y, inv, order).view(x.shape[0], self.top_k, -1)
        out = (y * gates.unsqueeze(-1)).sum(dim=1).to(x.dtype)  # summed in float32 (the gates' dtype)
        if shared is not None:
            out = out + shared
        elif self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out if aux is None else add_aux_loss(out, aux, self.aux_grad_scale)

    @torch.no_grad()
    def _count_load(self, counts: torch.Tensor, flat: torch.Tensor, shape: torch.Size) -> None:
        """Add this batch's routed copies per expert (and per domain, when the trainer set them)."""
        self.load += counts
        if self.token_domains is not None:
            domain = self.token_domains[:, None].expand(shape[:-1]).reshape(-1).clamp(max=self.MAX_DOMAINS - 1)
            cell = domain.repeat_interleave(self.top_k) * self.n_experts + flat
            # A float32 scatter-add (exact below 2**24 copies per batch): the integer one runs as a slow sort
            # on CUDA.
            hits = torch.zeros(self.domain_load.numel(), device=flat.device).scatter_add_(
                0, cell, torch.ones_like(cell, dtype=torch.float32))
            self.domain_load += hits.view_as(self.domain_load).long()

    @torch.no_grad()
    def update_bias(self, global_load: torch.Tensor) -> None:
        """Auxiliary-loss-free step: raise the bias of under-loaded experts, lower over-loaded ones."""
        global_load = global_load.to(self.expert_bias.dtype)
        self.expert_bias += self.bias_update_rate * torch.sign(global_load.mean() - global_load)
