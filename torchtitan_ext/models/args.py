"""The hyper-parameters of one decoder. Flavors (flavors.py) are named instances of this."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ComputeOptions:
    """How a run computes the model, not what it computes (the builder derives them from the job config)."""
    fused_norm: bool = False  # Triton residual add + RMSNorm and QK-norm + RoPE (training.kernels, not under TP)
    fused_activation: bool = False  # Triton SwiGLU / squared ReLU (training.kernels)
    attention_z_reg: float = 0.0  # attention Z-reg coefficient (gradient only)
    return_hidden: bool = False  # the head is applied by the loss (training.fused_linear_ce)
    attention_kernel: str = "sdpa"  # causal kernel on CUDA: cudnn, flash, or sdpa (ops.attention_backend.causal_kernel)


@dataclass(frozen=True)
class ModelArgs:
    vocab_size: int = 0  # 0: taken from the tokenizer
    dim: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 0  # 0: n_heads (no GQA)
    head_dim: int = 0  # 0: dim // n_heads
    ffn_hidden: int = 768
    activation: str = "swiglu"  # "swiglu" or "relu2" (squared ReLU, two matrices)
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    # Llama-3 RoPE scaling ("none" or "llama3"): long-wavelength frequencies divided by rope_scaling_factor,
    # short ones kept, a smooth blend between (the wavelengths are measured against rope_original_max_seq_len).
    # The defaults of the other fields are Llama 3.1's.
    rope_scaling: str = "none"
    rope_scaling_factor: float = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_seq_len: int = 8192
    rope_fraction: float = 1.0  # fraction of each head's dims rotated (partial RoPE)
    nope_every: int = 0  # N > 0: every Nth layer (N-1, 2N-1, ...) uses no positional encoding (RNoPE)
    qk_norm: bool = False
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    logit_softcap: float = 0.0  # > 0: logits = cap * tanh(logits / cap)
    residual_scalars: bool = False  # a learnable scalar on each residual branch (INT8 training stability)
    # MoDE (Mixture of Distilled Experts); n_experts = 0 keeps every FFN dense.
    n_experts: int = 0
    top_k: int = 2
    moe_hidden: int = 0  # 0: ffn_hidden
    moe_every: int = 1  # MoDE on layers i with i % moe_every == moe_every - 1; the rest dense
    shared_expert: bool = False
    renormalize_gates: bool = True
    aux_loss_coef: float = 0.01  # Switch-style load-balancing loss; 0 disables
    router_z_loss_coef: float = 0.001  # logsumexp(router logits)^2
    bias_update_rate: float = 0.0  # > 0: auxiliary-loss-free balancing (per-expert routing bias)
    force_balanced_routing: bool = False  # benchmarks: round-robin experts, the system at perfect balance
    # Interleaved cross-layer KV sharing: in each group of kv_share_group layers only the first computes K/V.
    kv_share: str = "none"  # "none" or "interleaved"
    kv_share_group: int = 2
    # "standard" or "mup" (Maximal Update Parametrization, Tensor Programs V): hyperparameters tuned at width
    # mup_base_dim carry over to other widths (decoder.py: init, attention scale, logits; train/optim.py: lrs).
    parametrization: str = "standard"
    mup_base_dim: int = 0  # the width the hyperparameters were tuned at; 0: dim (no width scaling); muP only
    mup_base_head_dim: int = 0  # the head_dim at mup_base_dim; 0: head_dim (the heads' count grows with width)

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def hdim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def rope_dims(self) -> int:
        """Rotated dims per head: the fraction rounded down to an even number."""
        return int(self.hdim * self.rope_fraction) // 2 * 2

    @property
    def expert_hidden(self) -> int:
        return self.moe_hidden or self.ffn_hidden

    @property
    def width_mult(self) -> float:
        """muP's dim / mup_base_dim; 1 at the base width and under the standard parametrization."""
        if self.parametrization != "mup" or not self.mup_base_dim:
            return 1.0
        return self.dim / self.mup_base_dim

    @property
    def attention_scale(self) -> float | None:
        """The softmax's logit scale: None (1 / sqrt(head_dim)), or muP's sqrt(base_head_dim) / head_dim: q and k
        become correlated during training, so their dot product grows like head_dim, not its square root. The
        multiplier sqrt(base_head_dim) makes the base model's scale the standard one, so a base model tuned
        either way is the same model (a bare 1 / head_dim flattens the attention 8x at head_dim 64, and with
        QK-norm holding q and k at unit RMS it trained clearly worse)."""
        if self.parametrization != "mup":
            return None
        return (self.mup_base_head_dim or self.hdim) ** 0.5 / self.hdim

    @property
    def output_multiplier(self) -> float:
        """muP multiplies the logits by mup_base_dim / dim: the head's input grows correlated with its weights'
        updates, so without it the logits' change per step would grow with width."""
        return 1.0 / self.width_mult

    def uses_rope(self, layer: int) -> bool:
        return self.rope_dims > 0 and not (self.nope_every and layer % self.nope_every == self.nope_every - 1)

    def computes_kv(self, layer: int) -> bool:
        """Whether this layer has its own wk / wv (always, unless it reuses its group's first layer's K/V)."""
        return self.kv_share == "none" or layer % self.kv_share_group == 0

    def is_moe(self, layer: int) -> bool:
        return self.n_experts > 0 and layer % self.moe_every == self.moe_every - 1

    def validate(self) -> None:
        """Raise ValueError naming the first inconsistent field."""
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "ffn_hidden", "max_seq_len", "rope_theta",
                     "norm_eps"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} = {getattr(self, name)}: expected > 0")
        for name in ("n_kv_heads", "head_dim", "nope_every", "logit_softcap", "n_experts", "moe_hidden",
                     "aux_loss_coef", "router_z_loss_coef", "bias_update_rate", "mup_base_dim", "mup_base_head_dim"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} = {getattr(self, name)}: expected >= 0")
        for name in ("moe_every", "kv_share_group"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} = {getattr(self, name)}: expected >= 1")
        for name, allowed in (("activation", ("swiglu", "relu2")), ("kv_share", ("none", "interleaved")),
                              ("rope_scaling", ("none", "llama3")), ("parametrization", ("standard", "mup"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} = {getattr(self, name)!r}: expected {' or '.join(map(repr, allowed))}")
        if not self.head_dim and self.dim % self.n_heads:
            raise ValueError(f"dim = {self.dim} is not divisible by n_heads = {self.n_heads}")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"n_heads = {self.n_heads} is not divisible by n_kv_heads = {self.kv_heads}")
        if not 0.0 <= self.rope_fraction <= 1.0:
            raise ValueError(f"rope_fraction = {self.rope_fraction}: expected within [0, 1]")
        if self.n_experts and not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k = {self.top_k}: expected between 1 and n_experts = {self.n_experts}")
        if self.rope_scaling == "llama3":
            for name in ("rope_scaling_factor", "rope_low_freq_factor", "rope_original_max_seq_len"):
                if not getattr(self, name) > 0:
                    raise ValueError(f"{name} = {getattr(self, name)}: expected > 0")
            if not self.rope_high_freq_factor > self.rope_low_freq_factor:
                raise ValueError(f"rope_high_freq_factor = {self.rope_high_freq_factor}: expected > "
                                 f"rope_low_freq_factor = {self.rope_low_freq_factor}")
