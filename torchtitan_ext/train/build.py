"""The staged builder: config -> runtime and mesh -> data -> model (args -> meta model -> converters ->
parallelize -> materialise and initialise) -> training pieces. Each stage is a function with explicit inputs
and outputs; ``build_run`` calls them in order for the trainer, and the tools (teacher pass, quant export)
call the stages they need."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging
import os
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn as nn

from torchtitan_ext.checkpoint.run_folder import would_resume
from torchtitan_ext.comm.compressed_collectives import CommStats
from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.data.registry import DataBundle, build_loaders, build_tokenizer
from torchtitan_ext.data.shards import loader_shards, scan_shards
from torchtitan_ext.distill.student import sidecar_factory
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.eval.sliding import check_trainer_stride
from torchtitan_ext.models.args import ComputeOptions, ModelArgs
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.models.flavors import resolve_model_args
from torchtitan_ext.models.param_count import count_params
from torchtitan_ext.ops.attention_backend import attention_backend, causal_kernel, check_math_backend
from torchtitan_ext.ops.kernels import check_kernels
from torchtitan_ext.parallel.compression import apply_gradient_compression
from torchtitan_ext.parallel.context_parallel import check_cp
from torchtitan_ext.parallel.dims import ParallelDims
from torchtitan_ext.parallel.ep import check_ep
from torchtitan_ext.parallel.fsdp import apply_ddp
from torchtitan_ext.parallel.init import materialize_and_init
from torchtitan_ext.parallel.parallelize import parallelize_decoder
from torchtitan_ext.parallel.pp import check_schedule, split_stages
from torchtitan_ext.parallel.rendezvous import join
from torchtitan_ext.parallel.tp import check_tp
from torchtitan_ext.quant.float8 import check_float8_supported
from torchtitan_ext.quant.swap import convert_model
from torchtitan_ext.train.batch_warmup import BatchWarmup
from torchtitan_ext.train.determinism import make_deterministic
from torchtitan_ext.train.ema import EMA
from torchtitan_ext.train.nonfinite import NonFiniteGuard
from torchtitan_ext.train.optim import Optimizers
from torchtitan_ext.train.spike_guard import SpikeGuard

log = logging.getLogger(__name__)


class Runtime(NamedTuple):
    """Where this process runs: its device, its rank and the mesh of parallel dimensions."""
    device: torch.device
    rank: int
    dims: ParallelDims


class BatchPlan(NamedTuple):
    """How one optimizer step's global batch splits into micro-batches (changing under batch warmup)."""
    accum_steps: int
    global_batch_size: int
    tokens_per_micro: int  # one micro-batch over all data-parallel ranks
    warmup: BatchWarmup | None

    def tokens_through(self, step: int) -> int:
        """Training tokens consumed by steps 1..step (all ranks), batch warmup included."""
        if self.warmup is not None:
            return self.warmup.tokens_through(step)
        return step * self.accum_steps * self.tokens_per_micro


@dataclasses.dataclass
class BuiltModel:
    """The model laid out on this rank: one part, or this rank's pipeline stages."""
    args: ModelArgs
    parts: list[nn.Module]
    counts: dict[str, int]
    stages: list[tuple[int, nn.Module]] | None  # (stage id, module) under pipeline parallelism
    loss_parallel: bool  # TP without PP: the loss runs on vocabulary-sharded logits


class TrainingParts(NamedTuple):
    optimizers: Optimizers
    spike_guard: SpikeGuard
    nonfinite: NonFiniteGuard
    ema: EMA | None
    compression: object | None  # parallel.compression.GradientCompression, or None
    comm_stats: CommStats | None


class BuiltRun(NamedTuple):
    runtime: Runtime
    batches: BatchPlan
    tokenizer: object
    data: DataBundle
    model: BuiltModel
    training: TrainingParts


def init_distributed(device_type: str, timeout_seconds: int = 1800) -> None:
    """torchrun sets RANK/WORLD_SIZE; a plain ``python -m`` run becomes a world of one. ``timeout_seconds``:
    how long a collective may hang (a dead peer) before the job fails and torchrun can restart it, and by
    default how long the processes wait for each other at the start (``parallel.rendezvous``)."""
    if dist.is_initialized():
        return
    backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if "RANK" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return
    store, rank, world = join(timeout_seconds)
    store.set_timeout(timeout)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # torchrun keeps its store across restarts: a fresh prefix hides the dead workers' keys
        store = dist.PrefixStore(f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity, bounded by a cgroup v2 CPU quota (a container's)."""
    cores = len(os.sched_getaffinity(0))
    with contextlib.suppress(OSError, ValueError):
        quota, period = open("/sys/fs/cgroup/cpu.max").read().split()
        if quota != "max":
            cores = min(cores, max(1, int(quota) // int(period)))
    return cores


def set_cpu_threads() -> str:
    """torch's intra-op threads of a CPU process: ``OMP_NUM_THREADS`` when set, else the usable cores shared
    evenly by this machine's processes of the job (``LOCAL_WORLD_SIZE``), at least one each; torch's default
    gives every process every core, and processes that share cores spin against each other. Returns what
    the start-up line says about it."""
    if not os.environ.get("OMP_NUM_THREADS"):
        cores, local = usable_cores(), int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        torch.set_num_threads(max(1, cores // local))
        why = f"{cores} cores / {local} processes here; OMP_NUM_THREADS overrides"
    else:
        why = "OMP_NUM_THREADS"
    n = torch.get_num_threads()
    return f"{n} thread{'s' if n > 1 else ''} per process ({why})"


def build_runtime(cfg: JobConfig) -> Runtime:
    """Pick the device, check what it can run, start the process group and build the mesh."""
    want_cuda = cfg.job.device == "cuda" or (cfg.job.device == "auto" and torch.cuda.is_available())
    if want_cuda and not torch.cuda.is_available():
        raise ConfigError("job.device = 'cuda' but no CUDA device is visible")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if want_cuda else torch.device("cpu")
    check_float8_supported(cfg.float8, device, cfg.training.fused_linear_ce, tp=cfg.parallelism.tp)
    if (why := check_kernels(cfg.training.kernels, device)) is not None:
        raise ConfigError(why)
    if cfg.training.deterministic:  # before CUDA starts: cuBLAS reads its workspace setting once
        make_deterministic(cfg.job.seed)
    if want_cuda:
        torch.cuda.set_device(device)
    threads = f", {set_cpu_threads()}" if device.type == "cpu" else ""
    init_distributed(device.type, cfg.comm.timeout_seconds)
    dims = ParallelDims.from_config(cfg.parallelism, dist.get_world_size())
    log.info(f"parallelism: {dims.describe()}; device {device.type}{threads}")
    return Runtime(device, dist.get_rank(), dims)


def plan_batches(cfg: JobConfig, dims: ParallelDims) -> BatchPlan:
    """Micro-batches per step from the global batch and the data-parallel degree."""
    t = cfg.training
    per_step = t.local_batch_size * dims.dp
    gbs = per_step if t.global_batch_size == -1 else t.global_batch_size
    if gbs % per_step:
        raise ConfigError(f"training.global_batch_size = {gbs} must be a multiple of local_batch_size x "
                          f"data-parallel degree = {t.local_batch_size} x {dims.dp}")
    accum = gbs // per_step
    tokens_per_micro = per_step * t.seq_len
    warmup = BatchWarmup(accum, min(t.batch_warmup_start, accum), tokens_per_micro, t.batch_warmup_tokens,
                         t.steps) if t.batch_warmup_tokens else None
    return BatchPlan(accum, gbs, tokens_per_micro, warmup)


def build_data(cfg: JobConfig, dims: ParallelDims) -> tuple[object, ModelArgs, DataBundle]:
    """(tokenizer, model arguments, loaders): the vocabulary sizes the model, whose vocabulary bounds the
    token ids the loaders accept; every shard is scanned now, so a bad one stops the job before any work.
    Rank 0 keeps the run's tokenizer in ``<dump_folder>/tokenizer/``; a resume whose tokenizer differs stops here."""
    tokenizer = build_tokenizer(cfg.data, cfg.job.dump_folder, save=not dist.is_initialized() or dist.get_rank() == 0,
                                resume=would_resume(cfg))
    if hasattr(tokenizer, "describe"):
        log.info(f"{tokenizer.describe()}; the run's copy: {os.path.join(cfg.job.dump_folder, 'tokenizer')}")
    args = resolve_model_args(cfg, tokenizer.vocab_size)
    data = build_loaders(cfg, tokenizer, dp_rank=dims.dp_rank, dp_world_size=dims.dp, vocab_limit=args.vocab_size,
                         sidecars=sidecar_factory(cfg))
    check_trainer_stride(cfg, data.val_loader)
    scan_shards(loader_shards(data.loader) + loader_shards(data.val_loader), args.vocab_size,
                os.path.expanduser(cfg.data.cache_dir))
    return tokenizer, args, data


def compute_options(cfg: JobConfig, args: ModelArgs, dims: ParallelDims, device: torch.device) -> ComputeOptions:
    """How the model computes in this run. Under TP the residual stream and the norms are DTensors, which the
    fused norm kernels do not take: there only the activation is fused."""
    triton = cfg.training.kernels == "triton"
    # a rank's heads over the whole sequence: all-to-all CP's attention call, the largest any layout makes
    check_math_backend(cfg.training.attention_backend, device, cfg.training.local_batch_size,
                       max(1, args.n_heads // (dims.tp * dims.cp)), cfg.training.seq_len)
    return ComputeOptions(fused_norm=triton and dims.tp == 1, fused_activation=triton,
                          attention_z_reg=cfg.training.attention_z_reg,
                          return_hidden=cfg.training.fused_linear_ce,
                          attention_kernel=causal_kernel(cfg.training.attention_backend, device))


def check_layout(cfg: JobConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """The model's shape against the TP, EP and CP degrees, one line each."""
    try:
        if dims.tp > 1:
            check_tp(args, dims.tp)
            if cfg.training.seq_len % dims.tp:  # sequence parallel splits each sequence evenly over TP ranks
                raise ValueError(f"training.seq_len = {cfg.training.seq_len} must be divisible by "
                                 f"parallelism.tp = {dims.tp} (sequence parallel shards the sequence)")
        if dims.ep > 1:
            check_ep(args.n_experts, dims.ep, dims.tp)
        if cfg.parallelism.ep_rebalance_steps > 0 and not dims.experts_alone:
            raise ValueError(f"parallelism.ep_rebalance_steps = {cfg.parallelism.ep_rebalance_steps} needs expert "
                              f"parallelism over every data-parallel rank (ep = dp_shard > 1, dp_replicate = 1, "
                              f"pp = 1); got ep {dims.ep}, dp_shard {dims.dp_shard}, dp_replicate "
                              f"{dims.dp_replicate}, pp {dims.pp}")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    check_cp(cfg, args, dims)


def pp_microbatches(cfg: JobConfig, dims: ParallelDims) -> int:
    p = cfg.parallelism
    return p.pp_microbatches or dims.pp * p.pp_virtual_stages


def build_model(cfg: JobConfig, runtime: Runtime, args: ModelArgs) -> BuiltModel:
    """Meta model -> converters -> pipeline split -> parallelize -> materialise and initialise (every weight
    depends only on the seed and its name, so the same seed gives the same model on any layout)."""
    dims, device = runtime.dims, runtime.device
    check_layout(cfg, args, dims)
    with torch.device("meta"):
        model = Decoder(args, compute_options(cfg, args, dims, device))
    counts = count_params(args)
    log.info(f"model {cfg.model.flavor}: {counts['total']:,} parameters ({counts['active']:,} active per token, "
             f"{counts['embedding']:,} embedding); KV cache {counts['kv_per_token']:,} values per token")
    for line in convert_model(model, cfg):  # before TP and FSDP, which shard the swapped modules' weights
        log.info(line)
    plan = model.init_plan()
    loss_parallel = dims.tp > 1 and dims.pp == 1  # a last pipeline stage gathers its logits
    stages = None
    parts = [model]
    if dims.pp > 1:
        p = cfg.parallelism
        ac = cfg.activation_checkpoint
        check_schedule(p.pp_schedule, p.pp_virtual_stages, pp_microbatches(cfg, dims), dims.pp,
                       cfg.training.local_batch_size, op_level_sac=ac.mode == "selective" and ac.selective_every == 0,
                       compiled=cfg.training.compile)
        stages = split_stages(model, dims.submesh("pp").get_local_rank(), dims.pp, p.pp_virtual_stages,
                              p.pp_schedule, p.pp_split_points)
        parts = [m for _, m in stages]
    for part in parts:
        parallelize_decoder(part, dims, cfg, on_gpu=device.type == "cuda", loss_parallel=loss_parallel)
        materialize_and_init(part, device, cfg.job.seed, plan)
        part.init_buffers(device)
        part.train()
    return BuiltModel(args, parts, counts, stages, loss_parallel)


def build_training(cfg: JobConfig, runtime: Runtime, model: BuiltModel) -> TrainingParts:
    """DDP wrapping and gradient compression (they replace the parts), optimizers, guards and the EMA."""
    dims = runtime.dims
    if dims.ddp_enabled:
        model.parts = [apply_ddp(m, dims.submesh("dp")) for m in model.parts]
    comm_stats = CommStats()  # gradient bytes handed to the data-parallel collectives
    compression = apply_gradient_compression(model.parts, cfg.comm, dims, comm_stats, log=log.info)
    t = cfg.training
    if cfg.eval.use_ema and not cfg.ema.decay:
        raise ConfigError("eval.use_ema = true needs an EMA: set ema.decay (for example 0.999)")
    ema = EMA(model.parts, cfg.ema.decay, cfg.ema.every, cfg.ema.start_step) if cfg.ema.decay else None
    optimizers = Optimizers(model.parts, cfg.optimizer, model.args)
    log.info(optimizers.summary())
    return TrainingParts(
        optimizers=optimizers,
        spike_guard=SpikeGuard(t.spike_factor, t.spike_window, t.spike_lr_scale, t.spike_guard),
        nonfinite=NonFiniteGuard(t.max_skipped_steps, log.info),
        ema=ema, compression=compression, comm_stats=comm_stats if compression is not None else None)


def forward_context(cfg: JobConfig, runtime: Runtime) -> contextlib.ExitStack:
    """What every forward pass runs under: bf16 autocast where FSDP does not cast the parameters itself (one
    GPU, DDP), and the chosen SDPA backend."""
    stack = contextlib.ExitStack()
    if runtime.device.type == "cuda" and not runtime.dims.fsdp_enabled and \
            cfg.training.mixed_precision_param == "bfloat16":
        stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
    stack.enter_context(attention_backend(cfg.training.attention_backend, runtime.device))
    return stack


def check_mode(cfg: JobConfig) -> None:
    """``training.mode = "sft"`` fine-tunes a trained model on conversations."""
    if cfg.training.mode == "sft" and cfg.data.dataset != "chat":
        raise ConfigError(f"training.mode = 'sft' needs data.dataset = 'chat' (got {cfg.data.dataset!r})")
    if cfg.training.mode == "sft" and not cfg.checkpoint.initial_load_path:
        raise ConfigError("training.mode = 'sft' needs checkpoint.initial_load_path: the model to fine-tune (a "
                          "Hugging Face folder or one of our dump folders)")


def build_run(cfg: JobConfig) -> BuiltRun:
    """Every stage, in order, for the trainer."""
    check_mode(cfg)
    runtime = build_runtime(cfg)
    batches = plan_batches(cfg, runtime.dims)
    tokenizer, args, data = build_data(cfg, runtime.dims)
    model = build_model(cfg, runtime, args)
    training = build_training(cfg, runtime, model)
    return BuiltRun(runtime, batches, tokenizer, data, model, training)
