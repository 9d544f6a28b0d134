"""The training job: config -> mesh -> model on meta -> parallelize -> materialise -> data, optimizer,
checkpoint -> loop. Each stage is one call; the loop reads like the list in the README."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan_ext.checkpoint.manager import CheckpointManager, ModelParts
from torchtitan_ext.comm.compressed_collectives import CommStats, apply_gradient_compression
from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.config.loader import ConfigError, to_toml
from torchtitan_ext.data.loader import build_data
from torchtitan_ext.data.shards import loader_shards, scan_shards
from torchtitan_ext.distill.student import Distillation
from torchtitan_ext.errors import RunStopped
from torchtitan_ext.eval.bpb import batch_sums, summarize, token_bytes
from torchtitan_ext.eval.sliding import check_trainer_stride, token_weighted_mean, trainer_batches
from torchtitan_ext.metrics.logger import MetricsLogger, flops_per_token, peak_flops
from torchtitan_ext.metrics.profiling import Profiling
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.models.flavors import resolve_model_args
from torchtitan_ext.models.mode import AuxLoss
from torchtitan_ext.models.param_count import count_params
from torchtitan_ext.ops.attention_backend import attention_backend
from torchtitan_ext.ops.kernels import check_kernels, use_triton_kernels
from torchtitan_ext.parallel.dims import ParallelDims
from torchtitan_ext.parallel.ep import check_ep
from torchtitan_ext.parallel.fsdp import apply_ddp
from torchtitan_ext.parallel.grad_norm import grad_norm
from torchtitan_ext.parallel.init import materialize_and_init
from torchtitan_ext.parallel.parallelize import parallelize_decoder
from torchtitan_ext.parallel.pp import build_schedule, check_schedule, split_stages
from torchtitan_ext.parallel.tp import check_tp
from torchtitan_ext.quant.float8 import check_float8_supported, precompute_float8_scales
from torchtitan_ext.train.attention_features import AttentionFeatures, pipeline_mask_args
from torchtitan_ext.train.batch_warmup import BatchWarmup
from torchtitan_ext.train.determinism import make_deterministic
from torchtitan_ext.train.ema import EMA
from torchtitan_ext.train.losses import cross_entropy_loss, fused_head_loss
from torchtitan_ext.train.lr_schedule import lr_multiplier
from torchtitan_ext.train.moe_balance import balance_experts, set_token_domains
from torchtitan_ext.train.nonfinite import NonFiniteGuard
from torchtitan_ext.train.optim import Optimizers
from torchtitan_ext.train.preemption import Preemption
from torchtitan_ext.train.spike_guard import SpikeGuard


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (loss parallel returns a replicated DTensor)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


class TrainingDiverged(RunStopped):
    """The loss became NaN or Inf; the run stops without saving."""


@dataclasses.dataclass
class QueuedStep:
    """A step handed to the device: its scalars stay there until ``Trainer.settle`` reads them."""
    step: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    lr: float


def init_distributed(device_type: str, timeout_seconds: int = 1800) -> None:
    """torchrun sets RANK/WORLD_SIZE; a plain ``python -m`` run becomes a world of one. ``timeout_seconds``:
    how long a collective may hang (a dead peer) before the job fails and torchrun can restart it."""
    if dist.is_initialized():
        return
    backend = "cuda:nccl,cpu:gloo" if device_type == "cuda" else "gloo"
    timeout = datetime.timedelta(seconds=timeout_seconds)
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:  # torchrun keeps its store across restarts: a fresh prefix
        store, rank, world = next(dist.rendezvous("env://", timeout=timeout))  # hides the dead workers' keys
        store = dist.PrefixStore(f"attempt-{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world, timeout=timeout)
    elif "RANK" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)


class Trainer:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        want_cuda = cfg.job.device == "cuda" or (cfg.job.device == "auto" and torch.cuda.is_available())
        if want_cuda and not torch.cuda.is_available():
            raise ConfigError("job.device = 'cuda' but no CUDA device is visible")
        self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if want_cuda \
            else torch.device("cpu")
        check_float8_supported(cfg.float8, self.device, cfg.training.fused_linear_ce)
        if (why := check_kernels(cfg.training.kernels, self.device)) is not None:
            raise ConfigError(why)
        if cfg.training.deterministic:  # before CUDA starts: cuBLAS reads its workspace setting once
            make_deterministic(cfg.job.seed)
        if want_cuda:
            torch.cuda.set_device(self.device)
        init_distributed(self.device.type, cfg.comm.timeout_seconds)
        self.rank, world = dist.get_rank(), dist.get_world_size()
        self.dims = dims = ParallelDims.from_config(cfg.parallelism, world)
        t = cfg.training
        per_step = t.local_batch_size * dims.dp
        gbs = per_step if t.global_batch_size == -1 else t.global_batch_size
        if gbs % per_step:
            raise ConfigError(f"training.global_batch_size = {gbs} must be a multiple of local_batch_size x "
                              f"data-parallel degree = {t.local_batch_size} x {dims.dp}")
        self.accum_steps = gbs // per_step
        self.global_batch_size = gbs
        self.tokens_per_micro = per_step * t.seq_len  # one micro-batch over all data-parallel ranks
        self.batch_warmup = BatchWarmup(self.accum_steps, min(t.batch_warmup_start, self.accum_steps),
                                        self.tokens_per_micro, t.batch_warmup_tokens, t.steps) \
            if t.batch_warmup_tokens else None
        if cfg.eval.use_ema and not cfg.ema.decay:
            raise ConfigError("eval.use_ema = true needs an EMA: set ema.decay (for example 0.999)")

        self.log(f"parallelism: {dims.describe()}; device {self.device.type}")
        self.profiling = Profiling(cfg.profiling, cfg.job.dump_folder, self.rank, self.device, self.log)

        d = cfg.data
        self.tokenizer, self.loader, self.val_loader = build_data(
            dataset=d.dataset, train_path=d.train_path, val_path=d.val_path, tokenizer=d.tokenizer,
            tokenizer_vocab_size=d.tokenizer_vocab_size, cache_dir=os.path.expanduser(d.cache_dir),
            seq_len=t.seq_len, local_batch_size=t.local_batch_size, dp_rank=dims.dp_rank,
            attention=d.attention, position_reset=d.position_reset,
            dp_world_size=dims.dp, seed=cfg.job.seed, shuffle=d.shuffle, packing=d.packing,
            domains=dict(domains=d.domains, mixing=d.mixing, rate=d.mixing_rate, floor=d.mixing_floor,
                         cap=d.mixing_cap))
        check_trainer_stride(cfg, self.val_loader)

        self.model_args = margs = resolve_model_args(cfg, self.tokenizer.vocab_size)
        self.token_bytes = token_bytes(self.tokenizer, margs.vocab_size)  # for val_bpb
        if self.token_bytes is not None:
            self.token_bytes = self.token_bytes.to(self.device)
        for loader in (self.loader, self.val_loader):
            if loader is not None:
                loader.vocab_limit = margs.vocab_size
        scan_shards(loader_shards(self.loader) + loader_shards(self.val_loader), margs.vocab_size,
                    os.path.expanduser(d.cache_dir))  # a bad shard stops the job now, not at its batch
        with torch.device("meta"):
            model = Decoder(margs)
        if cfg.training.kernels == "triton":
            use_triton_kernels(model, dims.tp)
        counts = count_params(margs)
        self.log(f"model {cfg.model.flavor}: {counts['total']:,} parameters "
                 f"({counts['active']:,} active per token, {counts['embedding']:,} embedding); KV cache "
                 f"{counts['kv_per_token']:,} values per token")
        plan = model.init_plan()
        self.loss_parallel = dims.tp > 1 and dims.pp == 1  # a last pipeline stage gathers its logits
        try:
            if dims.tp > 1:
                check_tp(margs, dims.tp)
                if t.seq_len % dims.tp:  # sequence parallel splits each sequence evenly over the TP ranks
                    raise ValueError(f"training.seq_len = {t.seq_len} must be divisible by parallelism.tp = "
                                     f"{dims.tp} (sequence parallel shards the sequence)")
            if dims.ep > 1:
                check_ep(margs.n_experts, dims.ep, dims.tp)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.pp_schedule = None
        if dims.pp > 1:
            p = cfg.parallelism
            self.pp_microbatches = p.pp_microbatches or dims.pp * p.pp_virtual_stages
            check_schedule(p.pp_schedule, p.pp_virtual_stages, self.pp_microbatches, dims.pp, t.local_batch_size)
            stages = split_stages(model, dims.submesh("pp").get_local_rank(), dims.pp, p.pp_virtual_stages,
                                  p.pp_schedule, p.pp_split_points)
            self.model_parts = [m for _, m in stages]
        else:
            self.model_parts = [model]
        for part in self.model_parts:
            parallelize_decoder(part, dims, cfg, on_gpu=self.device.type == "cuda",
                                loss_parallel=self.loss_parallel)
            materialize_and_init(part, self.device, cfg.job.seed, plan)
            part.init_buffers(self.device)
            part.train()
        if dims.pp > 1:
            n_stages = dims.pp * cfg.parallelism.pp_virtual_stages
            self.pp_has_first = any(sid == 0 for sid, _ in stages)
            self.pp_has_last = any(sid == n_stages - 1 for sid, _ in stages)
            self.pp_schedule = build_schedule(
                stages, n_stages, self.device, dims.submesh("pp").get_group(), cfg.parallelism.pp_schedule,
                self.pp_microbatches, self._pipeline_loss, carry_mask=cfg.data.attention != "causal")
        if dims.ddp_enabled:
            self.model_parts = [apply_ddp(m, dims.submesh("dp")) for m in self.model_parts]
        self.comm_stats: CommStats | None = CommStats()  # gradient bytes handed to the DP collectives
        self.compression = apply_gradient_compression(self.model_parts, cfg.comm, dims, self.comm_stats,
                                                      log=self.log)
        if self.compression is None:
            self.comm_stats = None
        # Balancing losses scale like the main loss; under TP each rank averages them over its own slice of
        # the sequence and the slices' gradients are summed (see parallel/fsdp.py).
        AuxLoss.scale = 1.0 / (self.accum_steps * dims.tp)
        self.has_moe = margs.n_experts > 0
        self.use_autocast = self.device.type == "cuda" and not dims.fsdp_enabled and \
            cfg.training.mixed_precision_param == "bfloat16"

        # Compiled, the loss fuses the float32 upcast of the logits into the cross-entropy kernels.
        compile_loss = cfg.training.compile and not self.loss_parallel
        self.loss_fn = torch.compile(cross_entropy_loss) if compile_loss else cross_entropy_loss
        if t.fused_linear_ce:  # the model returns hidden states; the loss applies the head in token chunks
            self.loss_fn = fused_head_loss(self.model_parts, dims, t.fused_linear_ce_chunk, margs.logit_softcap)
        # Ranks that route different tokens through the MoDE layers: data-parallel ranks, and under TP each
        # TP rank's slice of the sequence; expert loads are summed over them.
        moe_mesh = "dp_tp" if dims.tp > 1 else "dp"
        self.moe_group = dims.submesh(moe_mesh).get_group() if self.has_moe and dims.dp * dims.tp > 1 else None
        self.optimizers = Optimizers(self.model_parts, cfg.optimizer)
        self.spike_guard = SpikeGuard(t.spike_factor, t.spike_window, t.spike_lr_scale, t.spike_guard)
        self.nonfinite = NonFiniteGuard(t.max_skipped_steps, self.log)
        self.preemption = Preemption(self.device)
        self.last_eval_step = -1
        self.step = 0
        # Error-feedback residuals are rank-local: saved per rank, restored only under the same layout.
        residuals = self.compression if self.compression is not None and cfg.comm.error_feedback else None
        layout = dims.describe()
        if dims.pp > 1:
            p = cfg.parallelism
            layout += (f"; pp schedule {p.pp_schedule}, {p.pp_virtual_stages} virtual stages, "
                       f"split points {p.pp_split_points}")
        self.distill = Distillation(cfg, self.loader, margs.vocab_size, self.pp_microbatches if dims.pp > 1 else 1) \
            if cfg.distill.path else None
        self.attn = AttentionFeatures(cfg, dims, self.model_parts, margs.n_layers,
                                      getattr(self.tokenizer, "eot_id", None), self.accum_steps,
                                      (self.loader, self.val_loader))
        self.ema = EMA(self.model_parts, cfg.ema.decay, cfg.ema.every, cfg.ema.start_step) if cfg.ema.decay else None
        self.checkpointer = CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, {
            "model": ModelParts(self.model_parts), "optimizer": self.optimizers,
            "dataloader": self.loader, "train_state": self, **({"ema": self.ema} if self.ema else {})},
            residuals=residuals, layout=layout, log=self.log)
        self.step = self.checkpointer.load()
        if not self.step and cfg.checkpoint.initial_load_path:  # a fresh job starting from exported weights
            from torchtitan_ext.export import load_hf_weights

            load_hf_weights(self.model_parts, cfg.checkpoint.initial_load_path, margs)
            self.log(f"initial weights from {cfg.checkpoint.initial_load_path}")
        if self.step:
            self.log(f"resumed from {self.checkpointer.folder}/step-{self.step}")
        self.metrics = MetricsLogger(cfg.job.dump_folder, self.rank, cfg.metrics.tensorboard, cfg.metrics.jsonl,
                                     resume_step=self.step)
        if self.rank == 0:  # only a config that passed every check above replaces the previous one
            (Path(cfg.job.dump_folder) / "config.toml").write_text(to_toml(cfg))
        self.flops_per_token = flops_per_token(
            counts["active"] - counts["embedding"] + (counts["embedding"] if margs.tie_embeddings else 0),
            margs.n_layers, margs.n_heads, margs.head_dim or margs.dim // margs.n_heads, t.seq_len)
        self.peak_flops = peak_flops()

    def tokens_through(self, step: int) -> int:
        """Training tokens consumed by steps 1..step (all ranks), batch warmup included."""
        if self.batch_warmup is not None:
            return self.batch_warmup.tokens_through(step)
        return step * self.accum_steps * self.tokens_per_micro

    # Stateful: the trainer's own progress, saved beside the model.
    def state_dict(self) -> dict:
        return {"step": self.step, "spike_guard": self.spike_guard.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.spike_guard.load_state_dict(state["spike_guard"], self.step)

    def log(self, msg: str) -> None:
        if self.rank == 0:
            print(msg, flush=True)

    def _autocast(self) -> contextlib.ExitStack:
        """bf16 autocast when FSDP does not cast the parameters itself, and the chosen SDPA backend."""
        stack = contextlib.ExitStack()
        if self.use_autocast:
            stack.enter_context(torch.autocast("cuda", dtype=torch.bfloat16))
        stack.enter_context(attention_backend(self.cfg.training.attention_backend, self.device))
        return stack

    def _pipeline_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per micro-batch on the last stage; the schedule averages over its micro-batches. With distillation
        the training labels arrive packed with their soft targets (``Distillation.pack``)."""
        labels, teacher = self.distill.unpack(labels) if self.distill is not None else (labels, None)
        loss = self.loss_fn(logits, labels, self.cfg.training.z_loss) + self.attn.output_term(logits)
        if teacher is not None:
            loss = self.distill.mix(loss, logits, teacher)
        return loss / self.accum_steps

    def _loss_context(self) -> contextlib.AbstractContextManager:
        return loss_parallel() if self.loss_parallel else contextlib.nullcontext()

    def forward_backward(self, inputs: torch.Tensor, labels: torch.Tensor, last_micro: bool,
                         model_kwargs: dict | None = None) -> torch.Tensor:
        """One micro-batch; returns the detached loss. Gradient sync happens on the last micro-batch only.
        ``model_kwargs``: the visibility mask and positions (``AttentionFeatures.model_kwargs``)."""
        if self.pp_schedule is not None:
            if self.distill is not None:  # the soft targets travel with the labels to the last stage
                labels = self.distill.pack(labels)
            return self._pipeline_step(inputs, labels, self.pp_schedule.step, model_kwargs) * self.accum_steps
        model = self.model_parts[0]
        sync = contextlib.nullcontext()
        if self.dims.ddp_enabled and not last_micro:
            sync = model.no_sync()
        elif hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last_micro)
        with sync, self._autocast(), self._loss_context():
            logits = model(inputs, **(model_kwargs or {}))
            loss = self.loss_fn(logits, labels, self.cfg.training.z_loss)
            loss = loss + self.attn.output_term(logits)  # exactly 0 in value: the reported loss is unchanged
            if self.distill is not None:
                loss = self.distill.mix(loss, logits)
            (loss / self.accum_steps).backward()
        return _plain(loss.detach())

    def _pipeline_step(self, inputs: torch.Tensor, labels: torch.Tensor, run,
                       model_kwargs: dict | None = None, token_weighted: bool = False) -> torch.Tensor:
        """Run the schedule (``step`` or ``eval``); the mean micro-batch loss, known on every pp rank. With a
        visibility mask the first stage also takes (start, limit, positions), which the stages pass on.
        ``token_weighted``: micro-batches weighted by their scored labels (sliding-window evaluation)."""
        losses: list[torch.Tensor] | None = [] if self.pp_has_last else None
        target = labels if self.pp_has_last else None
        args = (inputs,) if self.pp_has_first else ()
        if model_kwargs and self.pp_has_first:
            args += pipeline_mask_args(inputs, model_kwargs)
        with self._autocast():
            run(*args, target=target, losses=losses)
        if losses and token_weighted:
            loss = token_weighted_mean([_plain(x.detach()) for x in losses], labels)
        else:
            loss = torch.stack([_plain(x.detach()) for x in losses]).mean() if losses else \
                torch.zeros((), device=self.device)
        dist.all_reduce(loss, group=self.dims.submesh("pp").get_group())  # only one rank holds the last stage
        return loss

    def _to_device(self, x: torch.Tensor) -> torch.Tensor:
        """Host batches go to the GPU from pinned memory without blocking (a pageable copy would wait for
        the whole queued step)."""
        if self.device.type == "cuda":
            return x.pin_memory().to(self.device, non_blocking=True)
        return x.to(self.device)

    def train_step(self) -> tuple[float, float, float]:
        """One step, read back at once: (loss, gradient norm, lr)."""
        return self.settle(self.queue_step())

    def settle(self, queued: QueuedStep) -> tuple[float, float, float]:
        """Read a queued step's loss and gradient norm on the host (one transfer), count a skipped update,
        stop on a diverged loss, and feed the spike guard; returns (loss, gradient norm, lr)."""
        loss, norm = torch.stack([queued.loss.float(), queued.grad_norm.float()]).tolist()
        self.nonfinite.record(queued.step, norm)
        if not math.isfinite(loss):
            raise TrainingDiverged(
                f"step {queued.step}: loss is {loss}; stopping without saving (the latest checkpoint in "
                f"{self.checkpointer.folder} is intact). Lower optimizer.lr or check the data.")
        t = self.cfg.training
        if self.spike_guard.observe(queued.step, loss):
            self.log(f"step {queued.step}: loss spike {loss:.4f}; LR x {t.spike_lr_scale} for steps "
                     f"{self.spike_guard.cut_from}-{self.spike_guard.cut_to}")
        return loss, norm, queued.lr

    def queue_step(self) -> QueuedStep:
        """Hand one step to the device without reading anything back (the expert-parallel dispatch's split
        sizes and unfused optimizers excepted), so the host prepares the next step while this one runs."""
        clock = (self.step, self.cfg.training.steps)
        if self.batch_warmup is not None:  # this step's micro-batches; the LR schedule runs on tokens
            self.accum_steps = self.batch_warmup.micro_batches(self.step)
            AuxLoss.scale = 1.0 / (self.accum_steps * self.dims.tp)
            clock = tuple(self.batch_warmup.effective_step(s) for s in clock)
        lr = self.cfg.optimizer.lr * lr_multiplier(*clock, self.cfg.lr_scheduler)
        lr *= self.spike_guard.lr_factor(self.step)
        self.optimizers.set_lr(lr)
        self.optimizers.zero_grad()
        loss_sum = torch.zeros((), device=self.device)
        for micro in range(self.accum_steps):
            batch = self.loader.next_batch()
            inputs, labels = self._to_device(batch.inputs), self._to_device(batch.labels)
            if self.distill is not None:
                self.distill.set_batch(batch.teacher, self.device)
            if self.has_moe and self.pp_schedule is None:
                set_token_domains(self.model_parts, self._to_device(batch.domains))
            loss_sum += self.forward_backward(inputs, labels, micro == self.accum_steps - 1,
                                              self.attn.model_kwargs(batch, self.device))
        if self.compression is not None and self.compression.after_backward is not None:
            self.compression.after_backward()
        params = [p for m in self.model_parts for p in m.parameters()]
        pp_group = self.dims.submesh("pp").get_group() if self.dims.pp > 1 else None
        norm = grad_norm(params, pp_group)  # global: every rank skips a non-finite step together
        skipped = self.optimizers.step(params, norm, self.cfg.training.max_norm)
        if self.ema is not None:
            self.ema.update(self.step, applied=1.0 - skipped)
        if self.cfg.float8.enabled and self.cfg.float8.precompute_float8_dynamic_scale_for_fsdp:
            precompute_float8_scales(self.model_parts)
        loss = loss_sum / self.accum_steps
        if self.dims.dp > 1:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.dims.submesh("dp").get_group())
        return QueuedStep(self.step, loss, norm, lr)

    def _across_stages(self, stage_values: dict[str, float]) -> dict[str, float]:
        """Metrics each pipeline stage measures on its own layers (MoDE loads, gradient bytes), merged for
        rank 0's log: per-layer keys as they are, bytes summed over stages, the mean balancing losses
        averaged over the stages that have MoDE layers. Without pipelining: as they are."""
        if self.dims.pp == 1:
            return stage_values
        stages: list[dict[str, float] | None] = [None] * self.dims.pp
        dist.all_gather_object(stages, stage_values, group=self.dims.submesh("pp").get_group())
        merged: dict[str, float] = {}
        means: dict[str, list[float]] = {}
        for stage in stages:
            for key, value in stage.items():
                if key.startswith("comm/"):
                    merged[key] = merged.get(key, 0.0) + value
                elif key in ("moe/aux_loss", "moe/router_z_loss"):
                    means.setdefault(key, []).append(value)
                else:
                    merged[key] = value
        merged.update({key: sum(v) / len(v) for key, v in means.items()})
        return merged

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Token-weighted validation loss over the validation split (every domain's, with data.domains).
        ``self.eval_metrics`` gets val_bpb, per-domain val/loss/<d> and val/bpb/<d>, and the mixing weights
        data/weight/<d> after adaptive mixing has updated them from these losses."""
        self.eval_metrics: dict[str, float] = {}
        if self.val_loader is None or self.cfg.eval.steps == 0:
            return None
        if self.pp_schedule is not None and not hasattr(self.pp_schedule, "eval"):
            self.log("evaluation skipped: this torch's pipeline schedules have no eval()")
            return None
        for m in self.model_parts:
            m.eval()
        ema_weights = contextlib.ExitStack()  # eval.use_ema: the average stands in for the weights
        if self.ema is not None and self.cfg.eval.use_ema:
            ema_weights.enter_context(self.ema.swapped_in())
        loaders = self.val_loader if isinstance(self.val_loader, dict) else {"": self.val_loader}
        sums = torch.zeros(len(loaders), 3, dtype=torch.float64, device=self.device)
        for row, loader in enumerate(loaders.values()):
            for batch in trainer_batches(loader, self.cfg, self.dims.dp_rank, self.dims.dp):  # eval.stride: sliding
                inputs, labels = batch.inputs.to(self.device), batch.labels.to(self.device)
                if self.pp_schedule is not None:
                    loss = self._pipeline_step(inputs, labels, self.pp_schedule.eval,
                                               self.attn.model_kwargs(batch, self.device),
                                               token_weighted=self.cfg.eval.stride > 0) * self.accum_steps
                else:
                    with self._autocast(), self._loss_context():
                        logits = self.model_parts[0](inputs, **self.attn.model_kwargs(batch, self.device))
                        loss = _plain(self.loss_fn(logits, labels, 0.0))
                sums[row] += batch_sums(loss, labels, self.token_bytes)
        for m in self.model_parts:
            m.train()
        ema_weights.close()
        if self.dims.dp > 1:
            dist.all_reduce(sums, group=self.dims.submesh("dp").get_group())
        val, self.eval_metrics = summarize(list(loaders), sums)
        if hasattr(self.loader, "update"):  # domain mixing: the adaptive update, then the weights in use
            self.loader.update({k.removeprefix("val/loss/"): v for k, v in self.eval_metrics.items()
                                if k.startswith("val/loss/")})
            self.eval_metrics.update(self.loader.weight_metrics())
        return val

    def train(self) -> None:
        """Train to ``training.steps``, then evaluate; the metrics files are closed and a pending async save
        finished (or abandoned) however it ends."""
        try:
            self._train_loop()
        finally:
            self.checkpointer.finish_or_abandon()
            self.metrics.close()
            self.profiling.finish()

    def _train_loop(self) -> None:
        """Steps are queued on the device and read back one step late (``settle``), so the host prepares
        step N+1 while the GPU runs step N; logging, evaluation, checkpoint and preemption steps, and the
        last one, are read back at once."""
        cfg, t = self.cfg, self.cfg.training
        self.log(f"training {t.steps} steps from step {self.step}: global batch {self.global_batch_size} x "
                 f"{t.seq_len} tokens, {self.accum_steps} micro-batches")
        window_start, window_steps = time.perf_counter(), 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        unread: QueuedStep | None = None
        while self.step < t.steps:
            self.step += 1
            self.profiling.step(self.step)
            log_now = self.step % cfg.metrics.log_freq == 0 or self.step == t.steps
            eval_now = cfg.eval.interval > 0 and self.step % cfg.eval.interval == 0  # whatever log_freq is
            self.attn.record_lse(log_now)
            queued = self.queue_step()
            window_steps += 1
            moe_metrics = balance_experts(self.model_parts, self.moe_group, report=log_now) if self.has_moe else {}
            if unread is not None:  # the previous step: finished on the device by now
                self.settle(unread)
                unread = None
            preempted = self.preemption.requested()
            save_now = self.checkpointer.should_save(self.step, t.steps)
            if not (log_now or eval_now or preempted or save_now):
                unread = queued
                continue
            loss, grad_norm, lr = self.settle(queued)
            if log_now or eval_now:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                elapsed = time.perf_counter() - window_start
                tps = (self.tokens_through(self.step) - self.tokens_through(self.step - window_steps)) / elapsed
                values = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tps,
                          "skipped_steps": self.nonfinite.total,
                          "tokens": self.tokens_through(self.step), "micro_batches": self.accum_steps,
                          "tokens_per_sec_per_device": tps / self.dims.world_size,
                          "lr_spike_factor": self.spike_guard.lr_factor(self.step)}
                if self.peak_flops:
                    values["mfu"] = self.flops_per_token * tps / self.dims.world_size / self.peak_flops
                if self.device.type == "cuda":
                    values["memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
                    values["memory_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
                stage_values = {**moe_metrics, **self.attn.metrics()}
                if self.distill is not None:  # measured where the loss is: the last pipeline stage
                    stage_values.update(self.distill.metrics())
                if self.comm_stats is not None:  # per step: compressed and uncompressed gradient bytes
                    stage_values.update({k: v / window_steps for k, v in self.comm_stats.as_dict().items()})
                    self.comm_stats.reset()
                values.update(self._across_stages(stage_values))
                if eval_now:
                    values["val_loss"] = self.evaluate()
                    values.update(self.eval_metrics)
                    self.last_eval_step = self.step
                self.metrics.log(self.step, {k: v for k, v in values.items() if v is not None})
                window_start, window_steps = time.perf_counter(), 0
            if preempted:  # every rank stops after this same step
                if self.checkpointer.cfg.enabled:
                    self.checkpointer.save(self.step, wait=True)
                self.log(f"preempted (signal) after step {self.step}: " + (
                    f"saved {self.checkpointer.folder}/step-{self.step}; exiting" if self.checkpointer.cfg.enabled
                    else "checkpoint.enabled = false, nothing saved; exiting"))
                return
            if save_now:
                self.checkpointer.save(self.step, wait=self.step == t.steps)
        self.checkpointer.finish_pending()
        val = self.evaluate() if self.last_eval_step != self.step else None  # not twice for the last step
        if val is not None:
            self.log(f"validation loss {val:.4f}")
            self.metrics.log(self.step, {"val_loss": val, **self.eval_metrics})
