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
    dump_folder: str = opt("./outputs/default", "folder for checkpoints, TensorBoard, metrics.jsonl, config.toml "
                           "(train_configs/debug.toml: ./outputs/debug)")
    description: str = opt("", "free text, logged at the start of training (job: ...)")
    seed: int = opt(0, "seed of weights and data order", min=0)
    device: str = opt("auto", "auto: CUDA when present, else CPU", choices=("auto", "cpu", "cuda"))
    overwrite: bool = opt(False, "a job starting from step 0 in a dump folder that holds another run's checkpoints "
                          "or metrics moves them aside into dump_folder/previous-<UTC time>/ (else it stops)")


@dataclass
class ModelSection:
    """Every field of ``models.args.ModelArgs`` is a key here. ``flavor`` names a starting point; a key that is
    set (in the TOML file or on the command line) replaces the flavor's value, and a key left out (None here)
    keeps it, so every value a model can have can be set, the flavor's own included."""
    flavor: str = opt("debug", "named size from torchtitan_ext.models.flavors; each other [model] key that is set "
                      "overrides its value, one left unset keeps it")
    vocab_size: int | None = opt(None, "vocabulary; 0 (or unset with a flavor that has none): the tokenizer's, "
                                 "padded to a multiple of 64", min=0)
    dim: int | None = opt(None, "d_model", min=1)
    n_layers: int | None = opt(None, "layer count", min=1)
    n_heads: int | None = opt(None, "attention heads", min=1)
    n_kv_heads: int | None = opt(None, "K/V heads (GQA); 0: n_heads", min=0)
    head_dim: int | None = opt(None, "width of each head; 0: dim / n_heads", min=0)
    ffn_hidden: int | None = opt(None, "dense FFN hidden size", min=1)
    activation: str | None = opt(None, "swiglu, or relu2 (squared ReLU, needed by quant.qat)",
                                 choices=("swiglu", "relu2"))
    max_seq_len: int | None = opt(None, "the RoPE table length (>= training.seq_len); unset: training.seq_len",
                                  min=1)
    rope_theta: float | None = opt(None, "the RoPE base", min=0.0)
    rope_scaling: str | None = opt(None, "llama3: Llama-3 RoPE frequency scaling (long contexts); none: plain RoPE",
                                   choices=("none", "llama3"))
    rope_scaling_factor: float | None = opt(None, "llama3: the divisor of long-wavelength frequencies (8)",
                                            min=0.0)
    rope_low_freq_factor: float | None = opt(None, "llama3: wavelengths longer than rope_original_max_seq_len / "
                                             "this are divided by the factor (1)", min=0.0)
    rope_high_freq_factor: float | None = opt(None, "llama3: wavelengths shorter than rope_original_max_seq_len / "
                                              "this are kept; between: interpolated (4)", min=0.0)
    rope_original_max_seq_len: int | None = opt(None, "llama3: the context length the model was pre-trained at "
                                                "(8192)", min=1)
    rope_fraction: float | None = opt(None, "the fraction of each head's dims rotated by RoPE (0: none, 1: all)",
                                      min=0.0, max=1.0)
    nope_every: int | None = opt(None, "N > 0: every Nth layer has no positional encoding (RNoPE); 0: every layer "
                                 "uses RoPE", min=0)
    qk_norm: bool | None = opt(None, "RMSNorm on each head's queries and keys")
    norm_eps: float | None = opt(None, "the RMSNorm epsilon", min=0.0)
    tie_embeddings: bool | None = opt(None, "the output head shares the embedding matrix")
    logit_softcap: float | None = opt(None, "> 0: logits = cap x tanh(logits / cap); 0: no cap", min=0.0)
    residual_scalars: bool | None = opt(None, "a learnable scalar (init 1) on each block's attention and FFN branch")
    n_experts: int | None = opt(None, "MoDE routed experts; 0 makes the model dense", min=0)
    top_k: int | None = opt(None, "experts per token", min=1)
    moe_hidden: int | None = opt(None, "expert FFN hidden size; 0: ffn_hidden", min=0)
    moe_every: int | None = opt(None, "MoDE on every Nth layer, dense FFNs elsewhere", min=1)
    shared_expert: bool | None = opt(None, "a dense expert every token goes through, beside the routed ones")
    renormalize_gates: bool | None = opt(None, "the top_k gate weights are renormalised to sum to 1")
    aux_loss_coef: float | None = opt(None, "Switch load-balancing loss coefficient", min=0.0)
    router_z_loss_coef: float | None = opt(None, "router z-loss coefficient", min=0.0)
    bias_update_rate: float | None = opt(None, "> 0 enables auxiliary-loss-free balancing (per-expert routing "
                                         "bias step)", min=0.0)
    force_balanced_routing: bool | None = opt(None, "benchmarks only: each token's top_k experts assigned round-"
                                              "robin (every expert gets the same load) instead of by the router, "
                                              "whose probabilities at those experts still weight the outputs: "
                                              "the speed of the MoE path at perfect balance")
    kv_share: str | None = opt(None, "interleaved: in each group of kv_share_group consecutive layers only the "
                               "first computes K and V, the others reuse them; none: every layer computes its own",
                               choices=("none", "interleaved"))
    kv_share_group: int | None = opt(None, "layers per KV-sharing group", min=1)
    parametrization: str | None = opt(None, "standard, or mup (Maximal Update Parametrization: init, lrs, "
                                      "attention sqrt(base head_dim) / head_dim and logits x mup_base_dim / dim "
                                      "scaled with width, so hyperparameters tuned at mup_base_dim carry over to "
                                      "other widths)", choices=("standard", "mup"))
    mup_base_dim: int | None = opt(None, "the width (dim) the hyperparameters were tuned at; 0: dim (no width "
                                   "scaling); used by parametrization = mup only", min=0)
    mup_base_head_dim: int | None = opt(None, "the head_dim at mup_base_dim, when widths grow the heads instead; "
                                        "0: head_dim (widths add heads); muP only", min=0)


@dataclass
class TrainingSection:
    mode: str = opt("pretrain", "sft: supervised fine-tuning, which needs data.dataset = 'chat' and "
                    "checkpoint.initial_load_path (the model it starts from)", choices=("pretrain", "sft"))
    steps: int = opt(200, "optimizer steps", min=1)
    seq_len: int = opt(256, "tokens per sequence", min=8)
    local_batch_size: int = opt(8, "sequences per data-parallel rank per micro-step", min=1)
    global_batch_size: int = opt(-1, "-1: local_batch_size x data-parallel degree; more means gradient "
                                 "accumulation", min=-1)
    max_norm: float = opt(1.0, "gradient clipping on the global norm; 0 disables", min=0.0)
    max_skipped_steps: int = opt(5, "steps with non-finite gradients are skipped; stop after this many in a "
                                 "row", min=1)
    mixed_precision_param: str = opt("bfloat16", "parameter dtype in forward/backward on GPU (CPU always "
                                     "float32)", choices=("bfloat16", "float32"))
    mixed_precision_reduce: str = opt("float32", "gradient reduction dtype",
                                      choices=("bfloat16", "float32"))
    compile: bool = opt(False, "torch.compile each transformer block")
    attention_backend: str = opt("auto", "SDPA kernel on GPU: auto (cuDNN first on Hopper), cudnn, flash, "
                                 "efficient, math, or torch (PyTorch's own choice)",
                                 choices=("auto", "cudnn", "flash", "efficient", "math", "torch"))
    kernels: str = opt("torch", "block kernels: torch, or triton (fused residual add + RMSNorm, fused "
                       "SwiGLU / squared ReLU; GPU)", choices=("torch", "triton"))
    fused_linear_ce: bool = opt(False, "output head + cross-entropy in token chunks, never holding the whole "
                                "batch's float32 logits")
    fused_linear_ce_chunk: int = opt(8192, "tokens per chunk of the fused linear cross-entropy", min=1)
    z_loss: float = opt(0.0, "coefficient of z-loss (logsumexp^2) on output logits", min=0.0)
    attention_z_reg: float = opt(0.0, "gradient-only attention Z-regulariser: coef x logsumexp(attention "
                                 "logits)^2 / (heads x layers), not part of the reported loss", min=0.0)
    output_z_reg: float = opt(0.0, "gradient-only Z-regulariser on the output logits (not part of the reported "
                              "loss; z_loss is the real-loss version)", min=0.0)
    batch_warmup_tokens: int = opt(0, "ramp the global batch from batch_warmup_start to global_batch_size over "
                                   "this many tokens, in whole micro-batches; 0: no ramp", min=0)
    batch_warmup_start: int = opt(1, "micro-batches (local_batch_size x data-parallel degree sequences) per "
                                  "step at the start of the batch warmup", min=1)
    spike_guard: bool = opt(True, "halve the LR after a loss spike (Zen report)")
    spike_factor: float = opt(1.5, "a spike is loss > factor x mean of the previous window", min=1.0)
    spike_window: int = opt(100, "losses averaged to detect a spike; also the LR-cut duration", min=1)
    spike_lr_scale: float = opt(0.5, "LR multiplier during the cut", min=0.0, max=1.0)
    deterministic: bool = opt(False, "bitwise-reproducible debugging runs: deterministic kernels, cuDNN without "
                              "autotuning, fixed cuBLAS workspace, all generators seeded (slower)")
    gc_freq: int = opt(50, "Python's garbage collector runs every this many steps on every rank at once (its "
                       "automatic collections off while training); 0 leaves them automatic", min=0)


@dataclass
class OptimizerSection:
    name: str = opt("adamw", "adamw, or muon (Newton-Schulz-orthogonalised momentum on the blocks' matrices, "
                    "AdamW on embeddings, head, norms, routers; one lr for both)", choices=("adamw", "muon"))
    lr: float = opt(3e-4, "peak learning rate", min=0.0)
    beta1: float = opt(0.9, "AdamW beta1", min=0.0, max=1.0)
    beta2: float = opt(0.95, "AdamW beta2", min=0.0, max=1.0)
    eps: float = opt(1e-8, "AdamW epsilon", min=0.0)
    weight_decay: float = opt(0.1, "decoupled weight decay; never on norms, biases, embeddings", min=0.0)
    fused: bool = opt(True, "fused AdamW kernel (GPU and CPU): clips and skips non-finite steps without a host read")
    adamw_kernel: str = opt("auto", "fused AdamW's kernel for large CUDA parameters: torch (multi-tensor), "
                            "triton (one streaming kernel per parameter, closer to the HBM bandwidth; needs the gpu "
                            "extra), or auto (triton when importable and the parameters are on a GPU)",
                            choices=("auto", "torch", "triton"))
    muon_momentum: float = opt(0.95, "Muon momentum", min=0.0, max=1.0)
    muon_nesterov: bool = opt(True, "Muon Nesterov momentum")
    muon_ns_steps: int = opt(5, "Muon Newton-Schulz iterations", min=1, max=20)


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
    dp_replicate: int = opt(1, "replicated data-parallel degree (HSDP when > 1 with dp_shard > 1); -1: the ranks "
                            "left after dp_shard x tp x pp (e.g. one replica per node, so a job runs on any node "
                            "count); at most one of dp_replicate and dp_shard is -1", min=-1)
    dp_shard: int = opt(-1, "FSDP shard degree; -1: the ranks left after dp_replicate x tp x pp (the world size "
                        "divided by their product)", min=-1)
    tp: int = opt(1, "tensor (+ sequence) parallel degree", min=1)
    pp: int = opt(1, "pipeline parallel degree", min=1)
    ep: int = opt(1, "expert parallel degree, carved out of the data-parallel ranks", min=1)
    ep_rebalance_steps: int = opt(0, "every N steps move experts between the expert-parallel ranks by their "
                                  "routed load (0: never); needs ep = dp_shard > 1 with no dp_replicate or pp",
                                  min=0)
    cp: int = opt(1, "context parallel degree: each sequence is cut into 2 x cp chunks over cp ranks "
                  "(FSDP shards over dp_shard x cp)", min=1)
    cp_scheme: str = opt("ring", "context parallel attention: ring (K/V passed around the CP ranks) or alltoall "
                         "(heads exchanged for sequence; kv heads x group divisible by cp)",
                         choices=("ring", "alltoall"))
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
    initial_load_path: str = opt("", "weights that start training when the job has no checkpoint yet: a Hugging "
                                 "Face folder (torchtitan_ext.export) or one of our dump / checkpoint / step-N "
                                 "folders (its model only)")
    allow_fresh_start: bool = opt(False, "when every checkpoint in the folder is unreadable, start from step 0 "
                                  "instead of stopping with exit 2")


@dataclass
class MetricsSection:
    log_freq: int = opt(10, "log every N steps", min=1)
    tensorboard: bool = opt(True, "TensorBoard scalars under dump_folder/tb")
    jsonl: bool = opt(True, "one JSON object per logged step in dump_folder/metrics.jsonl")
    wandb: bool = opt(False, "log what TensorBoard gets to Weights & Biases from rank 0, with the resolved config "
                      "(WANDB_MODE=offline: a run folder under dump_folder/wandb, no network); a resumed job "
                      "continues the run whose id is saved in dump_folder/wandb_run_id; needs "
                      "pip install -e '.[tracking]'")
    wandb_project: str = opt("torchtitan_ext", "W&B project (the entity: WANDB_ENTITY or the account's default)")
    wandb_run_name: str = opt("", "W&B run name; empty: the dump folder's name")
    wandb_tags: list = opt([], "W&B run tags, e.g. [\"baseline\", \"debug\"] (comma-separated on the command line)")


@dataclass
class DataSection:
    dataset: str = opt("builtin", "the source, named by this key alone: builtin: the Python standard library's "
                       "sources; shards: *.bin files; trees: tree shards (python -m torchtitan_ext.data.prepare "
                       "--trees), with attention = 'tree'; domains: the [[data.domains]] tables; chat: "
                       "JSONL conversations ({\"messages\": [{\"role\", \"content\"}, ...]}) rendered with "
                       "the tokenizer's chat template, the loss on the assistant's tokens only",
                       choices=("builtin", "shards", "trees", "domains", "chat"))
    train_path: str = opt("", "shards, trees: glob or folder of training shards; chat: JSONL file, glob or folder")
    val_path: str = opt("", "shards, trees: glob or folder of validation shards; chat: JSONL (optional)")
    tokenizer: str = opt("builtin", "builtin (SentencePiece BPE trained on the corpus), byte, none (pretokenized "
                         "shards), a Hugging Face tokenizer.json or its folder, a .tiktoken file (':<encoding>' "
                         "names its split pattern, e.g. o200k.tiktoken:o200k_base), a SentencePiece .model, or "
                         "a saved run's tokenizer/ folder")
    tokenizer_vocab_size: int = opt(4096, "vocabulary of the builtin tokenizer", min=260)
    cache_dir: str = opt("~/.cache/torchtitan_ext", "tokenizer and built-in shards cache")
    shuffle: bool = opt(True, "shuffle sequence windows (seeded, per epoch)")
    domains: list = opt([], "[[data.domains]] tables {name, train, val, weight}: with dataset = 'domains', "
                        "train on weighted domains (replaces train_path / val_path)")
    mixing: str = opt("static", "domain weights: fixed, or the Zen update at every evaluation",
                      choices=("static", "adaptive"))
    mixing_rate: float = opt(0.01, "adaptive mixing step eta", min=0.0)
    mixing_floor: float = opt(0.0, "adaptive mixing: smallest domain weight", min=0.0, max=1.0)
    mixing_cap: float = opt(1.0, "adaptive mixing: largest domain weight", min=0.0, max=1.0)
    packing: str = opt("concat", "concat: windows cut from the token stream; bfd: whole documents packed "
                       "best-fit-decreasing into windows (padding ignored by the loss)", choices=("concat", "bfd"))
    attention: str = opt("causal", "causal: one causal stream per window; document: tokens attend only within "
                         "their document (documents end at end-of-text tokens); tree: each token sees its "
                         "node's earlier tokens and its ancestors (dataset = 'trees', whole trees per window)",
                         choices=("causal", "document", "tree"))
    position_reset: bool = opt(False, "RoPE positions restart at 0 in each document (document), or follow each "
                               "token's root-to-node path (tree)")


@dataclass
class EvalSection:
    interval: int = opt(0, "evaluate on the validation split every N steps; 0: only at the end", min=0)
    steps: int = opt(10, "validation windows per evaluation: steps x local_batch_size windows of seq_len, the "
                     "first steps x local_batch_size x seq_len + 1 tokens of each split whatever the rank count "
                     "(the trainer and python -m torchtitan_ext.eval alike); 0 disables evaluation", min=0)
    use_ema: bool = opt(False, "evaluate the EMA weights ([ema] decay > 0)")
    stride: int = opt(0, "0 scores non-overlapping windows; N > 0 slides windows by N tokens over the first "
                      "steps x local_batch_size x seq_len + 1 tokens of each validation split, each scored token "
                      "seeing seq_len - N tokens of context (trainer and python -m torchtitan_ext.eval)", min=0)


@dataclass
class CommSection:
    gradient_compression: str = opt("none", "Squinch 6-bit gradients on the DP reduction",
                                    choices=("none", "squinch"))
    error_feedback: bool = opt(False, "add this step's compression residual to the next gradient")
    min_numel: int = opt(1024, "tensors smaller than this go uncompressed", min=0)
    timeout_seconds: int = opt(1800, "process-group timeout: a collective stuck this long fails the job", min=1)


@dataclass
class Float8Section:
    enabled: bool = opt(False, "torchao float8 linears (a GPU of compute capability >= 8.9, or float8.emulate)")
    recipe: str = opt("tensorwise", "scaling recipe (blockwise: DeepSeek-V3's 1x128 / 128x128 block scales, "
                      "Hopper, no TP)", choices=("tensorwise", "rowwise", "rowwise_with_gw_hp", "blockwise"))
    filter_fqns: list = opt(["output"], "modules whose FQN contains one of these stay in bf16")
    include_output: bool = opt(False, "the output head in float8 too, whatever filter_fqns says (under TP: "
                               "each rank's vocabulary shard); not with training.fused_linear_ce")
    min_dim: int = opt(64, "linears with in/out features below this (or not divisible by 16; by 128 for "
                       "blockwise) stay in bf16", min=16)
    enable_fsdp_float8_all_gather: bool = opt(False, "all-gather FSDP params in float8 (tensorwise)")
    precompute_float8_dynamic_scale_for_fsdp: bool = opt(False, "one fused amax for all params "
                                                         "(tensorwise, FSDP float8 all-gather)")
    experts: bool = opt(False, "MoDE experts' grouped GEMMs in float8 rowwise (compute capability 9.0; token "
                        "groups padded to 16 rows); needs float8.enabled")
    emulate: bool = opt(False, "run the float8 casts and scales with high-precision GEMMs of the float8-rounded "
                        "operands, on any device (CPU included): for tests and debugging, not for speed")
    high_precision_eval: bool = opt(False, "validation runs the float8 linears and experts on their weights "
                                    "without float8 rounding, as python -m torchtitan_ext.eval, generation and "
                                    "exported checkpoints run the trained model; training is unchanged")


@dataclass
class DistillSection:
    path: str = opt("", "folder of teacher sidecars (python -m torchtitan_ext.distill.teacher) aligned with the "
                    "training shards; empty: no distillation")
    k: int = opt(0, "kept tokens used per position (0: all the sidecar's)", min=0)
    alpha: float = opt(0.5, "loss = (1 - alpha) x hard cross-entropy + alpha x soft cross-entropy", min=0.0, max=1.0)
    normalize: bool = opt(True, "normalise the Gumbel top-k soft targets to sum to 1")


@dataclass
class QuantSection:
    qat: str = opt("none", "fake-quantise squared-ReLU FFNs (input, weights, middle) with an STE",
                   choices=("none", "int8"))
    clamp: str = opt("dynamic", "QAT middle range: static [-4, 4] (16 after squaring), or dynamic "
                     "clamp_factor x rms(w_in) x sqrt(fan_in)", choices=("static", "dynamic"))
    clamp_factor: float = opt(4.0, "dynamic clamp, in standard deviations of the FFN's projected input",
                              min=0.1, max=100.0)
    int8_forward: bool = opt(False, "blocks' linear forward matmuls in int8 (per-tensor dynamic scales), "
                             "backward in the parameters' precision")


@dataclass
class ProfilingSection:
    enabled: bool = opt(False, "torch.profiler trace (Chrome JSON per rank) of steps start_step..end_step")
    start_step: int = opt(3, "first profiled step", min=1)
    end_step: int = opt(4, "last profiled step (>= start_step)", min=1)
    memory_snapshot: bool = opt(False, "also a CUDA memory snapshot (pickle for pytorch.org/memory_viz) of those "
                                "steps; GPU only")
    with_stack: bool = opt(False, "record the Python stack of every op (larger traces; the stacks let the GPU's "
                           "idle time be charged to the host code running in it)")
    folder: str = opt("profile", "sub-folder of job.dump_folder")


@dataclass
class EMASection:
    decay: float = opt(0.0, "EMA of the parameters (float32, sharded like them); 0 disables, e.g. 0.999",
                       min=0.0, max=1.0)
    every: int = opt(1, "update the EMA every N steps", min=1)
    start_step: int = opt(0, "first step that updates the EMA (it starts as a copy of the parameters)", min=0)


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
    distill: DistillSection = field(default_factory=DistillSection)
    quant: QuantSection = field(default_factory=QuantSection)
    ema: EMASection = field(default_factory=EMASection)
    profiling: ProfilingSection = field(default_factory=ProfilingSection)
