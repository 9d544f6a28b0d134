"""The layout search: every layout the trainer accepts for N GPUs, kept where the memory model
(``estimate.plan``) fits it in the device's memory, ranked by an expected step time. These are model
estimates, not measurements; the rules are deliberately few so that a ranking can be argued with.

Candidates, for N GPUs and a global batch G (``training.global_batch_size``; when -1,
``training.local_batch_size`` x N sequences), every one checked by the trainer's own validation
(``estimate.check_trainer_layout``; a ConfigError skips it):
  * every factorisation N = pp x dp_replicate x dp_shard x cp x tp (FSDP2 over dp_shard x cp; HSDP where
    dp_replicate > 1) and, for a MoDE model, every ep dividing dp_shard (``parallel/dims.py``: EP borrows its
    ranks from dp_shard; under TP the experts are sharded over ep x tp); pruned to what can win: tp within a
    node (dividing the GPUs per node), pp at most the layers, cp where 2 x cp x tp divides seq_len and each rank
    keeps at least MIN_CP_TOKENS of a sequence, each cp with the ring scheme and, where the heads per TP rank
    divide by cp, the all-to-all one; ep dividing the experts;
  * pp > 1: 1F1B, and Interleaved1F1B with 2 virtual stages; micro-batches of 1, 2, 4 or 8 sequences;
  * activation checkpointing none, selective (op-level) or full;
  * the local batch: the largest divisor of G / dp that fits (memory grows with it, step time does not).
Each layout (with its schedule) keeps its fastest AC setting and batch; layouts rank by step time, then memory.
Layouts are tried simplest first (fewest pipeline stages, then TP, CP and replicas); the search stops after
``seconds`` (``--search-seconds``) and says how many it did not try, so that any GPU count answers in seconds.

Step time of one optimizer step (the global batch) on every GPU:
  compute   = the trainer's MFU FLOPs (``metrics.logger.flops_per_token``), with attention's counted causal
              (half: the fused kernels skip the masked blocks), x G x seq_len / N / (peak x MFU),
              ``Hardware.peak_flops`` and ``Hardware.mfu`` (compiled dense models reach a little more; uncompiled
              MoDE with small experts less). Smaller GEMMs under TP, MoDE load imbalance and kernel launch costs
              are not modelled. With ``float8.enabled`` the blocks' dense linears (and the head with
              ``float8.include_output``) run FLOAT8_GEMM_SPEEDUP times faster (their share of the FLOPs: 6 x their
              parameters per token); attention and the rest do not; emulated float8 (``float8.emulate``) not.
              Compiled float8 tensorwise blocks without activation checkpointing add FLOAT8_NO_AC_FUSION x
              compute: Inductor fuses each attention norm's backward with transposed float8 casts into one slow
              kernel there.
  recompute = full AC: compute / 3 (the forward again: 2 of the 6 FLOPs per parameter and token); op-level
              selective: SELECTIVE_RECOMPUTE x compute (pointwise ops only); selective every N blocks:
              compute / (3 N).
  bubble    = (compute + recompute) x (pp - 1) / (micro-batches x virtual stages), plus PP_PASS_OVERHEAD seconds
              per micro-batch and virtual stage.
  comm      = bytes per rank per mesh dimension (``estimate.communication``) / bandwidth: ``Hardware.intra_node_bw``
              per GPU inside a node, ``Hardware.inter_node_bw`` for a dimension whose ranks span nodes (rank
              order pp x dp_replicate x dp_shard (ep inner) x tp, tp innermost, ``gpus_per_node`` GPUs per node).
              Tensor parallelism inside a node moves at ``Hardware.tp_bw``, a third of the bus bandwidth: its
              collectives are many and mid-sized (four per layer and pass, one activation each) and each one
              holds up the next GEMM. Data-parallel traffic (FSDP all-gather and reduce-scatter, HSDP / DDP
              all-reduce) overlaps compute except FSDP_EXPOSED of it and all of what exceeds the compute time;
              TP, EP all-to-all and pipeline sends are on the critical path. Context parallelism:
              the ring's K/V transfers overlap the attention on the block already there ((cp - 1) / cp of the
              attention time, recomputed attention included), only what exceeds it is exposed (head-tail chunks
              give every ring step the same work); the all-to-all scheme's exchanges are on the critical path.
  optimizer = the AdamW step and gradient clipping over the rank's parameters: OPTIMIZER_BYTES_PER_PARAM bytes
              each through HBM at ``Hardware.memory_bw`` (achieved by streaming kernels). Once per optimizer
              step, so it weighs on layouts that put few tokens through each rank per step.
  step      = compute + recompute + bubble + exposed comm + optimizer; tokens/s per GPU = G x seq_len / step / N.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.errors import ConfigError, UserError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.plan.estimate import F32, GIB, PARAMS, Plan, param_groups, plan

# The constants below are fitted to steps measured on GPUs; docs/planner.md ("Calibration") says from which.
# Share of the step's compute that op-level selective AC adds (it recomputes pointwise ops only).
SELECTIVE_RECOMPUTE = 0.03
# Share of the data-parallel collectives' time not hidden behind compute (the first all-gather, the last
# reduce-scatter).
FSDP_EXPOSED = 0.25
# Seconds each (micro-batch, virtual stage) pass of a pipeline schedule costs beyond its FLOPs (separate
# forward / backward calls, send / recv handshakes).
PP_PASS_OVERHEAD = 0.003
# How much faster a float8 linear's forward + backward runs than bf16 (GEMMs with their amax / scale / cast
# work), per recipe: the factor that makes a model whose blocks' linears run in float8 (and the rest in bf16)
# come out at its measured step time. Other recipes: no gain assumed.
FLOAT8_GEMM_SPEEDUP = {"tensorwise": 1.40, "rowwise": 1.17}
# What compiled float8 tensorwise blocks without activation checkpointing add to the compute: Inductor fuses each
# attention norm's backward with three transposed float8 casts into one slow kernel, which the selective AC
# graphs do not form. Relative to the selective AC step, itself modelled as SELECTIVE_RECOMPUTE over the compute.
FLOAT8_NO_AC_FUSION = 0.065
# HBM bytes per parameter of one optimizer step, by ``optimizer.adamw_kernel`` (auto: triton on a GPU), at the
# achieved ``memory_bw``. torch's fused AdamW reads the fp32 parameter, gradient and two moments and writes three
# (28 bytes); the gradient norm reads the gradient again and clipping rewrites it (12). ``TritonAdamW`` moves the
# same 28 bytes closer to the HBM's peak, the same time as 30 bytes at torch's rate.
OPTIMIZER_BYTES_PER_PARAM = {"torch": 40, "triton": 30}
MICRO_SEQUENCES = (1, 2, 4, 8)  # sequences per pipeline micro-batch tried
DATA_PARALLEL_DIMS = ("dp_shard", "dp_replicate", "dp")
AC_MODES = ("none", "selective", "full")
PP_SCHEDULES = (("1F1B", 1), ("Interleaved1F1B", 2))
# Fewest tokens of each sequence a context-parallel rank keeps in the search: below it the K/V transfers of a
# ring step outlast its attention work, and the GEMMs get small.
MIN_CP_TOKENS = 4096
SEARCH_SECONDS = 20.0  # the search's default time budget


@dataclass(frozen=True)
class Hardware:
    """The assumed machine (every figure overridable from the command line); the defaults describe one node
    of eight GPUs on NVLink with an InfiniBand NIC per GPU (docs/planner.md names the card)."""
    peak_flops: float = 989e12  # dense bf16 FLOP/s of one GPU, as metrics.logger.PEAK_BF16_FLOPS
    mfu: float = 0.45  # achievable share of the peak for the compute alone
    intra_node_bw: float = 360e9  # bytes/s per GPU: NCCL bus bandwidth over NVLink
    inter_node_bw: float = 50e9  # bytes/s per GPU: one 400 Gb/s InfiniBand NIC per GPU
    gpus_per_node: int = 8
    # Effective bytes/s of tensor parallelism's collectives inside a node, below the bus bandwidth: they are
    # many and mid-sized, and each holds up the next GEMM. Fitted so that the measured TP rows rank as they ran
    # (tests/unit/plan/test_measured_rows.py).
    tp_bw: float = 120e9
    memory_bw: float = 2.6e12  # bytes/s of HBM achieved by streaming kernels, below the card's peak


@dataclass
class StepTime:
    """Seconds of one optimizer step by source; ``comm``: the exposed part per mesh dimension."""
    compute: float
    recompute: float
    bubble: float
    passes: float  # the pipeline schedule's per-pass overhead
    comm: dict[str, float]
    optimizer: float
    tokens: int  # of the global batch
    gpus: int

    @property
    def total(self) -> float:
        return self.compute + self.recompute + self.bubble + self.passes + sum(self.comm.values()) + self.optimizer

    @property
    def tokens_per_gpu_s(self) -> float:
        return self.tokens / self.total / self.gpus


def global_batch(cfg: JobConfig, gpus: int) -> int:
    """Sequences per optimizer step that every candidate trains on: the config's, or as the trainer derives it,
    its local batch times the data-parallel degree (the ``gpus`` over the config's TP and PP degrees)."""
    t, par = cfg.training, cfg.parallelism
    return t.global_batch_size if t.global_batch_size > 0 else t.local_batch_size * (gpus // (par.tp * par.pp * par.cp))


def spans_nodes(stride: int, size: int, gpus: int, gpus_per_node: int) -> bool:
    """Whether a group of ``size`` ranks ``stride`` apart reaches outside one node (for some group)."""
    if size == 1 or gpus <= gpus_per_node:
        return False
    return stride * size > gpus_per_node or gpus_per_node % (stride * size) != 0


def dimension_spans(p: Plan, hw: Hardware) -> dict[str, bool]:
    """Per mesh dimension named in ``estimate.communication``'s keys: whether its groups cross nodes. The
    world is ``pp x dp_replicate x dp_shard x cp x tp`` with tp innermost (``parallel/dims.py``); ep is the inner
    part of dp_shard; FSDP's collectives ("dp_shard") run over dp_shard x cp."""
    d, cp = p.dims, p.cp
    groups = {"tp": (1, d.tp), "cp": (d.tp, cp), "ep": (d.tp * cp, d.ep), "dp_shard": (d.tp, d.dp_shard * cp),
              "dp": (d.tp, d.dp), "dp_replicate": (d.tp * cp * d.dp_shard, d.dp_replicate),
              "pp": (d.tp * cp * d.dp, d.pp)}
    return {k: spans_nodes(stride, size, p.world, hw.gpus_per_node) for k, (stride, size) in groups.items()}


def step_time(cfg: JobConfig, p: Plan, hw: Hardware) -> StepTime:
    """The expected seconds of one optimizer step of ``cfg`` laid out as ``p`` (the rules: module docstring)."""
    from torchtitan_ext.metrics.logger import flops_per_token
    from torchtitan_ext.models.param_count import count_params

    a, t, ac = p.args, cfg.training, cfg.activation_checkpoint
    counts = count_params(a)
    active = counts["active"] - (0 if a.tie_embeddings else counts["embedding"])  # as the trainer's MFU
    tokens = global_batch(cfg, p.world) * t.seq_len
    attention = (flops_per_token(active, a.n_layers, a.n_heads, a.hdim, t.seq_len)
                 - flops_per_token(active, a.n_layers, a.n_heads, a.hdim, 0)) / 2  # causal: half the scores
    per_token = flops_per_token(active, a.n_layers, a.n_heads, a.hdim, 0) + attention
    compute = per_token * tokens / p.world / (hw.peak_flops * hw.mfu)
    attention_time = attention * tokens / p.world / (hw.peak_flops * hw.mfu)
    # Emulated float8 (``float8.emulate``) runs its GEMMs in high precision: bf16's speed, plus the casts.
    if cfg.float8.enabled and not cfg.float8.emulate and (speedup := FLOAT8_GEMM_SPEEDUP.get(cfg.float8.recipe)):
        groups = param_groups(a)
        share = 6 * (groups["matrices"] + (groups["head"] if cfg.float8.include_output else 0)) / per_token
        compute *= 1 - share + share / speedup
        if cfg.float8.recipe == "tensorwise" and t.compile and ac.mode == "none":
            compute *= 1 + FLOAT8_NO_AC_FUSION
    if ac.mode == "full":
        recompute, attention_time = compute / 3, attention_time * 4 / 3
    elif ac.mode == "selective" and ac.selective_every:
        recompute = compute / (3 * ac.selective_every)
        attention_time *= 1 + 1 / (3 * ac.selective_every)
    elif ac.mode == "selective":
        recompute = compute * SELECTIVE_RECOMPUTE
    else:
        recompute = 0.0
    bubble = passes = 0.0
    if p.dims.pp > 1:
        v = cfg.parallelism.pp_virtual_stages
        micro = cfg.parallelism.pp_microbatches or p.dims.pp * v
        bubble = (compute + recompute) * (p.dims.pp - 1) / (micro * v)
        accum = global_batch(cfg, p.world) // (t.local_batch_size * p.dims.dp)
        passes = PP_PASS_OVERHEAD * accum * micro * v
    spans = dimension_spans(p, hw)
    seconds: dict[str, float] = {}
    for key, nbytes in p.comm.items():
        dim = key.split()[0]
        bw = hw.inter_node_bw if spans[dim] else hw.tp_bw if dim == "tp" else hw.intra_node_bw
        seconds[dim] = seconds.get(dim, 0.0) + nbytes / bw
    if "cp" in seconds and p.cp_scheme == "ring":  # hidden behind the attention on the block already there
        seconds["cp"] = max(0.0, seconds["cp"] - attention_time * (p.cp - 1) / p.cp)
    data_parallel = sum(v for k, v in seconds.items() if k in DATA_PARALLEL_DIMS)
    if data_parallel:
        exposed = max(FSDP_EXPOSED * data_parallel, data_parallel - compute - recompute) / data_parallel
        seconds = {k: v * exposed if k in DATA_PARALLEL_DIMS else v for k, v in seconds.items()}
    kernel = "torch" if cfg.optimizer.adamw_kernel == "torch" or not cfg.optimizer.fused else "triton"
    optimizer = p.memory[PARAMS] / F32 * OPTIMIZER_BYTES_PER_PARAM[kernel] / hw.memory_bw
    return StepTime(compute, recompute, bubble, passes, seconds, optimizer, tokens, p.world)


@dataclass
class Candidate:
    """One layout with its AC setting and batch: the config to run, its memory plan and its step time."""
    cfg: JobConfig
    plan: Plan
    time: StepTime

    @property
    def layout(self) -> str:
        """e.g. ``PP 4 (Interleaved1F1B, 64 mb) x FSDP 32 (EP 32) x TP 2``."""
        d, par = self.plan.dims, self.cfg.parallelism
        parts = []
        if d.pp > 1:
            parts.append(f"PP {d.pp} ({par.pp_schedule}, {par.pp_microbatches} mb)")
        if d.dp_replicate > 1:
            parts.append(f"HSDP {d.dp_replicate}x{d.dp_shard}" if d.dp_shard > 1 else f"replicate {d.dp_replicate}")
        elif d.dp_shard > 1:
            parts.append(f"FSDP {d.dp_shard}")
        if d.ep > 1:
            parts[-1] += f" (EP {d.ep})"
        if self.plan.cp > 1:
            parts.append(f"CP {self.plan.cp} ({self.plan.cp_scheme})")
        if d.tp > 1:
            parts.append(f"TP {d.tp}")
        return " x ".join(parts) or "1 GPU"

    @property
    def accum_steps(self) -> int:
        return global_batch(self.cfg, self.plan.world) // (self.cfg.training.local_batch_size * self.plan.dims.dp)

    def overrides(self) -> list[str]:
        """The ``--section.key value`` arguments that give this candidate's layout, AC and batch."""
        par, t = self.cfg.parallelism, self.cfg.training
        out = [f"--parallelism.{k} {getattr(par, k)}" for k in ("dp_replicate", "dp_shard", "cp", "tp", "pp", "ep")]
        if par.cp > 1:
            out.append(f"--parallelism.cp_scheme {par.cp_scheme}")
        if par.pp > 1:
            out += [f"--parallelism.pp_schedule {par.pp_schedule}",
                    f"--parallelism.pp_virtual_stages {par.pp_virtual_stages}",
                    f"--parallelism.pp_microbatches {par.pp_microbatches}"]
        out += [f"--activation_checkpoint.mode {self.cfg.activation_checkpoint.mode}",
                f"--training.local_batch_size {t.local_batch_size}",
                f"--training.global_batch_size {global_batch(self.cfg, self.plan.world)}"]
        return out


@dataclass
class SearchResult:
    """``ranked``: the fitting layouts, fastest first (one per layout and schedule). ``smallest``: the
    smallest-peak candidate evaluated, for saying by how much nothing fits."""
    gpus: int
    global_batch: int
    device_bytes: float
    hw: Hardware
    ranked: list[Candidate] = field(default_factory=list)
    layouts: int = 0  # (layout, schedule, micro-batch size, AC) combinations tried
    refused: int = 0  # of which the trainer's validation refused
    smallest: Candidate | None = None
    untried: int = 0  # layouts (with their schedule) left when the time budget ran out
    seconds: float = SEARCH_SECONDS  # the time budget


@functools.lru_cache(maxsize=64)
def _divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n`` in increasing order, from its prime factors (fast for any GPU count)."""
    primes: dict[int, int] = {}
    rest, f = n, 2
    while f * f <= rest:
        while rest % f == 0:
            primes[f] = primes.get(f, 0) + 1
            rest //= f
        f += 1
    if rest > 1:
        primes[rest] = primes.get(rest, 0) + 1
    out = [1]
    for prime, power in primes.items():
        out = [d * prime**k for d in out for k in range(power + 1)]
    return tuple(sorted(out))


def _layouts(gpus: int, args: ModelArgs, seq_len: int, gpus_per_node: int) -> list[dict]:
    """The ``parallelism`` settings tried for ``gpus`` ranks (FSDP2 mode; ep only for a MoDE model; the pruning
    rules: the module docstring), simplest first."""
    out = []
    for tp in (t for t in _divisors(gpus) if gpus_per_node % t == 0):
        for cp in (c for c in _divisors(gpus // tp) if seq_len % (2 * c * tp) == 0
                   and (c == 1 or seq_len // c >= MIN_CP_TOKENS)):
            schemes = ("ring", "alltoall") if cp > 1 and (args.n_heads // tp) % cp == 0 else ("ring",)
            for pp in (p for p in _divisors(gpus // (tp * cp)) if p <= args.n_layers):
                dp = gpus // (tp * cp * pp)
                for rep in _divisors(dp):
                    shard = dp // rep
                    eps = [e for e in _divisors(shard) if args.n_experts % e == 0] if args.n_experts else [1]
                    for ep, scheme in itertools.product(eps, schemes):
                        schedules = PP_SCHEDULES if pp > 1 else (("1F1B", 1),)
                        out += [dict(dp_replicate=rep, dp_shard=shard, cp=cp, cp_scheme=scheme, tp=tp, pp=pp, ep=ep,
                                     dp_mode="fsdp", pp_schedule=s, pp_virtual_stages=v) for s, v in schedules]
    out.sort(key=lambda par: (par["pp"], par["tp"], par["cp"], par["dp_replicate"]))
    return out


def _with(cfg: JobConfig, par: dict, ac: str, local_batch: int, gbs: int, pp_micro: int) -> JobConfig:
    """``cfg`` with this layout, AC mode, local batch and pipeline micro-batches (0: pp x virtual stages)."""
    return dataclasses.replace(
        cfg, parallelism=dataclasses.replace(cfg.parallelism, **par, pp_microbatches=pp_micro, pp_split_points=[]),
        activation_checkpoint=dataclasses.replace(cfg.activation_checkpoint, mode=ac, selective_every=0),
        training=dataclasses.replace(cfg.training, local_batch_size=local_batch, global_batch_size=gbs))


def search(cfg: JobConfig, gpus: int, device_bytes: float, hw: Hardware = Hardware(),
           seconds: float = SEARCH_SECONDS) -> SearchResult:
    """Every layout of ``cfg``'s model on ``gpus`` GPUs that the trainer accepts and that fits
    ``device_bytes`` per GPU, ranked by expected step time, as many as ``seconds`` allow (the rules: the
    module docstring)."""
    from torchtitan_ext.data.tokenizers import vocab_size_of
    from torchtitan_ext.models.flavors import resolve_model_args

    if gpus < 1:
        raise UserError(f"the GPU count is {gpus}: expected a whole number >= 1")
    args = resolve_model_args(cfg, vocab_size_of(cfg.data.tokenizer, cfg.data.tokenizer_vocab_size))
    gbs = global_batch(cfg, gpus)
    result = SearchResult(gpus, gbs, device_bytes, hw, seconds=seconds)
    deadline = time.monotonic() + seconds

    def evaluate(c: JobConfig) -> Candidate:
        p = plan(c, gpus)
        cand = Candidate(c, p, step_time(c, p, hw))
        if result.smallest is None or p.peak < result.smallest.plan.peak:
            result.smallest = cand
        return cand

    layouts = _layouts(gpus, args, cfg.training.seq_len, hw.gpus_per_node)
    for index, par in enumerate(layouts):
        if time.monotonic() > deadline:
            result.untried = len(layouts) - index
            break
        fits = []
        dp = gpus // (par["tp"] * par["pp"] * par["cp"])
        for micro in (MICRO_SEQUENCES if par["pp"] > 1 else (0,)):
            # local batches the trainer takes: G a multiple of local x dp, under PP a whole number >= pp of
            # micro-batches of ``micro`` sequences
            batches = [b for b in _divisors(gbs // dp) if not micro or (b % micro == 0 and b // micro >= par["pp"])] \
                if gbs % dp == 0 else []
            for ac in AC_MODES:
                result.layouts += 1
                try:
                    if not batches:
                        raise ConfigError("no local batch divides the global batch")
                    if fit := _largest_fitting(cfg, par, ac, micro, batches, gbs, evaluate, device_bytes):
                        fits.append(fit)
                except ConfigError:
                    result.refused += 1
        if fits:
            result.ranked.append(min(fits, key=_rank))
    result.ranked.sort(key=_rank)
    return result


def _largest_fitting(cfg: JobConfig, par: dict, ac: str, micro: int, batches: list[int], gbs: int,
                     evaluate: Callable[[JobConfig], Candidate], device_bytes: float) -> Candidate | None:
    """The candidate with the largest local batch in ``batches`` that fits (memory grows with the batch, step
    time does not: a binary search), or None. The trainer's checks (ConfigError) do not depend on the batch
    within ``batches``: the smallest is checked."""

    def at(i: int) -> Candidate:
        return evaluate(_with(cfg, par, ac, batches[i], gbs, batches[i] // micro if micro else 0))
    fit = at(0)
    if fit.plan.peak > device_bytes:
        return None
    lo, hi = 1, len(batches) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if (cand := at(mid)).plan.peak <= device_bytes:
            fit, lo = cand, mid + 1
        else:
            hi = mid - 1
    return fit


def _rank(c: Candidate) -> tuple[float, float]:
    return c.time.total, c.plan.peak


def _seconds(s: float) -> str:
    return f"{s * 1000:.1f} ms" if s < 1 else f"{s:.2f} s"


def time_report(t: StepTime, hw: Hardware) -> list[str]:
    """The step time's lines for a single layout's report."""
    parts = [f"compute {_seconds(t.compute)}"]
    parts += [f"{name} {_seconds(v)}" for name, v in (("recompute", t.recompute), ("pp bubble", t.bubble),
                                                       ("pp passes", t.passes), ("optimizer", t.optimizer)) if v]
    parts += [f"{dim} comm {_seconds(v)}" for dim, v in t.comm.items() if v]
    return [f"expected step time {_seconds(t.total)}, {t.tokens_per_gpu_s:,.0f} tokens/s per GPU "
            f"({', '.join(parts)})", assumptions(hw)]


def search_report(r: SearchResult, model: str, top: int) -> list[str]:
    """The search's table (the ``top`` fastest layouts that fit) and the chosen layout's overrides."""
    nodes = -(-r.gpus // r.hw.gpus_per_node)
    lines = [f"search: {model} on {r.gpus} GPUs ({nodes} node{'s' if nodes > 1 else ''} of "
             f"{min(r.gpus, r.hw.gpus_per_node)}), {r.device_bytes / GIB:g} GiB each; global batch {r.global_batch} "
             f"sequences; {r.layouts} combinations of layout, schedule, micro-batch size and AC, {r.refused} refused "
             f"by the trainer's checks; {len(r.ranked)} layouts fit",
             *([f"time budget: {r.untried} layouts left untried after {r.seconds:g} s (--search-seconds; layouts "
                "are tried simplest first)"] if r.untried else []),
             assumptions(r.hw),
             f"{'#':>3}  {'layout':<58} {'AC':<9} {'batch':>9} {'GiB/GPU':>8} {'step':>9} {'tok/s/GPU':>10}"]
    for i, c in enumerate(r.ranked[:top], 1):
        batch = f"{c.cfg.training.local_batch_size}x{c.accum_steps}"
        lines.append(f"{i:>3}  {c.layout:<58} {c.cfg.activation_checkpoint.mode:<9} {batch:>9} "
                     f"{c.plan.peak / GIB:>8.1f} {_seconds(c.time.total):>9} {c.time.tokens_per_gpu_s:>10,.0f}")
    best = r.ranked[0]
    lines += ["batch: local batch x accumulation steps; memory: the planner's peak per GPU (x1.05 allocator slack)",
              f"chosen: {best.layout}, AC {best.cfg.activation_checkpoint.mode}: {best.plan.peak / GIB:.1f} GiB per "
              f"GPU, step {_seconds(best.time.total)}, {best.time.tokens_per_gpu_s:,.0f} tokens/s per GPU",
              "  its overrides: " + " ".join(best.overrides())]
    return lines


def assumptions(hw: Hardware) -> str:
    """The line that says the times are the model's, and on what they rest."""
    return (f"model estimates, not measurements: {hw.peak_flops / 1e12:g} TFLOP/s x MFU {hw.mfu:g}, "
            f"{hw.intra_node_bw / 1e9:g} GB/s per GPU inside a node (TP {hw.tp_bw / 1e9:g}), "
            f"{hw.inter_node_bw / 1e9:g} GB/s across nodes ({hw.gpus_per_node} GPUs per node), HBM "
            f"{hw.memory_bw / 1e12:g} TB/s, {FSDP_EXPOSED:.0%} of FSDP traffic exposed "
            "(torchtitan_ext/plan/search.py)")
