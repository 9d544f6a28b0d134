"""The training loop: queued steps, gradient accumulation, pipeline schedules, evaluation, metrics, saves.
The run is built by ``train/build.py``; the loop reads like the list in the README."""

from __future__ import annotations

import contextlib
import logging
import math
import time
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from torchtitan_ext.checkpoint.manager import CheckpointManager, ModelParts
from torchtitan_ext.checkpoint.run_folder import (
    NothingToTrain,
    identity,
    identity_changes,
    keep_config,
    move_aside,
    previous_run_files,
    read_identity,
    would_resume,
    write_identity,
)
from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.config.loader import to_toml
from torchtitan_ext.data.sources.domains import MixingLoader
from torchtitan_ext.distill.student import Distillation
from torchtitan_ext.errors import RunStopped
from torchtitan_ext.eval.bpb import batch_sums, summarize, token_bytes
from torchtitan_ext.eval.sliding import reads_stream, token_weighted_mean, trainer_batches
from torchtitan_ext.metrics.logger import MetricsLogger, flops_per_token, peak_flops, validated_at
from torchtitan_ext.metrics.memory import peak_memory_metrics
from torchtitan_ext.metrics.profiling import Profiling
from torchtitan_ext.metrics.wandb_sink import tracking_sinks
from torchtitan_ext.parallel.compile import clean_fqn
from torchtitan_ext.parallel.context_parallel import shard_batch, token_share
from torchtitan_ext.parallel.expert_placement import ExpertPlacement
from torchtitan_ext.parallel.grad_norm import grad_norm
from torchtitan_ext.parallel.pp import build_schedule
from torchtitan_ext.quant.float8 import high_precision_forward, precompute_float8_scales
from torchtitan_ext.train.attention_features import AttentionFeatures, pipeline_mask_args
from torchtitan_ext.train.build import BuiltModel, BuiltRun, build_run, forward_context, pp_microbatches
from torchtitan_ext.train.gc_schedule import GarbageCollection
from torchtitan_ext.train.initial import load_initial_weights
from torchtitan_ext.train.losses import cross_entropy_loss, fused_head_loss
from torchtitan_ext.train.lr_schedule import lr_multiplier
from torchtitan_ext.train.moe_balance import balance_experts, mode_layers, set_token_domains
from torchtitan_ext.train.preemption import Preemption

log = logging.getLogger(__name__)


def _plain(x: torch.Tensor) -> torch.Tensor:
    """A loss as a plain tensor (loss parallel returns a replicated DTensor)."""
    return x.full_tensor() if isinstance(x, DTensor) else x


class TrainingDiverged(RunStopped):
    """The loss became NaN or Inf; the run stops without saving."""


class QueuedStep(NamedTuple):
    """A step handed to the device. Its loss and gradient norm travel into ``scalars`` (host memory on a GPU)
    behind the step's own work, and ``ready`` is recorded after that copy: ``Trainer.settle`` then waits for
    this step alone, not for the steps queued after it (a read of the device tensors would)."""
    step: int
    scalars: torch.Tensor
    ready: torch.cuda.Event | None
    lr: float


class Trainer:
    """The loop and nothing else: it receives the built run (``train/build.py``), adds what needs the loop
    itself (the loss, the pipeline schedule, the checkpointed state), resumes, and trains."""

    def __init__(self, cfg: JobConfig, run: BuiltRun | None = None):
        run = run if run is not None else build_run(cfg)
        self.cfg, self.run = cfg, run
        self.device, self.rank, self.dims = run.runtime.device, run.runtime.rank, run.runtime.dims
        self.batches = run.batches
        self.accum_steps, self.global_batch_size = run.batches.accum_steps, run.batches.global_batch_size
        self.tokenizer, self.loader, self.val_loader = run.tokenizer, run.data.loader, run.data.val_loader
        self.model_args, self.model_parts = run.model.args, run.model.parts
        self.loss_parallel = run.model.loss_parallel
        tr = run.training
        self.optimizers, self.spike_guard, self.nonfinite = tr.optimizers, tr.spike_guard, tr.nonfinite
        self.ema, self.compression, self.comm_stats = tr.ema, tr.compression, tr.comm_stats
        self.profiling = Profiling(cfg.profiling, cfg.job.dump_folder, self.rank, self.device, log.info)
        table = token_bytes(self.tokenizer, self.model_args.vocab_size)  # for val_bpb
        self.token_bytes = table.to(self.device) if table is not None else None
        self.has_moe = self.model_args.n_experts > 0
        # Ranks that route different tokens through the MoDE layers (data-parallel ranks, CP ranks, TP ranks'
        # slices of the sequence): expert loads are summed over them.
        self.moe_group = self.dims.submesh(self.dims.routing_group_name()).get_group() \
            if self.has_moe and self.dims.dp * self.dims.cp * self.dims.tp > 1 else None
        self.placement = self._build_placement() if cfg.parallelism.ep_rebalance_steps > 0 else None
        self._placement_metrics: dict[str, float] = {}
        self.loss_fn = self._build_loss()
        # Context parallel ranks hold parts of the same sequences: the loss is averaged over them too.
        self.cp_group = self.dims.submesh("cp").get_group() if self.dims.cp > 1 else None
        self.loss_group = self.dims.submesh("dp_cp").get_group() if self.dims.dp * self.dims.cp > 1 else None
        self.pp_microbatches = pp_microbatches(cfg, self.dims) if self.dims.pp > 1 else 1
        self.distill = Distillation(cfg, self.loader, self.model_args.vocab_size, self.pp_microbatches) \
            if cfg.distill.path else None
        self.attn = AttentionFeatures(cfg, self.dims, self.model_parts, self.model_args.n_layers,
                                      run.data.documents)
        self.evaluating = False  # while evaluate() runs, the loss recipe scores plain cross-entropy
        self.pp_schedule, self.pp_has_first, self.pp_has_last = self._build_pipeline(run.model) \
            if self.dims.pp > 1 else (None, True, True)
        self.preemption = Preemption(self.device)
        self.last_eval_step, self.step, self._loss_scales = -1, 0, (1.0, 1.0)
        self.checkpointer = self._build_checkpointer()
        started = self._resume()
        self.metrics = MetricsLogger(cfg.job.dump_folder, self.rank, cfg.metrics.tensorboard, cfg.metrics.jsonl,
                                     resume_step=self.step, total_steps=cfg.training.steps,
                                     sinks=tracking_sinks(cfg, self.rank))
        self._keep_identity(started)
        counts, a = run.model.counts, self.model_args
        active = counts["active"] - (0 if a.tie_embeddings else counts["embedding"])  # the lookup is no matmul
        self.flops_per_token = flops_per_token(active, a.n_layers, a.n_heads, a.hdim, cfg.training.seq_len)
        self.peak_flops = peak_flops()

    def _build_placement(self) -> ExpertPlacement:
        """Experts moved between the expert-parallel ranks by load, with their optimizer states and EMA
        shadows (``parallel/expert_placement.py``)."""
        names = {p: clean_fqn(n) for part in self.model_parts for n, p in part.named_parameters()}

        def companions(param: torch.nn.Parameter) -> list[torch.Tensor]:
            states = [v for opt in self.optimizers.optimizers for v in opt.state.get(param, {}).values()
                      if isinstance(v, torch.Tensor) and v.shape == param.shape]
            shadow = self.ema.shadow.get(names[param]) if self.ema is not None else None
            return states + ([shadow] if shadow is not None else [])

        ep_mesh = self.dims.submesh("ep_tp" if self.dims.tp > 1 else "ep")
        return ExpertPlacement([layer for _, layer in mode_layers(self.model_parts)], ep_mesh.get_group(),
                               self.moe_group, companions)

    def _experts_in_order(self):
        """Checkpoints hold the experts in their own order: the placement steps aside while one is saved."""
        return self.placement.canonical() if self.placement is not None else contextlib.nullcontext()

    def _build_loss(self):
        """Compiled, the loss fuses the float32 upcast of the logits into the cross-entropy kernels; with
        training.fused_linear_ce the model returns hidden states and the loss applies the head in chunks."""
        t = self.cfg.training
        if t.fused_linear_ce:
            return fused_head_loss(self.model_parts, self.dims, t.fused_linear_ce_chunk, self.model_args.logit_softcap)
        return torch.compile(cross_entropy_loss) if t.compile and not self.loss_parallel else cross_entropy_loss

    def _build_pipeline(self, model: BuiltModel) -> tuple[object, bool, bool]:
        """(the schedule, whether this rank holds the first stage, whether it holds the last)."""
        p, n_stages = self.cfg.parallelism, self.dims.pp * self.cfg.parallelism.pp_virtual_stages
        masked = self.cfg.data.attention != "causal" or self.cfg.data.dataset == "chat"
        carry = "mask" if masked else "positions" if self.dims.cp > 1 else "none"
        schedule = build_schedule(model.stages, n_stages, self.device, self.dims.submesh("pp").get_group(),
                                  p.pp_schedule, self.pp_microbatches, self._pipeline_loss, carry=carry)
        stage_ids = {sid for sid, _ in model.stages}
        return schedule, 0 in stage_ids, n_stages - 1 in stage_ids

    def _build_checkpointer(self) -> CheckpointManager:
        """Model, optimizer, loader, this trainer's progress and the EMA; error-feedback residuals are
        rank-local: saved per rank, restored only under the same layout."""
        cfg, dims = self.cfg, self.dims
        residuals = self.compression if self.compression is not None and cfg.comm.error_feedback else None
        layout = dims.describe()
        if dims.pp > 1:
            p = cfg.parallelism
            layout += (f"; pp schedule {p.pp_schedule}, {p.pp_virtual_stages} virtual stages, "
                       f"split points {p.pp_split_points}")
        states = {"model": ModelParts(self.model_parts), "optimizer": self.optimizers, "dataloader": self.loader,
                  "train_state": self, **({"ema": self.ema} if self.ema else {})}
        return CheckpointManager(cfg.checkpoint, cfg.job.dump_folder, states, residuals=residuals, layout=layout,
                                 log=log.info)

    def _resume(self) -> dict:
        """The latest complete checkpoint, else exported weights for a fresh job; returns the run's identity
        (run.json), written by ``_keep_identity`` once the metrics sinks have started. A signal before this
        point, or a resumed step with nothing left to train, ends the job here with nothing written."""
        cfg, dump = self.cfg, Path(self.cfg.job.dump_folder)
        ident = identity(cfg, self.model_args, self.global_batch_size)
        saved = read_identity(dump) if would_resume(cfg) else None
        if saved is not None and self.rank == 0:
            for line in identity_changes(saved, ident):
                if not line.startswith("training.seq_len"):  # said with the data position after the load
                    log.info(line)
        self.step = self.checkpointer.load()
        self.preemption.check_startup()  # nothing is written before this point
        t = cfg.training
        if self.step and (self.step > t.steps or self.step == t.steps and (
                self.val_loader is None or cfg.eval.steps == 0 or validated_at(dump / "metrics.jsonl", t.steps))):
            raise NothingToTrain(f"nothing to train: resumed at step {self.step} and training.steps = {t.steps} "
                                 f"(raise training.steps to continue); nothing written")
        if not self.step and would_resume(cfg):  # every checkpoint unreadable, checkpoint.allow_fresh_start
            self._set_aside_previous_run()
        if not self.step and cfg.checkpoint.initial_load_path:
            log.info(load_initial_weights(self.model_parts, cfg.checkpoint.initial_load_path, self.model_args))
        if self.step:
            log.info(f"resumed from {self.checkpointer.folder}/step-{self.step}")
            self._keep_token_position(saved)
        if cfg.lr_scheduler.warmup_steps > t.steps and self.rank == 0:
            log.info(f"warning: lr_scheduler.warmup_steps = {cfg.lr_scheduler.warmup_steps} is longer than the "
                     f"run (training.steps = {t.steps}): the LR never reaches optimizer.lr = {cfg.optimizer.lr}")
        return ident

    def _keep_identity(self, ident: dict) -> None:
        """Rank 0 records the run's identity and resolved config: only a config that passed every check of the
        start (the metrics sinks' included) replaces the previous one."""
        if self.rank == 0:
            dump = Path(self.cfg.job.dump_folder)
            write_identity(dump, ident, self.step)
            keep_config(dump, to_toml(self.cfg))

    def _keep_token_position(self, saved: dict | None) -> None:
        """A changed training.seq_len: a loader that counts sequences (``{"position": n}``) moves to the
        sequence that starts at the same token, so the run continues from the same position in tokens."""
        old, new = (saved or {}).get("training.seq_len"), self.cfg.training.seq_len
        if not old or old == new:
            return
        where = "the data continues from the saved position"
        if set(self.loader.state_dict()) == {"position"}:
            before = self.loader.position
            self.loader.load_state_dict({"position": before * old // new})
            where = (f"the data continues from the same position in tokens: sequence {before} -> "
                     f"{self.loader.position}")
        if self.rank == 0:
            log.info(f"training.seq_len changed since the last start: {old} -> {new} ({where})")

    def _set_aside_previous_run(self) -> None:
        """A start from step 0 over unreadable checkpoints: the old run's files move to previous-<time>/
        (its metrics are not truncated); this run's tokenizer copy and the cache stay."""
        cfg, dump = self.cfg, Path(self.cfg.job.dump_folder)
        if self.rank == 0 and previous_run_files(dump, cfg.checkpoint.folder):
            keep = (dump / "tokenizer", Path(cfg.data.cache_dir).expanduser().resolve())
            dest, names = move_aside(dump, keep=keep)
            self.checkpointer.folder.mkdir(parents=True, exist_ok=True)
            log.info(f"starting from step 0: moved the previous run's files ({', '.join(names)}) aside to {dest}")
        if dist.is_initialized():
            dist.barrier()

    # Stateful: the trainer's own progress, saved beside the model.
    def state_dict(self) -> dict:
        return {"step": self.step, "spike_guard": self.spike_guard.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]
        self.spike_guard.load_state_dict(state["spike_guard"], self.step)

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor,
              teacher: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The one loss recipe, of the plain step, the pipeline's last stage and evaluation. Training:
        cross-entropy with training.z_loss, plus the attention features' output term (0 in value: it adds
        gradients only), mixed under distillation with the teacher's soft targets (``teacher``: the micro-batch's
        under pipelining, else those of ``Distillation.set_batch``). Evaluation scores cross-entropy alone, on
        every layout, as the eval tool does."""
        if self.evaluating:
            return self.loss_fn(logits, labels, 0.0)
        loss = self.loss_fn(logits, labels, self.cfg.training.z_loss) + self.attn.output_term(logits)
        return self.distill.mix(loss, logits, teacher) if self.distill is not None else loss

    def _pipeline_loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Per micro-batch on the last stage; the schedule averages over its micro-batches. With distillation
        the training labels arrive packed with their soft targets (``Distillation.pack``)."""
        labels, teacher = self.distill.unpack(target) if self.distill is not None else (target, None)
        loss = self._loss(logits, labels, teacher)
        if self.cp_group is not None and not self.evaluating:
            loss = loss * token_share(labels, self.cp_group).to(loss.dtype)
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
        elif isinstance(model, FSDPModule):
            model.set_requires_gradient_sync(last_micro)
        with sync, forward_context(self.cfg, self.run.runtime), self._loss_context():
            loss = self._loss(model(inputs, **(model_kwargs or {})), labels)
            if self.cp_group is not None:
                loss = loss * token_share(labels, self.cp_group).to(loss.dtype)
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
        with forward_context(self.cfg, self.run.runtime):
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
        if queued.ready is not None:
            queued.ready.synchronize()
        loss, norm = queued.scalars.tolist()
        self.nonfinite.record(queued.step, norm)
        if not math.isfinite(loss):
            raise TrainingDiverged(
                f"step {queued.step}: loss is {loss}; stopping without saving ({self.checkpointer.integrity_note()}). "
                f"Lower optimizer.lr or check the data.")
        if self.spike_guard.observe(queued.step, loss):
            log.info(f"step {queued.step}: loss spike {loss:.4f}; LR x {self.cfg.training.spike_lr_scale} for steps "
                     f"{self.spike_guard.cut_from}-{self.spike_guard.cut_to}")
        return loss, norm, queued.lr

    def _scale_virtual_losses(self) -> None:
        """The losses that enter only the backward pass (MoDE balancing, attention Z-reg) are weighted like
        the main loss, 1 / micro-batches; under TP each rank averages the balancing losses over its own slice
        of the sequence and the slices' gradients are summed (see parallel/fsdp.py), hence also 1 / TP."""
        scales = (1.0 / (self.accum_steps * self.dims.tp), 1.0 / self.accum_steps)
        if scales != self._loss_scales:
            for decoder in self.attn.decoders:
                decoder.set_loss_scales(*scales)
            self._loss_scales = scales

    def queue_step(self) -> QueuedStep:
        """Hand one step to the device without reading anything back (the expert-parallel dispatch's split
        sizes and unfused optimizers excepted), so the host prepares the next step while this one runs."""
        clock = (self.step, self.cfg.training.steps)
        warmup = self.batches.warmup
        if warmup is not None:  # this step's micro-batches; the LR schedule runs on tokens
            self.accum_steps = warmup.micro_batches(self.step)
            clock = tuple(warmup.effective_step(s) for s in clock)
        self._scale_virtual_losses()
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
            inputs, labels, model_kwargs = self._local_part(inputs, labels, self.attn.model_kwargs(batch, self.device))
            loss_sum += self.forward_backward(inputs, labels, micro == self.accum_steps - 1, model_kwargs)
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
        if self.loss_group is not None:
            dist.all_reduce(loss, op=dist.ReduceOp.AVG, group=self.loss_group)
        scalars, ready = torch.stack([loss.float(), norm.float()]), None
        if self.device.type == "cuda":
            scalars = scalars.to("cpu", non_blocking=True)  # into pinned memory, queued behind this step
            ready = torch.cuda.Event()
            ready.record()
        return QueuedStep(self.step, scalars, ready, lr)

    def _local_part(self, inputs: torch.Tensor, labels: torch.Tensor, model_kwargs: dict
                    ) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Under context parallelism this rank's part of the micro-batch (``parallel/context_parallel.py``)."""
        if self.cp_group is None:
            return inputs, labels, model_kwargs
        return shard_batch(inputs, labels, model_kwargs, self.dims.cp, self.dims.submesh("cp").get_local_rank())

    def _across_stages(self, stage_values: dict[str, float]) -> dict[str, float]:
        """Metrics each pipeline stage measures on its own layers (MoDE loads, gradient bytes), merged for
        rank 0's log: per-layer keys as they are, bytes summed over stages, the mean balancing losses
        averaged over the stages that have MoDE layers. Without pipelining: as they are."""
        if self.dims.pp == 1:
            return stage_values
        stages: list[dict[str, float] | None] = [None] * self.dims.pp
        dist.all_gather_object(stages, stage_values, group=self.dims.submesh("pp").get_group())
        merged = {key: value for stage in stages for key, value in stage.items()}
        for key in merged:
            values = [stage[key] for stage in stages if key in stage]
            if key.startswith("comm/"):
                merged[key] = sum(values)
            elif key in ("moe/aux_loss", "moe/router_z_loss"):
                merged[key] = sum(values) / len(values)
        return merged

    def _step_metrics(self, loss: float, grad_norm: float, lr: float, elapsed: float, window_steps: int,
                      moe_metrics: dict[str, float]) -> dict[str, float]:
        """What a logged step reports: loss, LR, gradient norm, throughput over the ``window_steps`` steps since
        the last log (``elapsed`` seconds), MFU, peak memory, and the figures each pipeline stage measures on
        its own layers (MoDE loads, attention features, distillation, gradient bytes per step)."""
        tokens = self.batches.tokens_through(self.step)
        tps = (tokens - self.batches.tokens_through(self.step - window_steps)) / elapsed
        values = {"loss": loss, "lr": lr, "grad_norm": grad_norm, "tokens_per_sec": tps,
                  "skipped_steps": self.nonfinite.total, "tokens": tokens, "micro_batches": self.accum_steps,
                  "tokens_per_sec_per_device": tps / self.dims.world_size,
                  "lr_spike_factor": self.spike_guard.lr_factor(self.step)}
        if self.peak_flops:
            values["mfu"] = self.flops_per_token * tps / self.dims.world_size / self.peak_flops
        values.update(peak_memory_metrics(self.device))  # this rank's and the largest over the ranks
        stage_values = {**moe_metrics, **self.attn.metrics()}
        if self.distill is not None:  # measured where the loss is: the last pipeline stage
            stage_values.update(self.distill.metrics())
        if self.comm_stats is not None:  # per step: compressed and uncompressed gradient bytes
            stage_values.update({k: v / window_steps for k, v in self.comm_stats.as_dict().items()})
            self.comm_stats.reset()
        return {**values, **self._across_stages(stage_values)}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """The validation figures: val_loss, token-weighted over the validation split (every domain's, with
        data.domains), val_bpb, val_windows (the windows scored, all ranks and splits), per-domain val/loss/<d>
        and val/bpb/<d>, and the mixing weights data/weight/<d>
        after adaptive mixing has updated them from these losses. Empty when there is nothing to evaluate."""
        if self.val_loader is None or self.cfg.eval.steps == 0:
            return {}
        if self.pp_schedule is not None and not hasattr(self.pp_schedule, "eval"):
            log.info("evaluation skipped: this torch's pipeline schedules have no eval()")
            return {}
        self.evaluating = True
        for m in self.model_parts:
            m.eval()
        swaps = contextlib.ExitStack()
        if self.ema is not None and self.cfg.eval.use_ema:  # the average stands in for the weights
            swaps.enter_context(self.ema.swapped_in())
        if self.cfg.float8.high_precision_eval:  # the weights without float8 rounding
            swaps.enter_context(high_precision_forward(self.model_parts))
        loaders = self.val_loader if isinstance(self.val_loader, dict) else {"": self.val_loader}
        sums = torch.zeros(len(loaders), 4, dtype=torch.float64, device=self.device)  # batch_sums', windows
        for row, loader in enumerate(loaders.values()):
            for batch in trainer_batches(loader, self.cfg, self.dims.dp_rank, self.dims.dp):  # as the eval tool's
                inputs, labels, model_kwargs = self._local_part(batch.inputs.to(self.device),
                                                                batch.labels.to(self.device),
                                                                self.attn.model_kwargs(batch, self.device))
                if self.pp_schedule is not None:
                    loss = self._pipeline_step(inputs, labels, self.pp_schedule.eval, model_kwargs,
                                               token_weighted=reads_stream(self.cfg)) * self.accum_steps
                else:
                    with forward_context(self.cfg, self.run.runtime), self._loss_context():
                        logits = self.model_parts[0](inputs, **model_kwargs)
                        loss = _plain(self._loss(logits, labels))
                sums[row, :3] += batch_sums(loss, labels, self.token_bytes)
                # The windows that score a token, from the whole batch each CP rank holds: counted once per CP group.
                sums[row, 3] += (batch.labels >= 0).any(dim=-1).sum().item() / self.dims.cp
        for m in self.model_parts:
            m.train()
        self.evaluating = False
        swaps.close()
        if self.loss_group is not None:
            dist.all_reduce(sums, group=self.loss_group)
        val, figures = summarize(list(loaders), sums[:, :3])
        figures["val_windows"] = float(sums[:, 3].sum())
        if isinstance(self.loader, MixingLoader):  # the adaptive update, then the weights in use
            self.loader.update({k.removeprefix("val/loss/"): v for k, v in figures.items()
                                if k.startswith("val/loss/")})
            figures.update(self.loader.weight_metrics())
        return {"val_loss": val, **figures}

    def train(self) -> None:
        """Train to ``training.steps``, then evaluate; the metrics files are closed and a pending async save
        finished (or abandoned) however it ends."""
        collector = GarbageCollection(self.cfg.training.gc_freq)
        try:
            self._train_loop(collector)
        finally:
            collector.close()
            self.checkpointer.finish_or_abandon()
            self.metrics.close()
            self.profiling.finish()

    def _train_loop(self, collector: GarbageCollection) -> None:
        """Steps are queued on the device and read back one step late (``settle``), so the host prepares
        step N+1 while the GPU runs step N; logging, evaluation, checkpoint and preemption steps, and the
        last one, are read back at once."""
        cfg, t = self.cfg, self.cfg.training
        log.info(f"training {t.steps} steps from step {self.step}: global batch {self.global_batch_size} x "
                 f"{t.seq_len} tokens, {self.accum_steps} micro-batches")
        window_start, window_steps = time.perf_counter(), 0
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        unread: QueuedStep | None = None
        first_step = self.step + 1
        while self.step < t.steps:
            self.step += 1
            self.profiling.step(self.step)
            collector.step(self.step)
            log_now = self.step % cfg.metrics.log_freq == 0 or self.step == t.steps
            eval_now = cfg.eval.interval > 0 and self.step % cfg.eval.interval == 0  # whatever log_freq is
            # the first step of this start is said on the console whatever log_freq is: a new run is not silent
            # for log_freq steps (torchtitan logs step 1 too); metrics.jsonl keeps the log_freq cadence
            first_line = self.step == first_step and not (log_now or eval_now)
            self.attn.record_lse(log_now)
            queued = self.queue_step()
            window_steps += 1
            if self.placement is not None and self.step % cfg.parallelism.ep_rebalance_steps == 0:
                self._placement_metrics = self.placement.rebalance()  # from the loads balance_experts then resets
            moe_metrics = balance_experts(self.model_parts, self.moe_group, report=log_now) if self.has_moe else {}
            if log_now:
                moe_metrics.update(self._placement_metrics)
            if unread is not None:  # the previous step: waits for that step's work alone
                self.settle(unread)
                unread = None
            preempted = self.preemption.requested()
            save_now = self.checkpointer.should_save(self.step, t.steps)
            if not (log_now or eval_now or preempted or save_now or first_line):
                unread = queued
                continue
            loss, grad_norm, lr = self.settle(queued)
            if first_line:
                following = min(t.steps, (self.step // cfg.metrics.log_freq + 1) * cfg.metrics.log_freq)
                self.metrics.console(self.step, {"loss": loss, "grad_norm": grad_norm, "lr": lr},
                                     f"(the next line at step {following}: metrics.log_freq = {cfg.metrics.log_freq})")
            if log_now or eval_now:
                if self.device.type == "cuda":
                    torch.cuda.synchronize()
                values = self._step_metrics(loss, grad_norm, lr, time.perf_counter() - window_start, window_steps,
                                            moe_metrics)
                if eval_now:
                    values.update(self.evaluate())
                    self.last_eval_step = self.step
                self.metrics.log(self.step, values)
                window_start, window_steps = time.perf_counter(), 0
            if preempted:  # every rank stops after this same step
                if self.checkpointer.cfg.enabled:
                    with self._experts_in_order():
                        self.checkpointer.save(self.step, wait=True)
                log.info(f"preempted (signal) after step {self.step}: " + (
                    f"saved {self.checkpointer.folder}/step-{self.step}; exiting" if self.checkpointer.cfg.enabled
                    else "checkpoint.enabled = false, nothing saved; exiting")
                    + f" (this rank: {self.preemption.source()})")
                return
            if save_now:
                with self._experts_in_order():
                    self.checkpointer.save(self.step, wait=self.step == t.steps)
        self.checkpointer.finish_pending()
        figures = self.evaluate() if self.last_eval_step != self.step else {}  # not twice for the last step
        if figures:
            log.info(f"validation loss {figures['val_loss']:.4f} over {figures['val_windows']:,.0f} windows of "
                     f"{self.cfg.training.seq_len} tokens (eval.steps = {self.cfg.eval.steps})")
            self.metrics.log(self.step, figures)
        log.info(self._where_outputs_are())

    def _where_outputs_are(self) -> str:
        """The run's last lines: where its outputs went and the commands that go on from them."""
        dump, m = Path(self.cfg.job.dump_folder), self.cfg.metrics
        kept = [f"checkpoints {self.checkpointer.folder}"] if self.checkpointer.cfg.enabled else []
        kept += [f"metrics {dump / 'metrics.jsonl'}"] if m.jsonl else []
        kept += [f"TensorBoard {dump / 'tb'} (tensorboard --logdir {dump / 'tb'})"] if m.tensorboard else []
        lines = [f"done: step {self.step}; outputs in {dump}: " + ", ".join(kept + [f"logs {dump / 'logs'}"])]
        if self.checkpointer.cfg.enabled:
            lines += [f"  go on: the same command with a larger --training.steps resumes from "
                      f"{self.checkpointer.folder}",
                      f"  evaluate: python -m torchtitan_ext.eval --config {dump / 'config.toml'}",
                      f"  export: python -m torchtitan_ext.export --checkpoint {dump} --output <new folder>"]
        return "\n".join(lines)
