"""Muon: momentum orthogonalised by a Newton-Schulz iteration, for the blocks' weight matrices.

Each matrix's update is ``lr * 0.2 * sqrt(max(rows, cols)) * NS(momentum)`` (Moonlight's scale, which gives
the update the RMS of an AdamW step, so one learning rate serves both optimizers), with decoupled weight
decay. A sharded parameter (FSDP2, TP, EP: any DTensor) is orthogonalised whole on one rank: the matrices
are dealt round-robin over the ranks of their mesh; per round, one all-to-all sends every rank's shards to
the matrices' owners and one all-to-all returns the orthogonalised shards. Which global elements a rank
holds is learnt once by sharding an index tensor with the parameter's own placements, so any placement
(uneven, strided, replicated) is handled the same way. A 3-D parameter (MoDE experts) is a batch of
matrices over its leading dim. Matrices a rank holds whole (plain tensors, or DTensors on a one-rank mesh, as
FSDP2 makes on one GPU) skip the exchange and are orthogonalised in batches of equal shapes: one batched
matmul chain per shape instead of a chain per matrix (a chain per matrix is many small launches, which made a
small model's Muon step much slower than AdamW's).

Under muP the scale above is kept and the width correction, 1 / sqrt(width_mult), rides on the group's lr
(``optim.lr_scale`` says why), so the update equals Muon's at the base width.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, distribute_tensor

# Quintic Newton-Schulz coefficients (Keller Jordan's Muon): fast convergence of singular values to ~1.
_NS_COEFFS = (3.4445, -4.7750, 2.0315)
BATCH_ELEMENTS = 1 << 28  # most elements stacked into one batched Newton-Schulz (bounds its extra memory)


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """Approximately ``U V^T`` of ``g = U S V^T`` over the last two dims (bf16 on GPU, float32 on CPU)."""
    a, b, c = _NS_COEFFS
    x = g.to(torch.bfloat16 if g.is_cuda else torch.float32)
    transposed = x.shape[-2] > x.shape[-1]
    if transposed:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.mT if transposed else x).to(g.dtype)


def muon_scale(shape: torch.Size) -> float:
    """Moonlight's RMS match: 0.2 * sqrt(max(rows, cols)) of each matrix."""
    return 0.2 * math.sqrt(max(shape[-2], shape[-1]))


def _apply(p: torch.Tensor, ortho: torch.Tensor, group: dict, shape: torch.Size) -> None:
    """Decoupled weight decay, then the scaled orthogonalised step (``shape``: the whole parameter's)."""
    if group["weight_decay"]:
        p.mul_(1 - group["lr"] * group["weight_decay"])
    p.add_(ortho.to(p.dtype), alpha=-group["lr"] * muon_scale(shape))


_GROUPS: dict[int, dist.ProcessGroup] = {}


def _mesh_group(mesh) -> dist.ProcessGroup:
    """One process group over all ranks of a (possibly multi-dimensional) mesh, created once."""
    if id(mesh) not in _GROUPS:
        _GROUPS[id(mesh)] = mesh.get_group() if mesh.ndim == 1 else mesh._flatten().get_group()
    return _GROUPS[id(mesh)]


def _all_to_all(outputs: list[torch.Tensor], inputs: list[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Uneven all-to-all of flat tensors as one ``all_to_all_single`` (gloo's list form needs equal sizes)."""
    out = torch.empty(sum(t.numel() for t in outputs), dtype=inputs[0].dtype, device=inputs[0].device)
    dist.all_to_all_single(out, torch.cat(inputs), [t.numel() for t in outputs], [t.numel() for t in inputs],
                           group=group)
    for t, piece in zip(outputs, out.split([t.numel() for t in outputs]), strict=True):
        t.copy_(piece)


class _Layout:
    """Where a DTensor's local elements sit in the whole tensor, for every rank of its mesh."""

    def __init__(self, p: DTensor):
        mesh = p.device_mesh
        self.group = _mesh_group(mesh)
        self.world = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        numel = p.numel()
        index = torch.arange(numel, device=p.to_local().device).view(p.shape)
        local = distribute_tensor(index, mesh, p.placements, src_data_rank=None).to_local().reshape(-1)
        sizes = [torch.zeros(1, dtype=torch.long, device=local.device) for _ in range(self.world)]
        dist.all_gather(sizes, torch.tensor([local.numel()], device=local.device), group=self.group)
        self.sizes = [int(s) for s in sizes]
        most = max(self.sizes)  # gloo's all_gather needs equal sizes: pad uneven shards
        gathered = [torch.empty(most, dtype=torch.long, device=local.device) for _ in self.sizes]
        dist.all_gather(gathered, torch.cat([local, local.new_zeros(most - local.numel())]), group=self.group)
        self.indices = [g[:n] for g, n in zip(gathered, self.sizes, strict=True)]  # global flat indices per rank


class Muon(torch.optim.Optimizer):
    """Muon over matrices (2-D) or batches of matrices (3-D); see the module docstring."""

    def __init__(self, params, lr: float, momentum: float = 0.95, nesterov: bool = True, ns_steps: int = 5,
                 weight_decay: float = 0.0):
        super().__init__(params, {"lr": lr, "momentum": momentum, "nesterov": nesterov, "ns_steps": ns_steps,
                                  "weight_decay": weight_decay})
        self._layouts: dict[int, _Layout] = {}

    def _layout(self, p: DTensor) -> _Layout:
        if id(p) not in self._layouts:
            self._layouts[id(p)] = _Layout(p)
        return self._layouts[id(p)]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            local_jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Size]] = []
            sharded_jobs: dict[int, list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                buf = state["momentum_buffer"]
                g = p.grad
                buf.mul_(group["momentum"]).add_(g)
                update = g.add(buf, alpha=group["momentum"]) if group["nesterov"] else buf.clone()
                if not isinstance(p, DTensor):
                    local_jobs.append((p, update, p.shape))
                elif self._layout(p).world == 1:  # the local shard is the whole matrix
                    local_jobs.append((p.to_local(), update.to_local(), p.shape))
                else:
                    sharded_jobs.setdefault(id(self._layout(p).group), []).append((p, update))
            self._orthogonalise_local(local_jobs, group)
            for jobs in sharded_jobs.values():
                self._orthogonalise_sharded(jobs, group)
        return loss

    def _orthogonalise_local(self, jobs: list[tuple[torch.Tensor, torch.Tensor, torch.Size]], group: dict) -> None:
        """Whole matrices of equal shape stacked, up to ``BATCH_ELEMENTS`` at a time, and orthogonalised as one
        batch (``newton_schulz`` works on the last two dims; norms are per matrix)."""
        by_shape: dict[tuple, list] = {}
        for job in jobs:
            by_shape.setdefault((tuple(job[1].shape), job[1].dtype), []).append(job)
        for same in by_shape.values():
            per_batch = max(1, BATCH_ELEMENTS // same[0][1].numel())
            for start in range(0, len(same), per_batch):
                chunk = same[start:start + per_batch]
                if len(chunk) == 1:
                    ortho = [newton_schulz(chunk[0][1], group["ns_steps"])]
                else:
                    ortho = newton_schulz(torch.stack([u for _, u, _ in chunk]), group["ns_steps"]).unbind(0)
                for (p, _, shape), o in zip(chunk, ortho, strict=True):
                    _apply(p, o, group, shape)

    def _orthogonalise_sharded(self, jobs: list[tuple[DTensor, DTensor]], group: dict) -> None:
        """Rounds of ``world`` matrices: matrix i of a round belongs to rank i."""
        first = self._layout(jobs[0][0])
        world, rank, pg = first.world, first.rank, first.group
        for start in range(0, len(jobs), world):
            chunk = jobs[start:start + world]
            # Gather: rank r sends its shard of matrix i to rank i; receives every rank's shard of its own.
            sends = [chunk[i][1].to_local().reshape(-1).contiguous() if i < len(chunk)
                     else jobs[0][1].to_local().new_empty(0) for i in range(world)]
            mine = chunk[rank] if rank < len(chunk) else None
            layout = self._layout(mine[0]) if mine is not None else None
            recvs = [sends[0].new_empty(layout.sizes[r] if layout else 0) for r in range(world)]
            _all_to_all(recvs, sends, pg)
            back = [sends[0].new_empty(0) for _ in range(world)]
            if mine is not None:
                full = sends[0].new_empty(mine[0].numel())
                for r in range(world):
                    full[layout.indices[r]] = recvs[r]
                ortho = newton_schulz(full.view(mine[0].shape), group["ns_steps"]).reshape(-1)
                back = [ortho[layout.indices[r]] for r in range(world)]
            # Scatter: the owner of matrix i returns each rank its shard of the result.
            returns = [sends[0].new_empty(self._layout(chunk[i][0]).sizes[rank] if i < len(chunk) else 0)
                       for i in range(world)]
            _all_to_all(returns, back, pg)
            for i, (p, _) in enumerate(chunk):
                local = p.to_local()
                _apply(local, returns[i].view(local.shape), group, p.shape)
