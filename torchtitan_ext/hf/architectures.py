"""Our ``ModelArgs`` <-> a transformers architecture: config.json and tensor names.

The plain decoder is ``LlamaForCausalLM``; with QK-norm it is ``Qwen3ForCausalLM`` (RMSNorm over each head's
dims before RoPE, as ours); with NoPE every Nth layer it is ``SmolLM3ForCausalLM`` (``no_rope_layers``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torchtitan_ext.config.loader import ConfigError
from torchtitan_ext.models.args import ModelArgs

# Our FQN pieces -> transformers' (Llama-family naming).
_BLOCK = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
          "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
          "feed_forward.w2": "mlp.down_proj"}


class ExportError(ConfigError):
    """A model or folder that cannot be converted; the message is one line naming the feature or file."""


@dataclass(frozen=True)
class HFLayout:
    """How one of our models is written as a transformers folder."""
    architecture: str  # config.json's "architectures"[0]
    native: bool  # a transformers class; False: our modeling file, loaded with trust_remote_code=True
    config: dict  # config.json (the exporter adds torch_dtype and the tokenizer's ids)
    # our state-dict key -> the transformers tensor name, or one name per expert when ours stacks the experts
    # along dim 0 (ours[e] == theirs[names[e]])
    names: dict[str, tuple[str, ...]]


def architecture(a: ModelArgs) -> str:
    """The transformers architecture computing the same function as ``a``, or ExportError."""
    if a.n_experts > 0:
        raise ExportError("export: MoDE layers (model.n_experts > 0) have no equivalent transformers "
                          "architecture (routing bias, gate renormalisation, shared expert)")
    if a.activation != "swiglu":
        raise ExportError(f"export: activation {a.activation!r} has no equivalent transformers Llama-family "
                          "architecture (only SwiGLU)")
    if getattr(a, "kv_share", "none") != "none":
        raise ExportError("export: KV sharing (model.kv_share) has no equivalent transformers architecture")
    if getattr(a, "residual_scalars", False):
        raise ExportError("export: residual branch scalars (model.residual_scalars) are not in the Llama family")
    if a.logit_softcap > 0:
        raise ExportError("export: logit soft-cap (logit_softcap > 0) is not in the Llama family")
    if a.rope_dims != a.hdim:
        raise ExportError(f"export: partial RoPE (rope_fraction = {a.rope_fraction}) has no equivalent "
                          "transformers architecture with this layout")
    if a.nope_every and a.qk_norm:
        raise ExportError("export: NoPE layers together with QK-norm have no equivalent transformers "
                          "architecture (SmolLM3 has NoPE layers without QK-norm, Qwen3 QK-norm without NoPE)")
    if a.nope_every:
        return "SmolLM3ForCausalLM"
    return "Qwen3ForCausalLM" if a.qk_norm else "LlamaForCausalLM"


def hf_config(a: ModelArgs) -> dict:
    arch = architecture(a)
    cfg = {"architectures": [arch], "vocab_size": a.vocab_size, "hidden_size": a.dim,
           "intermediate_size": a.ffn_hidden, "num_hidden_layers": a.n_layers,
           "num_attention_heads": a.n_heads, "num_key_value_heads": a.kv_heads, "head_dim": a.hdim,
           "hidden_act": "silu", "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps,
           "tie_word_embeddings": a.tie_embeddings, "attention_bias": False, "mlp_bias": False,
           "rope_theta": a.rope_theta, "rope_parameters": {"rope_type": "default", "rope_theta": a.rope_theta},
           "torch_dtype": "float32", "pad_token_id": None, "bos_token_id": None, "eos_token_id": None}
    if arch == "LlamaForCausalLM":
        cfg["model_type"] = "llama"
    elif arch == "Qwen3ForCausalLM":
        cfg.update(model_type="qwen3", use_sliding_window=False)
    else:
        cfg.update(model_type="smollm3", use_sliding_window=False, no_rope_layer_interval=a.nope_every,
                   no_rope_layers=[int(a.uses_rope(i)) for i in range(a.n_layers)])
    return cfg


def hf_name(name: str) -> str:
    """transformers' name of one of our state-dict entries."""
    if name.startswith("layers."):
        _, i, rest = name.split(".", 2)
        mod, leaf = rest.rsplit(".", 1)
        return f"model.layers.{i}.{_BLOCK[mod]}.{leaf}"
    return {"tok_embeddings.weight": "model.embed_tokens.weight", "norm.weight": "model.norm.weight",
            "output.weight": "lm_head.weight"}[name]


def state_names(a: ModelArgs) -> list[str]:
    """Our state-dict keys for ``a`` (built on the meta device: no memory)."""
    import torch

    from torchtitan_ext.models.decoder import Decoder

    with torch.device("meta"):
        return list(Decoder(a).state_dict())


def hf_layout(a: ModelArgs) -> HFLayout:
    config = hf_config(a)
    return HFLayout(config["architectures"][0], True, config, {k: (hf_name(k),) for k in state_names(a)})


def args_from_config(c: dict, where: str) -> ModelArgs:
    """The ``ModelArgs`` of a transformers config.json (``where`` names the file in errors)."""
    if not isinstance(c, dict):
        raise ExportError(f"{where}: not a JSON object")
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "rms_norm_eps")
    missing_keys = [k for k in required if k not in c]
    if missing_keys:
        raise ExportError(f"{where}: no {missing_keys[0]!r} (expected a Llama / Qwen3 / SmolLM3 config)")
    rope = c.get("rope_parameters") or {}
    nope_every = int(c.get("no_rope_layer_interval", 0)) if c.get("model_type") == "smollm3" else 0
    args = ModelArgs(vocab_size=c["vocab_size"], dim=c["hidden_size"], n_layers=c["num_hidden_layers"],
                     n_heads=c["num_attention_heads"], n_kv_heads=c.get("num_key_value_heads") or 0,
                     head_dim=c.get("head_dim") or 0, ffn_hidden=c["intermediate_size"],
                     max_seq_len=c["max_position_embeddings"],
                     rope_theta=float(rope.get("rope_theta", c.get("rope_theta", 10000.0))),
                     nope_every=nope_every, qk_norm=c.get("model_type") == "qwen3",
                     norm_eps=c["rms_norm_eps"], tie_embeddings=bool(c.get("tie_word_embeddings", False)))
    hf_config(args)  # the same set of architectures as export
    return args
