"""Configuration of a torchtitan_ext decoder exported to Hugging Face (written beside the weights, loaded with
``trust_remote_code=True``). Self-contained: it imports only transformers.

The usual transformers keys hold what they mean everywhere (``hidden_size``, ``num_key_value_heads``,
``rope_parameters`` of type ``default`` or ``llama3``, ``num_experts_per_tok``, ...); the features no
transformers architecture has keep their torchtitan_ext names (``rope_fraction``, ``nope_every``,
``logit_softcap``, ``residual_scalars``, ``kv_share``, ``activation``, MoDE's ``shared_expert``, muP's
``parametrization``, ...).
"""

from transformers import PretrainedConfig


class TorchtitanExtConfig(PretrainedConfig):
    model_type = "torchtitan_ext"
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, vocab_size: int = 32000, hidden_size: int = 256, intermediate_size: int = 768,
                 num_hidden_layers: int = 4, num_attention_heads: int = 4, num_key_value_heads: int | None = None,
                 head_dim: int | None = None, max_position_embeddings: int = 2048, rms_norm_eps: float = 1e-5,
                 tie_word_embeddings: bool = False, rope_parameters: dict | None = None,
                 activation: str = "swiglu", rope_fraction: float = 1.0, nope_every: int = 0,
                 qk_norm: bool = False, logit_softcap: float = 0.0, residual_scalars: bool = False,
                 num_experts: int = 0, num_experts_per_tok: int = 2, moe_intermediate_size: int = 0,
                 moe_every: int = 1, shared_expert: bool = False, norm_topk_prob: bool = True,
                 aux_loss_coef: float = 0.01, router_z_loss_coef: float = 0.001, bias_update_rate: float = 0.0,
                 kv_share: str = "none", kv_share_group: int = 2, parametrization: str = "standard",
                 mup_base_dim: int = 0, mup_base_head_dim: int = 0, use_cache: bool = True, **kwargs):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads or num_attention_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.max_position_embeddings = max_position_embeddings
        self.rms_norm_eps = rms_norm_eps
        self.tie_word_embeddings = tie_word_embeddings
        # {"rope_type": "default" or "llama3", "rope_theta": ..., and for llama3: "factor", "low_freq_factor",
        # "high_freq_factor", "original_max_position_embeddings"}
        self.rope_parameters = rope_parameters or {"rope_type": "default", "rope_theta": 10000.0}
        self.activation = activation  # "swiglu" or "relu2" (squared ReLU) for the dense FFNs
        self.rope_fraction = rope_fraction  # the first rope_dims dims of each head are rotated, the rest pass
        self.nope_every = nope_every  # N > 0: layers N-1, 2N-1, ... have no positional encoding
        self.qk_norm = qk_norm
        self.logit_softcap = logit_softcap  # > 0: logits = cap * tanh(logits / cap)
        self.residual_scalars = residual_scalars  # a learnt scale on each block's attention and FFN branch
        self.num_experts = num_experts  # MoDE: 0 keeps every FFN dense
        self.num_experts_per_tok = num_experts_per_tok
        self.moe_intermediate_size = moe_intermediate_size  # 0: intermediate_size
        self.moe_every = moe_every  # MoDE on layers i with i % moe_every == moe_every - 1
        self.shared_expert = shared_expert
        self.norm_topk_prob = norm_topk_prob
        self.aux_loss_coef = aux_loss_coef  # training only (the logits do not depend on it)
        self.router_z_loss_coef = router_z_loss_coef  # training only
        self.bias_update_rate = bias_update_rate  # > 0: expert_bias takes part in choosing the experts
        self.kv_share = kv_share  # "interleaved": layers reuse their group's first layer's keys and values
        self.kv_share_group = kv_share_group
        # "mup": attention logits scaled by sqrt(mup_base_head_dim or head_dim) / head_dim (not 1 / its square
        # root), the head's input by mup_base_dim / hidden_size (when mup_base_dim > 0)
        self.parametrization = parametrization
        self.mup_base_dim = mup_base_dim
        self.mup_base_head_dim = mup_base_head_dim
        self.use_cache = use_cache
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)
