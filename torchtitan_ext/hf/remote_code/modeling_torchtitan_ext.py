"""A torchtitan_ext decoder in plain PyTorch for transformers (written beside the weights, loaded with
``trust_remote_code=True``). Self-contained: it imports only torch and transformers.

It computes what torchtitan_ext's ``Decoder`` computes, module for module and with its parameter names:
pre-norm blocks ``h = x + a * attention(norm(x)); out = h + f * ffn(norm(h))`` (``a``, ``f``: the residual
scalars when there are any). Attention has GQA, per-head RMSNorm on queries and keys (QK-norm) before RoPE,
RoPE on the first ``rope_dims`` dims of each head (the two halves of those dims rotated together, the rest
passing unchanged), no positional encoding on every Nth layer, and optional interleaved KV sharing (a layer
that is not first in its group reuses the first layer's normalised, rotated keys and values). The FFN is
SwiGLU, squared ReLU, or MoDE: a float32 softmax router choosing the top-k experts (an ``expert_bias`` added
for the choice only when ``bias_update_rate > 0``), gates renormalised over the chosen when
``norm_topk_prob``, plus an optional ungated shared expert. The head may be tied to the embedding and its
logits soft-capped. Under muP (``parametrization = "mup"``) attention scales its logits by
sqrt(mup_base_head_dim) / head_dim instead of 1 / sqrt(head_dim), and the head's input is multiplied by
mup_base_dim / hidden_size.
"""

import math

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import DynamicCache, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_torchtitan_ext import TorchtitanExtConfig

KV = tuple[torch.Tensor, torch.Tensor]  # keys, values (batch, kv_heads, seq, head_dim)


def rope_dims(config: TorchtitanExtConfig) -> int:
    """Rotated dims per head: ``rope_fraction`` of the head rounded down to an even number."""
    return int(config.head_dim * config.rope_fraction) // 2 * 2


def rope_angles(config: TorchtitanExtConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (batch, seq, rope_dims / 2) at ``positions`` (batch, seq), computed in float64.

    ``llama3`` scaling divides the frequencies whose wavelength fits fewer than ``low_freq_factor`` times in
    the original context by ``factor``, keeps those fitting more than ``high_freq_factor`` times and blends
    the two linearly in between."""
    half = rope_dims(config) // 2
    rope = config.rope_parameters
    inv_freq = 1.0 / (rope["rope_theta"] ** (torch.arange(half, device=positions.device, dtype=torch.float64)
                                             / max(half, 1)))
    if rope.get("rope_type", "default") == "llama3":
        fits = rope["original_max_position_embeddings"] * inv_freq / (2 * math.pi)
        lo, hi = rope["low_freq_factor"], rope["high_freq_factor"]
        keep = ((fits - lo) / (hi - lo)).clamp(0.0, 1.0)
        inv_freq = keep * inv_freq + (1.0 - keep) * inv_freq / rope["factor"]
    angles = positions.double()[..., None] * inv_freq
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first 2 * half dims of x (batch, seq, heads, head_dim) as (first half, second half) pairs."""
    half = cos.shape[-1]
    x1, x2, rest = x[..., :half], x[..., half:2 * half], x[..., 2 * half:]
    cos, sin = cos[:, :, None, :].to(x.dtype), sin[:, :, None, :].to(x.dtype)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest), dim=-1)


class Attention(nn.Module):
    """GQA attention; a KV-sharing consumer (``computes_kv`` false) has no wk / wv / k_norm."""

    def __init__(self, config: TorchtitanExtConfig, layer: int):
        super().__init__()
        dim, hd, kv_heads = config.hidden_size, config.head_dim, config.num_key_value_heads
        self.layer, self.head_dim = layer, hd
        base_hd = getattr(config, "mup_base_head_dim", 0) or hd
        self.scale = base_hd ** 0.5 / hd if config.parametrization == "mup" else None  # None: 1 / sqrt(hd)
        nope = config.nope_every and layer % config.nope_every == config.nope_every - 1
        self.use_rope = rope_dims(config) > 0 and not nope
        self.computes_kv = config.kv_share == "none" or layer % config.kv_share_group == 0
        self.wq = nn.Linear(dim, config.num_attention_heads * hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * hd, bias=False) if self.computes_kv else None
        self.wv = nn.Linear(dim, kv_heads * hd, bias=False) if self.computes_kv else None
        self.wo = nn.Linear(config.num_attention_heads * hd, dim, bias=False)
        self.q_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = nn.RMSNorm(hd, eps=config.rms_norm_eps) if config.qk_norm and self.computes_kv else None

    def _norm_rotate(self, x: torch.Tensor, norm: nn.Module | None, cos: torch.Tensor, sin: torch.Tensor
                     ) -> torch.Tensor:
        x = norm(x) if norm is not None else x
        return apply_rope(x, cos, sin) if self.use_rope else x

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: DynamicCache | None, shared_kv: KV | None) -> tuple[torch.Tensor, KV]:
        """x (batch, seq, dim); ``mask`` None (causal) or bool (batch or 1, 1, seq, keys); ``shared_kv`` the
        group's (keys, values) for a consumer. Returns (out, (keys, values) for the rest of the group)."""
        b, t, _ = x.shape
        q = self._norm_rotate(self.wq(x).view(b, t, -1, self.head_dim), self.q_norm, cos, sin).transpose(1, 2)
        if self.computes_kv:
            k = self._norm_rotate(self.wk(x).view(b, t, -1, self.head_dim), self.k_norm, cos, sin).transpose(1, 2)
            v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            if cache is not None:
                k, v = cache.update(k, v, self.layer)
        else:
            k, v = shared_kv
        group = q.shape[1] // k.shape[1]  # query head h reads key/value head h // group
        out = F.scaled_dot_product_attention(q, k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1),
                                             attn_mask=mask, is_causal=mask is None, scale=self.scale)
        return self.wo(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class FeedForward(nn.Module):
    """SwiGLU ``w2(silu(w1 x) * w3 x)`` or squared ReLU ``w2(relu(w1 x)^2)`` (no w3)."""

    def __init__(self, dim: int, hidden: int, activation: str = "swiglu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False) if activation == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is None:
            return self.w2(F.relu(self.w1(x)).square())
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """E SwiGLU experts stacked along dim 0: w1, w3 (E, hidden, dim), w2 (E, dim, hidden)."""

    def __init__(self, n: int, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(n, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(n, dim, hidden))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """x (tokens, dim), idx and gates (tokens, k): each token's gate-weighted sum of its experts, float32."""
        out = torch.zeros(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
        for e in range(self.w1.shape[0]):
            rows, slot = torch.where(idx == e)
            if rows.numel():
                h = x[rows]
                y = (F.silu(h @ self.w1[e].t()) * (h @ self.w3[e].t())) @ self.w2[e].t()
                out.index_add_(0, rows, y.float() * gates[rows, slot, None])
        return out


class MoDE(nn.Module):
    """Top-k routed experts, plus the shared expert when there is one."""

    def __init__(self, config: TorchtitanExtConfig):
        super().__init__()
        dim, n = config.hidden_size, config.num_experts
        hidden = config.moe_intermediate_size or config.intermediate_size
        self.top_k, self.renormalize = config.num_experts_per_tok, config.norm_topk_prob
        self.biased = config.bias_update_rate > 0
        self.router = nn.Linear(dim, n, bias=False)
        self.experts = Experts(n, dim, hidden)
        self.shared_expert = FeedForward(dim, hidden) if config.shared_expert else None
        self.register_buffer("expert_bias", torch.zeros(n), persistent=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = self.router(x).float().softmax(dim=-1)
        idx = (probs + self.expert_bias if self.biased else probs).topk(self.top_k, dim=-1).indices
        gates = probs.gather(1, idx)
        if self.renormalize:
            gates = gates / gates.sum(dim=-1, keepdim=True)
        out = self.experts(x, idx, gates).to(x.dtype)
        if self.shared_expert is not None:
            out = out + self.shared_expert(x)
        return out.reshape(shape)


class Block(nn.Module):
    def __init__(self, config: TorchtitanExtConfig, layer: int):
        super().__init__()
        self.attention_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = Attention(config, layer)
        self.ffn_norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.num_experts > 0 and layer % config.moe_every == config.moe_every - 1:
            self.feed_forward = MoDE(config)
        else:
            self.feed_forward = FeedForward(config.hidden_size, config.intermediate_size, config.activation)
        self.residual_scale = nn.Parameter(torch.ones(2)) if config.residual_scalars else None

    def _scaled(self, i: int, branch: torch.Tensor) -> torch.Tensor:
        return branch if self.residual_scale is None else branch * self.residual_scale[i].to(branch.dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor | None,
                cache: DynamicCache | None, shared_kv: KV | None) -> tuple[torch.Tensor, KV]:
        attn, kv = self.attention(self.attention_norm(x), cos, sin, mask, cache, shared_kv)
        h = x + self._scaled(0, attn)
        return h + self._scaled(1, self.feed_forward(self.ffn_norm(h))), kv


class Decoder(nn.Module):
    """Embedding -> blocks -> final norm (the head is ``TorchtitanExtForCausalLM.lm_head``)."""

    def __init__(self, config: TorchtitanExtConfig):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(Block(config, i) for i in range(config.num_hidden_layers))
        self.norm = nn.RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, cache: DynamicCache | None = None) -> torch.Tensor:
        """Hidden states (batch, seq, dim) of ``input_ids`` placed after the cache's tokens. ``attention_mask``
        (batch, cached + seq) marks real tokens with 1 (left or right padding); positions then count from each
        row's first real token unless ``position_ids`` gives them."""
        b, t = input_ids.shape
        past = cache.get_seq_length() if cache is not None else 0
        device = input_ids.device
        if position_ids is None:
            if attention_mask is not None:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, past:past + t]
            else:
                position_ids = torch.arange(past, past + t, device=device)[None].expand(b, t)
        cos, sin = rope_angles(self.config, position_ids)
        mask = None  # causal
        if attention_mask is not None or past:
            query = past + torch.arange(t, device=device)
            key = torch.arange(past + t, device=device)
            mask = (key[None, :] <= query[:, None])[None]  # (1, seq, keys)
            if attention_mask is not None:
                # Padding keys are hidden; a padding query sees only itself (its output is never used).
                mask = (mask & attention_mask[:, None, :past + t].bool()) | (key[None, :] == query[:, None])[None]
            mask = mask[:, None]
        h = self.tok_embeddings(input_ids)
        kv = None
        for block in self.layers:
            h, kv = block(h, cos, sin, mask, cache, kv)
        return self.norm(h)


class TorchtitanExtForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = TorchtitanExtConfig
    base_model_prefix = "model"
    _no_split_modules = ["Block"]
    _input_embed_layer = "tok_embeddings"
    _tied_weights_keys = {"lm_head.weight": "model.tok_embeddings.weight"}

    def __init__(self, config: TorchtitanExtConfig):
        super().__init__(config)
        self.model = Decoder(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        mup = config.parametrization == "mup" and config.mup_base_dim
        self.output_multiplier = 1.0 / (config.hidden_size / config.mup_base_dim) if mup else 1.0
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        """Fresh weights (only for those a checkpoint does not hold): the defaults, plus the modules transformers
        does not know."""
        super()._init_weights(module)
        with torch.no_grad():
            if isinstance(module, Experts):
                for w in (module.w1, module.w2, module.w3):
                    if not getattr(w, "_is_hf_initialized", False):
                        w.normal_(0.0, getattr(self.config, "initializer_range", 0.02))
            elif isinstance(module, Block) and module.residual_scale is not None:
                if not getattr(module.residual_scale, "_is_hf_initialized", False):
                    module.residual_scale.fill_(1.0)

    def get_output_embeddings(self) -> nn.Module:
        return self.lm_head

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values: DynamicCache | None = None,
                labels: torch.Tensor | None = None, use_cache: bool | None = None, logits_to_keep: int = 0,
                **kwargs) -> CausalLMOutputWithPast:
        """Logits (and with ``labels`` the mean next-token cross-entropy, -100 ignored). ``use_cache`` keeps
        the keys and values in ``past_key_values`` (a transformers ``DynamicCache``) for generation."""
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = DynamicCache()
        cache = past_key_values if use_cache else None
        h = self.model(input_ids, attention_mask, position_ids, cache)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.lm_head(h if self.output_multiplier == 1.0 else h * self.output_multiplier)
        cap = self.config.logit_softcap
        if cap > 0:
            logits = cap * torch.tanh(logits / cap)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten().to(logits.device),
                                   ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)
