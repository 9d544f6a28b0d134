"""Typed sections of a training job. Every field is one TOML key; its metadata is the --help text.

A field's metadata may carry ``choices`` (allowed values) and ``min`` / ``max`` (inclusive bounds),
which the loader checks so that a bad value fails before any work starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def opt(default, help: str, *, choices: tuple | None = None, min: float | None = None,
        max: float | None = None):
    """A config field with its help text and validation rules."""
    meta = {"help": help, "choices": choices, "min": min, "max": max}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class JobSection:
    dump_folder: str = opt("./outputs/debug", "folder for checkpoints, TensorBoard, metrics.jsonl, config.toml")
    description: str = opt("", "free text shown at start")
    seed: int = opt(0, "seed of weights and data order", min=0)
    device: str = opt("auto", "auto: CUDA when present, else CPU", choices=("auto", "cpu", "cuda"))


@dataclass
class ModelSection:
    flavor: str = opt("debug", "named size from torchtitan_ext.models.flavors")
    vocab_size: int = opt(0, "0: the flavor's, or the tokenizer's (padded to a multiple of 64) when the "
                         "flavor has none", min=0)
    n_layers: int = opt(0, "0: the flavor's; else override the layer count", min=0)
    dim: int = opt(0, "0: the flavor's; else override d_model", min=0)
    n_heads: int = opt(0, "0: the flavor's; else override", min=0)
    n_kv_heads: int = opt(0, "0: the flavor's; else override", min=0)
    ffn_hidden: int = opt(0, "0: the flavor's; else override the SwiGLU hidden size", min=0)
    max_seq_len: int = opt(0, "0: training.seq_len", min=0)
    n_experts: int = opt(-1, "-1: the flavor's; 0 makes the model dense", min=-1)
    top_k: int = opt(0, "0: the flavor's; experts per token", min=0)
    moe_hidden: int = opt(0, "0: the flavor's; expert SwiGLU hidden size", min=0)
    moe_every: int = opt(0, "0: the flavor's; MoDE on every Nth layer, dense FFNs elsewhere", min=0)
    aux_loss_coef: float = opt(-1.0, "-1: the flavor's; Switch load-balancing loss coefficient", min=-1.0)
    router_z_loss_coef: float = opt(-1.0, "-1: the flavor's; router z-loss coefficient", min=-1.0)
    bias_update_rate: float = opt(-1.0, "-1: the flavor's; > 0 enables auxiliary-loss-free balancing "
                                  "(per-expert routing bias step)", min=-1.0)


@dataclass
class TrainingSection:
    steps: int = opt(200, "optimizer steps", min=1)
    seq_len: int = opt(256, "tokens per sequence", min=8)
    local_batch_size: int = opt(8, "sequences per data-parallel rank per micro-step", min=1)
    global_batch_size: int = opt(-1, "-1: local_batch_size x data-parallel degree; more means gradient "
                                 "accumulation", min=-1)
    max_norm: float = opt(1.0, "gradient clipping on the global norm; 0 disables", min=0.0)
    mixed_precision_param: str = opt("bfloat16", "parameter dtype in forward/backward on GPU (CPU always "
                                     "float32)", choices=("bfloat16", "float32"))
    mixed_precision_reduce: str = opt("float32", "gradient reduction dtype",
                                      choices=("bfloat16", "float32"))
    compile: bool = opt(False, "torch.compile each transformer block")
    attention_backend: str = opt("auto", "SDPA kernel on GPU: auto (cuDNN first on Hopper), cudnn, flash, "
                                 "efficient, math, or torch (PyTorch's own choice)",
                                 choices=("auto", "cudnn", "flash", "efficient", "math", "torch"))
    z_loss: float = opt(0.0, "coefficient of z-loss (logsumexp^2) on output logits", min=0.0)
    spike_guard: bool = opt(True, "halve the LR after a loss spike (Zen report)")
    spike_factor: float = opt(1.5, "a spike is loss > factor x mean of the previous window", min=1.0)
    spike_window: int = opt(100, "losses averaged to detect a spike; also the LR-cut duration", min=1)
    spike_lr_scale: float = opt(0.5, "LR multiplier during the cut", min=0.0, max=1.0)


@dataclass
class OptimizerSection:
    name: str = opt("adamw", "optimizer", choices=("adamw",))
    lr: float = opt(3e-4, "peak learning rate", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = opt(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = opt(1e-8, "AdamW epsilon", min=0.0)
    weight_decay: float = opt(0.1, "decoupled weight decay; never on norms, biases, embeddings", min=0.0)
    fused: bool = opt(True, "fused AdamW kernel on GPU")


@dataclass
class LRSchedulerSection:
    name: str = opt("cosine", "warmup-cosine, warmup-stable-decay or constant after warmup",
                    choices=("cosine", "wsd", "constant"))
    warmup_steps: int = opt(10, "linear warmup from lr/warmup_steps", min=0)
    min_lr_ratio: float = opt(0.1, "final LR as a fraction of the peak", min=0.0, max=1.0)
    decay_fraction: float = opt(0.2, "wsd: fraction of steps spent in the warm-down", min=0.0, max=1.0)
    decay_shape: str = opt("linear", "wsd warm-down shape", choices=("linear", "cosine"))


@dataclass
class ParallelismSection:
    dp_replicate: int = opt(1, "replicated data-parallel degree (HSDP when > 1 with dp_shard > 1)", min=1)
    dp_shard: int = opt(-1, "FSDP shard degree; -1: the rest of the world size", min=-1)
    tp: int = opt(1, "tensor (+ sequence) parallel degree", min=1)
    pp: int = opt(1, "pipeline parallel degree", min=1)
    ep: int = opt(1, "expert parallel degree, carved out of the data-parallel ranks", min=1)
    dp_mode: str = opt("fsdp", "data parallel style on dp_shard: FSDP2, or plain DDP (replicate)",
                       choices=("fsdp", "ddp"))
    pp_schedule: str = opt("1F1B", "pipeline schedule", choices=(
        "GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble"))
    pp_microbatches: int = opt(0, "0: pp x virtual stages", min=0)
    pp_virtual_stages: int = opt(1, "stages per pipeline rank (interleaved schedules)", min=1)
    pp_split_points: list = opt([], "explicit first layer of each stage after the first, e.g. [\"layers.8\"]")
    async_tp: bool = opt(False, "asynchronous tensor parallel (GPU, compiled)")


@dataclass
class ActivationCheckpointSection:
    mode: str = opt("none", "activation checkpointing", choices=("none", "selective", "full"))
    selective_every: int = opt(0, "selective: 0 = op-level policy (keep matmul/attention outputs); "
                                "N = recompute every Nth block", min=0)


@dataclass
class CheckpointSection:
    enabled: bool = opt(True, "save and resume checkpoints")
    folder: str = opt("checkpoint", "sub-folder of job.dump_folder")
    interval: int = opt(100, "save every N steps (and at the end)", min=1)
    keep_latest_k: int = opt(3, "complete checkpoints kept; 0 keeps all", min=0)
    async_mode: str = opt("disabled", "async saves overlap the next steps", choices=("disabled", "async"))
    load_step: int = opt(-1, "-1: resume from the latest complete checkpoint; N: that step", min=-1)


@dataclass
class MetricsSection:
    log_freq: int = opt(10, "log every N steps", min=1)
    tensorboard: bool = opt(True, "TensorBoard scalars under dump_folder/tb")
    jsonl: bool = opt(True, "one JSON object per logged step in dump_folder/metrics.jsonl")


@dataclass
class DataSection:
    dataset: str = opt("builtin", "builtin: the Python standard library's sources; shards: *.bin files",
                       choices=("builtin", "shards"))
    train_path: str = opt("", "shards: glob or folder of training shards")
    val_path: str = opt("", "shards: glob or folder of validation shards (optional)")
    tokenizer: str = opt("builtin", "builtin (SentencePiece BPE trained on the corpus), byte, or a "
                         ".model path")
    tokenizer_vocab_size: int = opt(4096, "vocabulary of the builtin tokenizer", min=260)
    cache_dir: str = opt("~/.cache/torchtitan_ext", "tokenizer and built-in shards cache")
    shuffle: bool = opt(True, "shuffle sequence windows (seeded, per epoch)")


@dataclass
class EvalSection:
    interval: int = opt(0, "evaluate on the validation split every N steps; 0: only at the end", min=0)
    steps: int = opt(10, "validation batches per evaluation; 0 disables evaluation", min=0)


@dataclass
class CommSection:
    gradient_compression: str = opt("none", "Squinch 6-bit gradients on the DP reduction",
                                    choices=("none", "squinch"))
    error_feedback: bool = opt(False, "add this step's compression residual to the next gradient")
    min_numel: int = opt(1024, "tensors smaller than this go uncompressed", min=0)


@dataclass
class Float8Section:
    enabled: bool = opt(False, "torchao float8 linears (H100 / compute capability >= 8.9)")
    recipe: str = opt("tensorwise", "scaling recipe", choices=("tensorwise", "rowwise", "rowwise_with_gw_hp"))
    filter_fqns: list = opt(["output"], "modules whose FQN contains one of these stay in bf16")
    min_dim: int = opt(64, "linears with in/out features below this (or not divisible by 16) stay in "
                       "bf16", min=16)
    enable_fsdp_float8_all_gather: bool = opt(False, "all-gather FSDP params in float8 (tensorwise)")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(False, "one fused amax for all params "
                                                         "(tensorwise, FSDP float8 all-gather)")


@dataclass
class JobConfig:
    job: JobSection = field(default_factory=JobSection)
    model: ModelSection = field(default_factory=ModelSection)
    training: TrainingSection = field(default_factory=TrainingSection)
    optimizer: OptimizerSection = field(default_factory=OptimizerSection)
    lr_scheduler: LRSchedulerSection = field(default_factory=LRSchedulerSection)
    parallelism: ParallelismSection = field(default_factory=ParallelismSection)
    activation_checkpoint: ActivationCheckpointSection = field(default_factory=ActivationCheckpointSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    metrics: MetricsSection = field(default_factory=MetricsSection)
    data: DataSection = field(default_factory=DataSection)
    eval: EvalSection = field(default_factory=EvalSection)
    comm: CommSection = field(default_factory=CommSection)
    float8: Float8Section = field(default_factory=Float8Section)
