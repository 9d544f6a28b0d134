"""Parallel degrees -> one DeviceMesh.

World layout, outermost first: ``pp x dp_replicate x dp_shard x cp x tp``. Expert parallelism is carved out of
``dp_shard``: ``dp_shard = dp_shard_mod_ep x ep``, so experts are sharded over ``ep`` and FSDP-sharded over
``dp_shard_mod_ep`` while every other parameter is FSDP-sharded over all of ``dp_shard``. Context parallel
ranks (``cp``) hold different parts of the same sequences: they read the same batch (the data-parallel rank
ignores ``cp``), and FSDP shards over ``dp_shard x cp`` (``dp_shard_cp``), as torchtitan does.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import cached_property

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torchtitan_ext.config.job_config import ParallelismSection
from torchtitan_ext.errors import UserError


class ParallelDimsError(UserError):
    """Degrees that do not fit the world size; one line naming the keys and values."""


LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")  # what torchrun sets for each process


def launch_env() -> dict[str, int]:
    """The launcher's variables that are set (``LAUNCH_VARS``), as integers; one ``UserError`` line naming the
    variable and its value when one is not a whole number (ranks >= 0, sizes >= 1) or a rank is not below its
    size, and for a RANK without WORLD_SIZE or a WORLD_SIZE above 1 without RANK (that process would train alone,
    as a world of one). A plain ``python -m`` run sets none of them."""
    values = {}
    for name in LAUNCH_VARS:
        if (raw := os.environ.get(name)) is None:
            continue
        lowest = 1 if name.endswith("SIZE") else 0
        try:
            values[name] = int(raw.strip())
        except ValueError:
            values[name] = lowest - 1
        if values[name] < lowest:
            raise UserError(f"environment variable {name}={raw!r}: expected a whole number >= {lowest} "
                            "(torchrun sets it; unset it for a plain one-process run)")
    for rank, size in (("RANK", "WORLD_SIZE"), ("LOCAL_RANK", "LOCAL_WORLD_SIZE")):
        if rank in values and size in values and values[rank] >= values[size]:
            raise UserError(f"environment variable {rank}={values[rank]}: expected below {size}={values[size]}")
    if "RANK" in values and "WORLD_SIZE" not in values:
        raise UserError(f"environment variable RANK={values['RANK']} without WORLD_SIZE: a process of a job needs "
                        "both (torchrun sets them; unset RANK for a plain one-process run)")
    if values.get("WORLD_SIZE", 1) > 1 and "RANK" not in values:
        raise UserError(f"environment variable WORLD_SIZE={values['WORLD_SIZE']} without RANK: each of the "
                        f"{values['WORLD_SIZE']} processes needs its RANK (torchrun or launch/train.sh sets both); "
                        "unset WORLD_SIZE for a plain one-process run")
    return values


@dataclass
class ParallelDims:
    dp_replicate: int
    dp_shard: int
    tp: int
    pp: int
    ep: int
    world_size: int
    dp_mode: str = "fsdp"
    cp: int = 1

    @classmethod
    def from_config(cls, p: ParallelismSection, world_size: int) -> ParallelDims:
        """The degrees of ``p`` on ``world_size`` ranks; a ``-1`` (``dp_shard``, or ``dp_replicate``) takes the
        ranks left after the other degrees, so one config runs on any multiple of their product."""
        for name in ("dp_replicate", "dp_shard"):
            if getattr(p, name) == 0 or getattr(p, name) < -1:
                raise ParallelDimsError(f"parallelism.{name} = {getattr(p, name)}: expected >= 1, or -1 for the "
                                        "ranks left after the other degrees")
        if p.dp_replicate == -1 and p.dp_shard == -1:
            raise ParallelDimsError("parallelism: dp_replicate and dp_shard are both -1 (the rest of the world "
                                    "size); set one of them")
        sizes = {"dp_replicate": p.dp_replicate, "dp_shard": p.dp_shard}
        if -1 in sizes.values():
            rest = "dp_replicate" if sizes["dp_replicate"] == -1 else "dp_shard"
            cp = {"cp": p.cp} if p.cp > 1 else {}  # named only when used
            fixed = [(k, v) for k, v in {**sizes, **cp, "tp": p.tp, "pp": p.pp}.items() if v != -1]
            others = math.prod(v for _, v in fixed)
            if world_size < 1 or world_size % others:
                raise ParallelDimsError(
                    f"parallelism: {' x '.join(f'{k}({v})' for k, v in fixed)} = {others}, but the world size is "
                    f"{world_size}, not a multiple of it ({rest} = -1 takes the ranks left)")
            sizes[rest] = world_size // others
        return cls(sizes["dp_replicate"], sizes["dp_shard"], p.tp, p.pp, p.ep, world_size, p.dp_mode, p.cp)

    def __post_init__(self) -> None:
        product = self.dp_replicate * self.dp_shard * self.cp * self.tp * self.pp
        if product != self.world_size:
            cp = f" x cp({self.cp})" if self.cp > 1 else ""
            raise ParallelDimsError(
                f"parallelism: dp_replicate({self.dp_replicate}) x dp_shard({self.dp_shard}){cp} x tp({self.tp}) "
                f"x pp({self.pp}) = {product}, but the world size is {self.world_size}; "
                "set dp_shard = -1 to use the rest")
        if self.dp_shard % self.ep:
            raise ParallelDimsError(
                f"parallelism.ep = {self.ep} must divide dp_shard = {self.dp_shard} "
                "(expert parallelism is carved out of the FSDP ranks)")
        if self.dp_mode == "ddp" and (self.tp > 1 or self.pp > 1 or self.ep > 1):
            raise ParallelDimsError("parallelism.dp_mode = 'ddp' supports data parallelism only; "
                                    "use dp_mode = 'fsdp' with tp, pp or ep")
        if self.dp_mode == "ddp" and self.cp > 1:
            raise ParallelDimsError(f"parallelism.cp = {self.cp} needs dp_mode = 'fsdp' (FSDP shards over "
                                    "dp_shard x cp); dp_mode = 'ddp' does not combine with cp")

    @property
    def dp(self) -> int:
        """Data-parallel degree: ranks that read different data."""
        return self.dp_replicate * self.dp_shard

    @property
    def experts_alone(self) -> bool:
        """Each expert lives on one rank only (EP spans dp_shard; no replicas, CP ranks or pipeline): its gradient needs
        no data-parallel reduction, and FSDP leaves the experts out (``parallel/parallelize.py``). Under
        pipelining they stay in a one-rank unit, which keeps their bf16 copy over the micro-batches."""
        return self.ep > 1 and self.ep == self.dp_shard and self.dp_replicate == 1 and self.pp == 1 and self.cp == 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_mode == "fsdp" and (self.dp_shard > 1 or self.dp_replicate > 1 or self.cp > 1)

    @property
    def ddp_enabled(self) -> bool:
        return self.dp_mode == "ddp" and self.dp > 1

    @cached_property
    def mesh(self) -> DeviceMesh:
        """The world mesh with every dimension, plus flattened views ``dp``, ``dp_shard`` and, with TP,
        ``dp_shard_tp`` / ``dp_tp`` (the ranks that route different tokens through a MoDE layer: its
        parameters are sharded over the first, its expert loads summed over the second) and, with EP,
        ``ep_tp`` (the ranks its experts are sharded over). ``dp_shard_cp`` (FSDP's shard ranks) and ``dp_cp``
        (the ranks whose losses are averaged) add the context parallel ranks; without CP they are ``dp_shard``
        and ``dp``. With CP and TP, ``dp_cp_tp``: every rank of a pipeline stage."""
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        names = ["pp", "dp_replicate", "dp_shard_mod_ep", "cp", "ep", "tp"]  # cp before ep: see dp_shard_mod_ep_cp
        sizes = [self.pp, self.dp_replicate, self.dp_shard // self.ep, self.cp, self.ep, self.tp]
        mesh = init_device_mesh(device_type, tuple(sizes), mesh_dim_names=tuple(names))
        self._flat = {
            "dp_shard": mesh[("dp_shard_mod_ep", "ep")]._flatten("dp_shard"),
            "dp": mesh[("dp_replicate", "dp_shard_mod_ep", "ep")]._flatten("dp"),
        }
        if self.cp > 1:
            self._flat["dp_shard_cp"] = mesh[("dp_shard_mod_ep", "cp", "ep")]._flatten("dp_shard_cp")
            self._flat["dp_cp"] = mesh[("dp_replicate", "dp_shard_mod_ep", "cp", "ep")]._flatten("dp_cp")
            if self.ep > 1:  # the ranks holding the same experts: their data-parallel and CP peers (a mesh
                # dimension before ep, so that the experts' (this, ep) mesh keeps the world mesh's order)
                self._flat["dp_shard_mod_ep_cp"] = mesh[("dp_shard_mod_ep", "cp")]._flatten("dp_shard_mod_ep_cp")
        else:
            self._flat["dp_shard_cp"], self._flat["dp_cp"] = self._flat["dp_shard"], self._flat["dp"]
        if self.tp > 1:
            self._flat["dp_shard_tp"] = mesh[("dp_shard_mod_ep", "ep", "tp")]._flatten("dp_shard_tp")
            self._flat["dp_tp"] = mesh[("dp_replicate", "dp_shard_mod_ep", "ep", "tp")]._flatten("dp_tp")
            if self.ep > 1:
                self._flat["ep_tp"] = mesh[("ep", "tp")]._flatten("ep_tp")
            if self.cp > 1:
                self._flat["dp_cp_tp"] = mesh[("dp_replicate", "dp_shard_mod_ep", "cp", "ep", "tp")]._flatten(
                    "dp_cp_tp")
        return mesh

    def routing_group_name(self) -> str:
        """The flattened dimension of the ranks that route different tokens through a MoDE layer (each its
        part of the batch, of the sequence under CP, of the sequence's slice under TP's sequence parallel)."""
        if self.tp > 1:
            return "dp_cp_tp" if self.cp > 1 else "dp_tp"
        return "dp_cp"

    def submesh(self, *names: str) -> DeviceMesh:
        """A 1-D or N-D view of the world mesh; flattened 1-D meshes are kept from their creation."""
        mesh = self.mesh
        if len(names) == 1:
            return self._flat[names[0]] if names[0] in self._flat else mesh[names[0]]
        if names in (("dp_replicate", "dp_shard"), ("dp_replicate", "dp_shard_cp")) and self.ep == 1 and self.cp == 1:
            return mesh[("dp_replicate", "dp_shard_mod_ep")]  # the same ranks, no flattened dim needed
        if names == ("dp_replicate", "dp_shard_cp") and self.cp == 1:
            names = ("dp_replicate", "dp_shard")
        return mesh[names]

    @property
    def dp_rank(self) -> int:
        return self.submesh("dp").get_local_rank()

    def describe(self) -> str:
        cp = f" x cp {self.cp}" if self.cp > 1 else ""
        return (f"world {self.world_size} = pp {self.pp} x dp_replicate {self.dp_replicate} x dp_shard "
                f"{self.dp_shard} (ep {self.ep}){cp} x tp {self.tp}; data parallel {self.dp} ({self.dp_mode})")
