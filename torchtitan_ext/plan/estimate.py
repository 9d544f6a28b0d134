"""The planner's figures (the command line, and what it prints, in ``tools/plan.py``). The model is built on the
meta device from the same config code as the trainer (``resolve_model_args``, ``ParallelDims``), so parameter
shapes and the layout are the job's.

Activations are a closed form of what autograd saves per token in each block (``block_activations``):
norm inputs and their reciprocal RMS, the projections' inputs, attention's q, k, v, output and log-sum-exp
(Flash / cuDNN save no score matrix), the FFN's hidden tensors, MoDE's routed copies; tests check it
against the bytes ``torch.autograd.graph.saved_tensors_hooks`` sees on CPU. ``compiled`` models what
inductor keeps instead (pointwise results recomputed in the backward pass), also checked on CPU inductor.
Every activation is per token (attention on a fused kernel: no score matrix), so memory grows linearly with
``seq_len`` at any length.

Context parallelism (``parallelism.cp``): each rank holds 2 of the 2 x cp chunks of every sequence (head-tail),
so its activations, logits and per-token traffic are those of ``seq_len / cp`` tokens; FSDP shards over
``dp_shard x cp``; the rank order is ``pp x dp_replicate x dp_shard x cp x tp`` (torchtitan's). ``ring`` adds the
K/V blocks in flight (``cp_buffers``) and sends ``cp - 1`` K/V blocks per layer each way; ``alltoall`` exchanges
q, k, v and the output (four all-to-alls per layer and pass) and keeps the output in both layouts.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

import torch

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.data.tokenizers import vocab_size_of
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.parallel.cp_layout import check_cp_seq_len
from torchtitan_ext.parallel.dims import ParallelDims, ParallelDimsError
from torchtitan_ext.parallel.pp import ZERO_BUBBLE

GIB = 2**30
PARAMS = "parameters (fp32)"
GRADS = "gradients (fp32, all: at the optimizer step)"
F32 = 4
# FSDP keeps about two blocks unsharded at once: the one running and the one prefetched.
FSDP_UNSHARDED_UNITS = 2
# Allocator slack of the caching allocator over the live tensors at the peak (fragmentation, workspaces).
ALLOCATOR_OVERHEAD = 1.05


def block_activations(args: ModelArgs, layer: int, act: int, norm: str = "fused", compiled: bool = False,
                      tp: int = 1, alltoall_cp: int = 1) -> dict[str, float]:
    """Bytes autograd saves per token in block ``layer`` (no checkpointing), by source. ``act``:
    bytes per activation element (2 bf16, 4 fp32). ``norm``: "fused" (CUDA RMSNorm kernel: input + fp32
    reciprocal RMS) or "composite" (CPU: the fp32 input, reciprocal RMS and normalised fp32 copy).
    ``compiled``: what inductor's partitioner keeps (measured on CPU inductor): three of the SwiGLU's four
    hidden tensors (the silu is recomputed); the norms as the fused kernel. Tensor
    parallelism divides heads and hidden sizes; sequence parallelism divides the d_model-sized ones.
    ``alltoall_cp``: the degree of an all-to-all (Ulysses) context-parallel attention, whose K/V heads are
    repeated up to a multiple of it and whose output is kept in both layouts (attention's, and wo's input)."""
    d, hd = args.dim, args.hdim
    hq, hk = args.n_heads // tp, args.kv_heads // tp

    def rms(width: int, sharded_seq: bool) -> float:
        per = (act * width + F32) if norm == "fused" else (2 * F32 * width + F32)
        return per / (tp if sharded_seq else 1)
    out = {"attention_norm": rms(d, True),
           "qkv_input": act * d}  # the norm's output, all-gathered over the sequence under SP
    kv = args.computes_kv(layer)
    q_dims, k_dims = hq * hd, (hk * hd if kv else 0)
    if args.qk_norm:
        out["qk_norm"] = (rms(hd, False) * (hq + (hk if kv else 0)))
    # a KV-sharing consumer's k, v are its producer's tensors
    out["sdpa_qkv"] = act * (q_dims + 2 * k_dims * alltoall_kv_repeat(hk, alltoall_cp))
    out["sdpa_out_lse"] = act * q_dims + F32 * hq  # also wo's input: the output is laid out (b, s, h, d)
    if alltoall_cp > 1:
        out["cp_alltoall_out"] = act * q_dims  # wo's input, exchanged back from attention's layout
    out["ffn_norm"] = rms(d, True)
    if args.is_moe(layer):  # under TP each rank routes its own slice of the sequence
        out.update({k: v / tp for k, v in mode_activations(args, act, compiled).items()})
    else:
        f = args.ffn_hidden // tp
        out["ffn_input"] = act * d
        # swiglu: w1 x, w3 x, w2's input (+ silu eager); relu2: the relu output, its square (w2's input)
        out["ffn_hidden"] = act * f * ((3 if compiled else 4) if args.activation == "swiglu" else 2)
    return out


def alltoall_kv_repeat(kv_heads: int, cp: int) -> int:
    """How many times an all-to-all attention repeats each K/V head so that ``cp`` divides their count."""
    return math.lcm(kv_heads, cp) // kv_heads if cp > 1 else 1


def mode_activations(args: ModelArgs, act: int, compiled: bool) -> dict[str, float]:
    """Per token of a MoDE layer: router logits and probabilities (fp32), ``top_k`` routed copies with their
    expert SwiGLU tensors (dropless: capacity = the copies routed), the combine's gated outputs."""
    k, f, e, d = args.top_k, args.expert_hidden, args.n_experts, args.dim
    out = {"router": act * d + F32 * e * 3,  # input, logits, softmax (twice: routing and balancing loss)
           "expert_copies": k * act * d,
           "expert_hidden": k * act * f * (3 if compiled else 4),
           "combine": k * (act * d + F32)}  # expert outputs and gates
    if args.shared_expert:
        out["shared_expert"] = act * f * (3 if compiled else 4)
    return out


def head_activations(args: ModelArgs, act: int, norm: str, fused_ce: bool, tp: int = 1,
                     vocab_tp: int | None = None) -> dict[str, float]:
    """Per token: final norm, head input and the saved log-softmax (fp32) of the cross-entropy. Under TP the
    norm is sequence-sharded, the head's input all-gathered and the logits vocabulary-sharded over
    ``vocab_tp`` ranks (loss parallel; default ``tp``; 1 where a pipeline's last stage gathers its logits)."""
    vocab_tp = tp if vocab_tp is None else vocab_tp
    per_norm = (act * args.dim + F32) if norm == "fused" else (2 * F32 * args.dim + F32)
    out = {"final_norm": per_norm / tp, "head_input": act * args.dim, "embedding_ids": 8}
    if not fused_ce:
        out["log_softmax"] = F32 * args.vocab_size / vocab_tp
        if args.logit_softcap > 0:
            out["softcap"] = act * args.vocab_size / vocab_tp
    return out


@dataclass
class Plan:
    """Per-rank figures in bytes; ``report`` renders them."""
    world: int
    dims: ParallelDims
    args: ModelArgs
    memory: dict[str, float] = field(default_factory=dict)
    activations_no_ac: float = 0.0
    comm: dict[str, float] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    # Pipeline parallelism without FSDP: the stage's fp32 gradients exist from the first micro-batch's backward
    # on, while later micro-batches' forwards still hold their activations (1F1B's steady state)
    grads_at_backward: bool = False
    cp: int = 1  # context parallel degree (``dims`` holds the other degrees, on world / cp ranks)
    cp_scheme: str = "ring"

    @property
    def peak(self) -> float:
        """The larger of two moments: the start of the backward pass (every activation saved, gradients
        not yet allocated: the optimizer sets them to None, only the head's exists; under pipeline parallelism
        without FSDP every gradient too, ``grads_at_backward``) and the optimizer step (every gradient, no
        activations)."""
        backward = sum(v for k, v in self.memory.items() if k != GRADS or self.grads_at_backward)
        step = sum(self.memory[k] for k in (PARAMS, "optimizer state", GRADS))
        return max(backward, step) * ALLOCATOR_OVERHEAD


@functools.lru_cache(maxsize=4)
def param_groups(args: ModelArgs) -> dict[str, int]:
    """Parameter counts of the real module tree (meta device): blocks' matrices, experts, routers, norms,
    embedding, head, per layer for the block ones. Cached: a layout search plans one model thousands of times
    and building a 94-layer model on the meta device takes a second."""
    from torchtitan_ext.models.decoder import Decoder

    with torch.device("meta"):
        model = Decoder(args)
    groups = {"embedding": 0, "head": 0, "norms": 0, "matrices": 0, "experts": 0, "routers": 0}
    for name, p in model.named_parameters():
        if name.startswith("tok_embeddings"):
            groups["embedding"] += p.numel()
        elif name.startswith("output"):
            groups["head"] += p.numel()
        elif p.ndim < 2:
            groups["norms"] += p.numel()
        elif ".experts." in name:
            groups["experts"] += p.numel()
        elif ".router." in name:
            groups["routers"] += p.numel()
        else:
            groups["matrices"] += p.numel()
    return groups


def check_trainer_layout(cfg: JobConfig, args: ModelArgs, dims: ParallelDims) -> None:
    """The trainer's own checks of a layout against the model and the batch, called rather than restated so
    that the planner refuses what the trainer refuses (ConfigError, one line): TP, sequence-parallel and EP
    divisibility (``train.build.check_layout``), the global batch (``plan_batches``) and, under pipeline
    parallelism, the schedule and micro-batches (``parallel.pp.check_schedule``), the stages' layers
    (``layer_ranges``), KV-sharing groups (``check_kv_share_split``) and untied embeddings (``split_stages``)."""
    from torchtitan_ext.parallel.pp import check_schedule, layer_ranges
    from torchtitan_ext.train.attention_features import check_kv_share_split
    from torchtitan_ext.train.build import check_layout, plan_batches, pp_microbatches

    check_layout(cfg, args, dims)
    plan_batches(cfg, dims)
    if dims.pp > 1:
        p, ac = cfg.parallelism, cfg.activation_checkpoint
        check_schedule(p.pp_schedule, p.pp_virtual_stages, pp_microbatches(cfg, dims), dims.pp,
                       cfg.training.local_batch_size, op_level_sac=ac.mode == "selective" and ac.selective_every == 0,
                       compiled=cfg.training.compile)
        layer_ranges(args.n_layers, dims.pp * p.pp_virtual_stages, p.pp_split_points)
        if args.kv_share != "none":
            check_kv_share_split(args.n_layers, dims.pp * p.pp_virtual_stages, p.pp_split_points,
                                 args.kv_share_group)
        if args.tie_embeddings:  # split_stages' check, which needs the built model
            raise ConfigError("pipeline parallelism needs untied embeddings (the flavor ties them)")


def check_cp(cfg: JobConfig, args: ModelArgs, world: int) -> None:
    """Context parallelism against the world, the sequence and the heads (ConfigError, one line): cp divides the
    world, 2 x cp chunks of equal length per sequence, each split again over TP's sequence-parallel ranks (the
    trainer's own ``check_cp_seq_len``), heads per TP rank divisible by cp for the all-to-all scheme, and FSDP
    (not DDP) as the data parallelism."""
    p = cfg.parallelism
    if p.cp == 1:
        return
    if world % p.cp:
        raise ConfigError(f"parallelism.cp = {p.cp} must divide the world size {world}")
    check_cp_seq_len(cfg.training.seq_len, p.cp, p.tp)
    if p.cp_scheme == "alltoall" and (args.n_heads // p.tp) % p.cp:
        raise ConfigError(f"parallelism.cp_scheme = 'alltoall' needs the attention heads per TP rank "
                          f"({args.n_heads // p.tp}) divisible by parallelism.cp = {p.cp}; use cp_scheme ring")
    if p.dp_mode == "ddp":
        raise ConfigError("parallelism.dp_mode = 'ddp' with parallelism.cp > 1: context parallelism shards "
                          "parameters with FSDP over dp_shard x cp; use dp_mode fsdp")


class _Job:
    """What each step of :func:`plan` reads: the config, the layout (ConfigError where it does not fit the
    model), the parameter groups ``g`` of the real module tree and, derived once, the heaviest pipeline
    stage's ``layers``, the context parallel degree ``cp`` (``dims``: the other degrees, on world / cp ranks),
    whether FSDP runs (``fsdp``) and its ``shard`` count (dp_shard x cp; 1 without FSDP), bytes per activation
    element ``act``, the embedding and head parameters on that stage ``ends`` (one of them under pipeline
    parallelism), its block matrices, experts and routers ``block`` (before TP and FSDP) and the ``tokens`` of
    one micro-batch on one rank."""

    def __init__(self, cfg: JobConfig, world: int) -> None:
        from torchtitan_ext.models.flavors import resolve_model_args

        # The tokenizer's vocabulary without building it (the builtin one is trained on first use).
        args = resolve_model_args(cfg, vocab_size_of(cfg.data.tokenizer, cfg.data.tokenizer_vocab_size))
        check_cp(cfg, args, world)
        cp = cfg.parallelism.cp
        without_cp = dataclasses.replace(cfg, parallelism=dataclasses.replace(cfg.parallelism, cp=1))
        try:
            dims = ParallelDims.from_config(without_cp.parallelism, world // cp)
        except ParallelDimsError as e:
            raise ConfigError(str(e)) from None
        check_trainer_layout(without_cp, args, dims)
        g, t = param_groups(args), cfg.training
        self.cfg, self.dims, self.args, self.g = cfg, dims, args, g
        self.cp, self.cp_scheme = cp, cfg.parallelism.cp_scheme
        self.layers = math.ceil(args.n_layers / dims.pp)
        self.frac_layers = self.layers / args.n_layers
        self.fsdp = dims.fsdp_enabled or (cp > 1 and dims.dp_mode == "fsdp")
        self.shard = dims.dp_shard * cp if self.fsdp else 1
        self.experts_alone = dims.experts_alone and cp == 1
        self.act = 2 if t.mixed_precision_param == "bfloat16" else F32
        self.ends = max(g["embedding"], g["head"]) if dims.pp > 1 else g["embedding"] + g["head"]
        self.block = (g["matrices"] + g["experts"] + g["routers"]) * self.frac_layers
        self.tokens = t.local_batch_size * t.seq_len // cp


def plan(cfg: JobConfig, world: int) -> Plan:
    """The per-rank memory and per-step communication of ``cfg`` on ``world`` GPUs."""
    job = _Job(cfg, world)
    p = Plan(world, job.dims, job.args, cp=job.cp, cp_scheme=job.cp_scheme)
    _parameter_memory(p, job)
    _activation_memory(p, job)
    p.comm = communication(job)
    return p


def _parameter_memory(p: Plan, job: _Job) -> None:
    """Parameters, gradients and optimizer state on this rank (the heaviest pipeline stage, TP-sharded
    matrices, FSDP shards), then the unsharded bf16 parameters while computing: FSDP gathers ~2 units at once
    (a unit: one block's dense matrices, TP-sharded, and this rank's experts, EP-sharded), under pipeline
    parallelism the whole stage with its unsharded gradients; without FSDP the
    trainer runs bf16 autocast, whose weight casts are saved for the backward pass (the whole local model)."""
    g, dims, args, t = job.g, job.dims, job.args, job.cfg.training
    local = ((job.block + job.ends) / dims.tp + g["norms"] * job.frac_layers) / job.shard
    muon = job.cfg.optimizer.name == "muon"
    p.memory[PARAMS] = p.memory[GRADS] = F32 * local
    head_grad = g["head"] or (g["embedding"] if args.tie_embeddings else 0)
    p.memory["head gradient (at the backward peak)"] = F32 * head_grad / dims.tp / job.shard
    muon_part = (g["matrices"] + g["experts"]) * job.frac_layers / dims.tp / job.shard if muon else 0.0
    p.memory["optimizer state"] = F32 * (2 * (local - muon_part) + muon_part)  # AdamW 2 moments, Muon 1
    experts_layer = g["experts"] / dims.ep / args.n_layers / dims.tp  # this rank's experts of one layer
    unit = (g["matrices"] + g["routers"]) / args.n_layers / dims.tp + (0 if job.experts_alone else experts_layer)
    end_unit = (max(g["embedding"], g["head"]) if job.ends else 0) / dims.tp
    red = F32 if t.mixed_precision_reduce == "float32" else 2
    if job.fsdp and dims.pp > 1:
        # parallelize.py keeps a pipeline stage's blocks gathered after the forward, and torch's PipelineStage
        # turns off resharding and gradient sync until the step's last backward (perform_reduce_grad): the
        # whole stage is unsharded, its gradients accumulate unsharded in the reduce dtype
        stage = unit * job.layers + job.ends / dims.tp + g["norms"] * job.frac_layers
        p.memory["unsharded params + grads (bf16 / reduce dtype)"] = stage * (job.act + red)
    elif job.fsdp:  # the running unit and the prefetched one (the embedding or head is a unit of its own)
        p.memory["unsharded params + grads (bf16 / reduce dtype)"] = (
            (FSDP_UNSHARDED_UNITS - 1) * unit + max(unit, end_unit)) * job.act + max(unit, end_unit) * red
    else:
        # the gradients accumulate over the micro-batches in the parameters' fp32 .grad (torch's PipelineStage)
        p.grads_at_backward = dims.pp > 1
    if job.experts_alone:
        # outside FSDP the grouped GEMMs save their bf16 weight casts for the backward: every layer's without
        # activation checkpointing, one recomputed layer's with it (under EP MoDE blocks recompute in full)
        held = 1 if job.cfg.activation_checkpoint.mode != "none" else job.layers
        p.memory["expert bf16 weight casts (saved for the backward)"] = 2 * experts_layer * held
    if not job.fsdp and t.mixed_precision_param == "bfloat16":
        # the embedding lookup is not autocast; float8 linears cast their fp32 weights to float8 instead
        cast = job.block - (g["matrices"] * job.frac_layers if job.cfg.float8.enabled else 0) + head_grad
        p.memory["autocast bf16 weight copies"] = 2 * cast / dims.tp


def _activation_memory(p: Plan, job: _Job) -> None:
    """Saved activations of one micro-batch on the heaviest stage (with the configured checkpointing and,
    for comparison, without), times the share the pipeline's first rank holds at once; then the head's
    saved activations and the logits / cross-entropy buffers of one micro-batch at a time."""
    args, dims, cfg, tokens, layers, act = job.args, job.dims, job.cfg, job.tokens, job.layers, job.act
    t = cfg.training
    a2a = job.cp if job.cp_scheme == "alltoall" else 1
    per_layer = [sum(block_activations(args, i, act, "fused", t.compile, dims.tp, a2a).values())
                 for i in range(args.n_layers)]
    per_layer_stage = sorted(per_layer, reverse=True)[:layers]
    full = sum(per_layer_stage) * tokens
    if cfg.float8.enabled:  # float8 linears save their fp8 inputs (1 byte) instead of bf16 inputs
        full -= sum(float8_input_saving(args, i, dims.tp) for i in range(layers)) * tokens
        if not t.compile:
            # eager torchao saves each layer's fp8 weight for the backward; inside a compiled block the weight
            # is a graph input (a parameter, alive anyway) and the backward graph casts it again
            p.memory["float8 weight copies"] = (job.g["matrices"] * job.frac_layers) / dims.tp * 1
    ac = cfg.activation_checkpoint
    block_input = act * args.dim / dims.tp * tokens
    recompute = max(per_layer_stage) * tokens  # a recomputed block's activations, during its backward only
    if ac.mode == "full":
        acts = layers * block_input
    elif ac.mode == "selective" and ac.selective_every > 0:
        n_ckpt = layers // ac.selective_every
        acts = full - n_ckpt * (sum(per_layer_stage) / layers * tokens - block_input)
    elif ac.mode == "selective":  # op-level: matmul and attention outputs kept, pointwise recomputed
        kept = [selective_activations(args, i, act, dims.tp, t.compile, a2a) for i in range(args.n_layers)]
        acts = sum(sorted(kept, reverse=True)[:layers]) * tokens
        # during a block's backward only its pointwise results are recomputed; the kept ones are reused
        recompute = max(max(full_i - kept_i, 0.0) for full_i, kept_i in zip(per_layer, kept, strict=True)) * tokens
    else:
        acts, recompute = full, 0.0
    in_flight, micro, v = 1.0, 1, 1
    zero_bubble = dims.pp > 1 and cfg.parallelism.pp_schedule in ZERO_BUBBLE
    if dims.pp > 1:  # the first rank holds its warm-up micro-batches, each through one (virtual) stage
        v = cfg.parallelism.pp_virtual_stages
        micro = cfg.parallelism.pp_microbatches or dims.pp * v
        if zero_bubble:  # torch's orders (test_zero_bubble_orders.py): a graph lives until its weight pass
            held = min(micro, dims.pp) * v
        else:
            held = min(micro * v, 2 * (dims.pp - 1) + (v - 1) * dims.pp + 1 if v > 1 else dims.pp)
        in_flight = held / (micro * v)
        p.notes.append(f"pipeline: {micro} micro-batches, {held} (micro-batch, stage) activations held on the "
                       "first rank")
    p.memory["activations"] = acts * in_flight + recompute / micro
    if zero_bubble:
        # The first rank runs each weight pass right after its input pass (later ranks defer more of them:
        # ZBV's rank r holds 2r + 1, InterleavedZeroBubble's r + 1, without the embedding and head). During it,
        # the output gradient of every parameterised op of one (micro-batch, stage), which the input pass kept,
        # and the stage's recomputed activations (one recomputation for all its parameters: parallel/pp.py Stage)
        # live together, instead of one block's recomputation.
        grads = sum(sorted((weight_pass_gradients(args, i, act, dims.tp) for i in range(args.n_layers)),
                           reverse=True)[:layers]) * tokens
        p.memory["activations"] += ((full - acts) + grads) / (v * micro) - recompute / micro
        deferred = 2 * dims.pp - 1 if cfg.parallelism.pp_schedule == "ZBVZeroBubble" else dims.pp
        p.notes.append(f"zero-bubble: the last rank holds up to {deferred} (micro-batch, stage) output-gradient sets "
                       f"of {grads / (v * micro) / GIB:.2f} GiB for its weight passes (the peak above is the "
                       "first rank's: one, with the embedding and the head)")
    p.activations_no_ac = full * in_flight
    if job.cp > 1:
        p.memory[f"cp {job.cp_scheme} buffers (one layer's backward)"] = cp_buffers(job)
    # loss parallel (train/build.py): TP without PP keeps the logits vocabulary-sharded and the trainer runs
    # that cross-entropy eagerly (DTensor ops, trainer._build_loss); a last pipeline stage gathers its logits
    loss_parallel = dims.tp > 1 and dims.pp == 1
    vocab_tp = dims.tp if loss_parallel else 1
    head = sum(head_activations(args, act, "fused", t.fused_linear_ce, dims.tp, vocab_tp).values()) * tokens
    vocab_local = args.vocab_size / vocab_tp
    if t.fused_linear_ce:
        loss_peak = min(t.fused_linear_ce_chunk, tokens) * vocab_local * (2 * F32 + act)
    elif t.compile and not loss_parallel:
        # inductor saves the head-dtype logits and the LSE; one fused kernel writes their gradient
        head += ((act - F32) * vocab_local + F32) * tokens
        loss_peak = tokens * vocab_local * act
    elif loss_parallel:
        # torch's loss-parallel backward (tensor/parallel/loss.py, _nll_loss_and_log_softmax_backward) holds
        # three fp32 (tokens x local vocabulary) buffers at once: zeros_like(log-softmax), its exp, their sum
        loss_peak = tokens * vocab_local * 3 * F32
    else:  # eager backward of the cross-entropy: gradient of the fp32 logits, then its cast to the head dtype
        loss_peak = tokens * vocab_local * (F32 + (act if act != F32 else 0))
    p.memory["logits / cross-entropy"] = (head + loss_peak) / micro  # one micro-batch at a time


def cp_buffers(job: _Job) -> float:
    """Bytes a context-parallel attention holds beyond the saved activations during one layer's backward.
    ring: the K/V block in use and the one arriving, each with its dK / dV travelling back to its owner (four
    K/V-sized blocks), and the fp32 accumulator of dQ over the ring's steps; alltoall: the gradients of q, k and
    v in both layouts around their exchange."""
    args, tp, act, tokens = job.args, job.dims.tp, job.act, job.tokens
    q = args.n_heads // tp * args.hdim * tokens
    kv = 2 * args.kv_heads // tp * args.hdim * tokens
    if job.cp_scheme == "ring":
        return 4 * act * kv + F32 * q
    return 2 * act * (q + kv * alltoall_kv_repeat(args.kv_heads // tp, job.cp))


def weight_pass_gradients(args: ModelArgs, layer: int, act: int, tp: int) -> float:
    """Per token of block ``layer``: the gradients a zero-bubble schedule's input pass keeps for its weight pass,
    one per output of an op with parameters (the norms, q / k / v, wo, the FFN's or the router's and experts'
    linears). Tensor parallelism divides heads and hidden sizes, sequence parallelism the d_model-sized ones."""
    d, hd = args.dim, args.hdim
    hq, hk = args.n_heads // tp, (args.kv_heads // tp if args.computes_kv(layer) else 0)
    out = 3 * d / tp + hd * (hq + 2 * hk)  # two norms and wo (sequence-sharded), q, k, v
    if args.qk_norm:
        out += hd * (hq + hk)
    if args.is_moe(layer):  # router logits (fp32), top_k routed copies through w1, w3 and w2
        out += (F32 / act) * args.n_experts / tp + args.top_k * (2 * args.expert_hidden + d) / tp
        if args.shared_expert:
            out += (2 * args.expert_hidden + d) / tp
    else:  # w1 (and w3 for SwiGLU), w2 (sequence-sharded)
        out += args.ffn_hidden // tp * (2 if args.activation == "swiglu" else 1) + d / tp
    return act * out


def float8_input_saving(args: ModelArgs, layer: int, tp: int) -> float:
    """Per token: a float8 linear saves its input in 1 byte instead of 2 (attention and dense FFN linears;
    MoDE experts stay bf16)."""
    d, q = args.dim, args.n_heads * args.hdim // tp
    saving = d + q  # qkv input, wo input
    if not args.is_moe(layer):
        saving += d + args.ffn_hidden // tp  # w1/w3 input, w2 input
    return saving


def selective_activations(args: ModelArgs, layer: int, act: int, tp: int, compiled: bool = False,
                          alltoall_cp: int = 1) -> float:
    """Op-level selective AC per token: outputs of the matmuls and of attention (+ LSE), and the block input.
    Eager, torch's selective checkpointing caches every MUST_SAVE op's output during the forward, the FFN's
    output projection (w2) and TP's two reduce-scatters too; in a compiled block the policy's tags only steer
    inductor's partitioner, which saves what the backward reads: w2's output feeds the residual add alone, so
    it is not kept, and under TP attention's output is kept as its reduce-scattered slice, not as wo's full
    partial sums (one compiled TP 2 block on CPU: saved bytes equal to this). ``alltoall_cp``: as in
    :func:`block_activations`; attention's inputs and output are kept in its exchanged layout, the output also
    in wo's."""
    hd, hq, hk = args.hdim, args.n_heads // tp, args.kv_heads // tp
    kv = 2 * hk * hd * alltoall_kv_repeat(hk, alltoall_cp) if args.computes_kv(layer) else 0
    scattered = act * args.dim / tp  # a TP reduce-scatter's output (the policy keeps it)
    if compiled:
        attention_out = scattered if tp > 1 else act * args.dim
    else:
        attention_out = act * args.dim + (2 * scattered if tp > 1 else 0.0)
    out = act * args.dim / tp + act * (hq * hd + kv) + act * hq * hd + F32 * hq + attention_out
    if alltoall_cp > 1:
        out += act * hq * hd
    if args.is_moe(layer):
        out += args.top_k * act * (3 * args.expert_hidden + args.dim) + F32 * args.n_experts
    else:
        out += act * (args.ffn_hidden // tp) * (2 if args.activation == "swiglu" else 1)
        if not compiled:
            out += act * args.dim
    return out


def communication(job: _Job) -> dict[str, float]:
    """Bytes each rank sends per optimizer step on each mesh dimension (ring collectives: (n-1)/n of the
    buffer per all-gather / reduce-scatter, twice that per all-reduce). FSDP's collectives run over
    dp_shard x cp (their keys say dp_shard); context parallelism's attention traffic is :func:`cp_traffic`."""
    dims, args, g, act, tokens = job.dims, job.args, job.g, job.act, job.tokens
    layers, frac, t = job.layers, job.frac_layers, job.cfg.training
    per_micro = max(1, (t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * dims.dp)
                    // (t.local_batch_size * dims.dp))
    stage = ((g["matrices"] + g["routers"]) * frac + max(g["embedding"], g["head"])
             * (1 if dims.pp > 1 else 2)) / dims.tp + g["norms"] * frac
    experts = g["experts"] * frac / dims.tp / dims.ep  # FSDP-sharded over dp_shard / ep only
    red = F32 if t.mixed_precision_reduce == "float32" else 2
    squinch = job.cfg.comm.gradient_compression == "squinch"
    ratio = (6 / 32 if red == F32 else 6 / 16) if squinch else 1.0
    out: dict[str, float] = {}
    if job.fsdp and job.shard > 1:
        ring = (job.shard - 1) / job.shard
        e_ring = (job.shard // dims.ep - 1) / (job.shard // dims.ep)
        gathered = stage * ring + experts * e_ring
        if dims.pp > 1:  # the stage stays gathered from its first forward to the step's end (_parameter_memory)
            out["dp_shard all-gather (once per pipeline step)"] = per_micro * gathered * act
        else:
            out["dp_shard all-gather (fwd + bwd, per micro-batch)"] = 2 * per_micro * gathered * act
        # Under HSDP Squinch compresses the replicate all-reduce only (parallel/compression.py).
        out["dp_shard reduce-scatter"] = gathered * red * (ratio if dims.dp_replicate == 1 else 1.0)
    if dims.dp_replicate > 1:
        ring = (dims.dp_replicate - 1) / dims.dp_replicate
        out["dp_replicate all-reduce"] = 2 * (stage + experts * dims.ep) / job.shard * red * ring * ratio
    if dims.ddp_enabled:
        ring = (dims.dp - 1) / dims.dp
        out["dp all-reduce (DDP)"] = 2 * stage * red * ring * ratio
    if dims.tp > 1:  # per layer: all-gather + reduce-scatter around attention and FFN, forward and backward
        ring = (dims.tp - 1) / dims.tp
        out["tp all-gather / reduce-scatter of activations"] = per_micro * layers * 8 * tokens * args.dim * act * ring
    if dims.pp > 1:
        out["pp send / recv"] = per_micro * 2 * tokens * args.dim * act
    if dims.ep > 1:
        ring = (dims.ep - 1) / dims.ep
        moe_layers = sum(args.is_moe(i) for i in range(args.n_layers)) * frac
        out["ep all-to-all"] = per_micro * moe_layers * 4 * tokens * args.top_k * args.dim * act * ring / dims.tp
    if job.cp > 1:
        what = "send / recv of K/V" if job.cp_scheme == "ring" else "all-to-all of q, k, v, out"
        out[f"cp {job.cp_scheme} {what}"] = per_micro * cp_traffic(job)
    return out


def cp_attention_passes(cfg: JobConfig, layers: int) -> float:
    """Forward passes of the attention per micro-batch, summed over the stage's layers: one, and again for the
    blocks the activation checkpointing recomputes in full (op-level selective AC keeps attention's output)."""
    ac = cfg.activation_checkpoint
    if ac.mode == "full":
        return 2.0 * layers
    if ac.mode == "selective" and ac.selective_every > 0:
        return layers + layers // ac.selective_every
    return float(layers)


def cp_traffic(job: _Job) -> float:
    """Bytes one rank sends per micro-batch for context-parallel attention. ring: per forward pass of a layer,
    cp - 1 K/V blocks (its own first, each to the next rank while the current one is computed on); per backward,
    cp - 1 K/V blocks again and cp dK / dV blocks (back to their owner). alltoall: per pass, q, k (repeated up to
    a multiple of cp heads), v and the output (forward) or their gradients (backward), (cp - 1) / cp of each."""
    args, tp, act, cp, tokens = job.args, job.dims.tp, job.act, job.cp, job.tokens
    forwards, backwards = cp_attention_passes(job.cfg, job.layers), job.layers
    q = args.n_heads // tp * args.hdim * tokens * act
    kv = 2 * args.kv_heads // tp * args.hdim * tokens * act
    if job.cp_scheme == "ring":
        return forwards * (cp - 1) * kv + backwards * (2 * cp - 1) * kv
    per_pass = (2 * q + kv * alltoall_kv_repeat(args.kv_heads // tp, cp)) * (cp - 1) / cp
    return (forwards + backwards) * per_pass


def _gib(x: float) -> str:
    return f"{x / GIB:8.2f} GiB" if x >= GIB / 10 else f"{x / 2**20:8.2f} MiB"


def describe(p: Plan) -> str:
    """The layout in one phrase, context parallelism included."""
    d = p.dims
    if p.cp == 1:
        return d.describe()
    return (f"world {p.world} = pp {d.pp} x dp_replicate {d.dp_replicate} x dp_shard {d.dp_shard} (ep {d.ep}) x "
            f"cp {p.cp} ({p.cp_scheme}) x tp {d.tp}; data parallel {d.dp}, FSDP over dp_shard x cp = "
            f"{d.dp_shard * p.cp}")


def report(p: Plan, device_gib: float, cfg: JobConfig) -> list[str]:
    a = p.args
    lines = [f"plan: {cfg.model.flavor}, {describe(p)}",
             f"model: {a.n_layers} layers, d {a.dim}, vocab {a.vocab_size}"
             + (f", {a.n_experts} experts top-{a.top_k} (ep {p.dims.ep})" if a.n_experts else "")
             + f"; micro-batch {cfg.training.local_batch_size} x {cfg.training.seq_len}",
             "memory per rank:"]
    lines += [f"  {k:<50} {_gib(v)}" for k, v in p.memory.items()]
    lines.append(f"  {'(activations without checkpointing)':<50} {_gib(p.activations_no_ac)}")
    lines.append(f"  {'peak (x' + str(ALLOCATOR_OVERHEAD) + ' allocator slack)':<50} {_gib(p.peak)}")
    lines.append("communication per step per rank:")
    lines += [f"  {k:<50} {_gib(v)}" for k, v in p.comm.items()] or ["  none (one rank)"]
    lines += [f"note: {n}" for n in p.notes]
    verdict = "fits" if p.peak <= device_gib * GIB else "does not fit"
    lines.append(f"{verdict} on {device_gib:g} GiB ({p.peak / GIB:.2f} GiB predicted peak per rank)")
    return lines


def plan_job(cfg: JobConfig, gpus: int | None = None) -> Plan:
    """:func:`plan` on ``gpus`` GPUs, or, when None, on the world the config's layout names (``dp_shard = -1``
    then takes one shard per expert-parallel rank, and a note says so)."""
    par = cfg.parallelism
    world = gpus or (max(par.dp_replicate, 1) * (par.dp_shard if par.dp_shard > 0 else par.ep) * par.cp * par.tp
                     * par.pp)
    p = plan(cfg, world)
    if gpus is None and -1 in (par.dp_shard, par.dp_replicate):
        p.notes.append(f"no --gpus: planned for {world} GPUs (a parallelism degree of -1 takes the rest)")
    return p
