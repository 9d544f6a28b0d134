"""The trainer's gradient compression: which Squinch collective (``torchtitan_ext.comm``) a ``[comm]`` section
installs on the model parts, and this rank's error-feedback residuals for the checkpoint.

``comm.gradient_compression = "squinch"`` compresses the data-parallel reduction that crosses the slow link:

* ``parallelism.dp_mode = "ddp"``: the DDP all-reduce (a comm hook).
* FSDP over ``dp_shard`` alone: the FSDP2 reduce-scatter. Under context parallelism FSDP shards over
  ``dp_shard x cp`` (the CP ranks hold gradients of different parts of the same sequences), and the same
  reduce-scatter runs over those ranks.
* HSDP (``dp_replicate > 1``): only the all-reduce over ``dp_replicate`` (the replicas, one per node), as an
  FSDP2 all-reduce hook per module started as soon as that module's reduce-scatter is done, overlapped with
  the rest of the backward pass. The reduce-scatter over ``dp_shard`` (x ``cp``; inside a node: NVLink) stays
  FSDP's own. The model is then sharded over ``dp_shard`` (x ``cp``) alone (``parallelize`` asks
  :func:`replicate_all_reduce_replaced`), since FSDP2's native HSDP all-reduce cannot be replaced.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from torchtitan_ext.comm.compressed_collectives import (
    CommStats,
    SquinchReduceScatter,
    SquinchReplicateAllReduce,
    SquinchReplicateHook,
    _AllReduceState,
    apply_squinch_fsdp,
    install_squinch_replicate_hooks,
    register_squinch_ddp_hook,
)
from torchtitan_ext.config.job_config import CommSection
from torchtitan_ext.parallel.dims import ParallelDims

logger = logging.getLogger(__name__)

# A residual is one rank's float32 tensor; these hold the compressors that keep one (per module).
_PerModule = SquinchReduceScatter | SquinchReplicateHook
OWNER = ":owner"  # the name suffix of an all-reduce's second (owner's) residual


def _cpu(residual: torch.Tensor) -> torch.Tensor:
    return residual.detach().to("cpu", copy=True)


def _loaded(residual: torch.Tensor | None, device: torch.device) -> torch.Tensor | None:
    return None if residual is None else residual.to(device=device, dtype=torch.float32)


@dataclass
class GradientCompression:
    """What :func:`apply_gradient_compression` installed. ``after_backward``, when set, must run once the
    last micro-batch's backward is done and before the gradients are read (the post-backward replicate
    all-reduce, ``overlap=False`` only).

    ``all_reduces`` and ``per_module`` hold the installed compressors under stable names, so that
    :meth:`residual_state` / :meth:`load_residual_state` can carry this rank's error-feedback residuals
    through a checkpoint. Names: ``ddp/<param FQN>`` and, post-backward, ``replicate/<param FQN>`` (the
    all-reduce residuals, one per parameter), ``fsdp/<FSDP module FQN>`` (one per reduce-scatter) and
    ``replicate/<FSDP module FQN>`` (one per overlapped replicate hook; the root module is ``replicate/``),
    each after ``part<i>/`` when there are several model parts (pipeline stages); a replicate hook's owner
    residual (its second encoding's) under the hook's name + ``OWNER``. The residuals are only
    meaningful under the same parallel layout: the caller checks that before loading.
    """

    after_backward: Callable[[], None] | None = None
    # (name prefix, state, {parameter: FQN}) per compressed all-reduce.
    all_reduces: list[tuple[str, _AllReduceState, dict[torch.Tensor, str]]] = field(default_factory=list)
    per_module: dict[str, tuple[_PerModule, torch.device]] = field(default_factory=dict)

    def residual_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residuals by name, copied to the CPU (empty before the first step)."""
        out = {}
        for prefix, state, names in self.all_reduces:
            out.update({prefix + names[param]: _cpu(r) for param, r in state.residuals.items()})
        for name, (compressor, _) in self.per_module.items():
            if compressor.residual is not None:
                out[name] = _cpu(compressor.residual)
            if isinstance(compressor, SquinchReplicateHook) and compressor.owner_residual is not None:
                out[name + OWNER] = _cpu(compressor.owner_residual)
        return out

    def load_residual_state(self, residuals: dict[str, torch.Tensor]) -> None:
        """Replace the residuals with ``residuals`` (from :meth:`residual_state` under the same layout);
        the ones not named there restart from zero."""
        known = set()
        for prefix, state, names in self.all_reduces:
            state.residuals = {}
            for param, fqn in names.items():
                known.add(prefix + fqn)
                if (r := residuals.get(prefix + fqn)) is not None:
                    local = param.to_local() if isinstance(param, DTensor) else param
                    if r.numel() != local.numel():
                        raise ValueError(f"error-feedback residual {prefix + fqn}: {r.numel()} values for a "
                                         f"parameter of {local.numel()} on this rank")
                    state.residuals[param] = r.to(device=local.device, dtype=torch.float32).reshape(-1)
        for name, (compressor, device) in self.per_module.items():
            known.add(name)
            compressor.residual = _loaded(residuals.get(name), device)
            if isinstance(compressor, SquinchReplicateHook):
                known.add(name + OWNER)
                compressor.owner_residual = _loaded(residuals.get(name + OWNER), device)
        if unknown := sorted(set(residuals) - known):
            raise ValueError(f"error-feedback residuals of unknown tensors: {unknown[:5]}")


def replicate_all_reduce_replaced(comm: CommSection, dims: ParallelDims) -> bool:
    """True when HSDP's all-reduce over ``dp_replicate`` goes through Squinch: the model is then sharded over
    ``dp_shard`` alone (not as native HSDP) and Squinch averages the replicas."""
    return comm.gradient_compression == "squinch" and dims.fsdp_enabled and dims.dp_replicate > 1


def _param_names(part: nn.Module) -> dict[torch.Tensor, str]:
    return {param: name for name, param in part.named_parameters()}


def _module_device(part: nn.Module, fqn: str) -> torch.device:
    param = next(part.get_submodule(fqn).parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _install_replicate(compression: GradientCompression, model_parts: Sequence[nn.Module], prefixes: list[str],
                       dims: ParallelDims, options: dict, overlap: bool) -> None:
    """HSDP's replicate all-reduce in Squinch bytes: per-module hooks (``overlap``) or one call after the
    backward pass."""
    group = dims.submesh("dp_replicate").get_group()
    if overlap:
        for prefix, part in zip(prefixes, model_parts, strict=True):
            for fqn, hook in install_squinch_replicate_hooks(part, group, **options).items():
                compression.per_module[f"{prefix}replicate/{fqn}"] = (hook, _module_device(part, fqn))
        return
    params = [p for part in model_parts for p in part.parameters()]
    replicate = SquinchReplicateAllReduce(params, group, **options)
    compression.after_backward = replicate
    names = {p: prefix + "replicate/" + n for prefix, part in zip(prefixes, model_parts, strict=True)
             for p, n in _param_names(part).items()}
    compression.all_reduces.append(("", replicate.state, names))


def apply_gradient_compression(model_parts: Sequence[nn.Module], comm: CommSection, dims: ParallelDims,
                               stats: CommStats, log: Callable[[str], None] = logger.info,
                               overlap: bool = True) -> GradientCompression | None:
    """Install the gradient compression that ``comm`` (the ``[comm]`` config section) asks for.

    ``model_parts`` are the trainer's model parts after data parallelism was applied (``fully_shard``
    modules, or ``DistributedDataParallel`` wrappers when ``dims.ddp_enabled``). Returns None when there is
    nothing to compress (the reason is logged once through ``log``); otherwise the compressed reductions count
    their bytes into ``stats``. ``overlap=False`` runs HSDP's replicate all-reduce after the backward pass
    (``after_backward``) instead of per module during it: the same averages, kept to compare against.
    """
    if comm.gradient_compression == "none":
        return None
    if comm.gradient_compression != "squinch":
        raise ValueError(f"comm.gradient_compression = {comm.gradient_compression!r}: expected 'none' or 'squinch'")
    options = {"min_numel": comm.min_numel, "error_feedback": comm.error_feedback, "stats": stats}
    settings = f"min_numel {comm.min_numel}, error feedback {comm.error_feedback}"
    prefixes = [f"part{i}/" if len(model_parts) > 1 else "" for i in range(len(model_parts))]
    compression = GradientCompression()
    if dims.ddp_enabled:
        group = dims.submesh("dp").get_group()
        for prefix, part in zip(prefixes, model_parts, strict=True):
            state = register_squinch_ddp_hook(part, group, **options)
            compression.all_reduces.append((f"{prefix}ddp/", state, _param_names(part)))
        log(f"gradient compression: Squinch on the DDP all-reduce over {dims.dp} ranks ({settings})")
        return compression
    if not dims.fsdp_enabled:
        log("gradient compression: comm.gradient_compression = 'squinch' has nothing to compress "
            "(no data-parallel degree > 1, so no gradient reduction)")
        return None
    # FSDP shards over dp_shard x cp: the context parallel ranks' gradients of the same data are reduced too.
    shard = f"dp_shard x cp = {dims.dp_shard * dims.cp}" if dims.cp > 1 else f"dp_shard = {dims.dp_shard}"
    if replicate_all_reduce_replaced(comm, dims):
        _install_replicate(compression, model_parts, prefixes, dims, options, overlap)
        when = "per module, overlapped with the backward" if overlap else "after the backward"
        log(f"gradient compression: Squinch on the all-reduce over dp_replicate = {dims.dp_replicate} ({when}); "
            f"the reduce-scatter over {shard} stays uncompressed ({settings})")
        return compression
    for prefix, part in zip(prefixes, model_parts, strict=True):
        for fqn, reduce_scatter in apply_squinch_fsdp(part, **options).items():
            compression.per_module[f"{prefix}fsdp/{fqn}"] = (reduce_scatter, _module_device(part, fqn))
    log(f"gradient compression: Squinch on the FSDP2 reduce-scatter over {shard} ranks ({settings})")
    return compression
