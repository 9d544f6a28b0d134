"""Our ``ModelArgs`` <-> a transformers architecture: config.json and tensor names.

Export (``hf_layout``) picks a native transformers class whenever one computes exactly our function:

* ``LlamaForCausalLM``: the plain decoder (SwiGLU, full RoPE, optional Llama-3 RoPE scaling, tied head);
* ``Qwen3ForCausalLM``: with QK-norm (per-head RMSNorm before RoPE, as ours);
* ``SmolLM3ForCausalLM``: with NoPE every Nth layer (``no_rope_layers``) and no QK-norm;
* ``MixtralForCausalLM``: MoDE on every layer, renormalised gates, no QK-norm;
* ``Qwen3MoeForCausalLM``: MoDE with QK-norm (``decoder_sparse_step`` = moe_every, ``norm_topk_prob`` =
  renormalize_gates).

Both MoE classes route as MoDE does (float32 softmax, top-k on the probabilities, gates the chosen
probabilities); neither has a shared expert or a routing bias. Anything else (partial RoPE, NoPE with
QK-norm, soft-cap, residual scalars, KV sharing, squared ReLU, muP, the other MoDE variants) is the custom
architecture ``TorchtitanExtForCausalLM``: the modeling file of ``remote_code/`` beside the weights, loaded
with ``trust_remote_code=True``, whose modules and tensor names are ours under ``model.`` (the head
``lm_head``). Import (``args_from_config``) maps those six configs back, refusing in one line any key whose
value we do not compute (other RoPE types, biases, sliding windows, other activations).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import NamedTuple

from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.args import ModelArgs

CUSTOM_ARCHITECTURE = "TorchtitanExtForCausalLM"
CUSTOM_MODEL_TYPE = "torchtitan_ext"
REMOTE_CODE = Path(__file__).parent / "remote_code"
_AUTO_MAP = {"AutoConfig": "configuration_torchtitan_ext.TorchtitanExtConfig",
             "AutoModelForCausalLM": "modeling_torchtitan_ext.TorchtitanExtForCausalLM"}
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM", "smollm3": "SmolLM3ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                CUSTOM_MODEL_TYPE: CUSTOM_ARCHITECTURE}
_ARCH_TYPES = {arch: model_type for model_type, arch in _MODEL_TYPES.items()}

# transformers' defaults for the keys a Hub config.json may leave out (the config classes' own defaults;
# head_dim None: hidden_size / num_attention_heads, num_key_value_heads None: num_attention_heads).
_DEFAULTS = {
    "llama": {"num_key_value_heads": None, "head_dim": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 2048,
              "tie_word_embeddings": False, "rope_theta": 10000.0},
    "qwen3": {"num_key_value_heads": 32, "head_dim": 128, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
              "tie_word_embeddings": False, "rope_theta": 10000.0, "max_window_layers": 28},
    "smollm3": {"num_key_value_heads": 4, "head_dim": None, "rms_norm_eps": 1e-6, "max_position_embeddings": 32768,
                "tie_word_embeddings": True, "rope_theta": 2000000.0, "no_rope_layer_interval": 4},
    "mixtral": {"num_key_value_heads": 8, "head_dim": None, "rms_norm_eps": 1e-5,
                "max_position_embeddings": 131072, "tie_word_embeddings": False, "rope_theta": 1000000.0,
                "num_local_experts": 8, "num_experts_per_tok": 2},
    "qwen3_moe": {"num_key_value_heads": 4, "head_dim": None, "rms_norm_eps": 1e-6,
                  "max_position_embeddings": 32768, "tie_word_embeddings": False, "rope_theta": 10000.0,
                  "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                  "decoder_sparse_step": 1, "norm_topk_prob": False},
    CUSTOM_MODEL_TYPE: {"num_key_value_heads": None, "head_dim": None, "rms_norm_eps": ModelArgs.norm_eps,
                        "max_position_embeddings": ModelArgs.max_seq_len, "tie_word_embeddings": False,
                        "rope_theta": ModelArgs.rope_theta},
}

# The custom config: ModelArgs fields under their usual transformers key; every other field (``_OWN_KEYS``)
# under its own name; the RoPE fields inside ``rope_parameters``.
_HF_KEYS = {"vocab_size": "vocab_size", "dim": "hidden_size", "n_layers": "num_hidden_layers",
            "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
            "ffn_hidden": "intermediate_size", "max_seq_len": "max_position_embeddings", "norm_eps": "rms_norm_eps",
            "tie_embeddings": "tie_word_embeddings", "n_experts": "num_experts", "top_k": "num_experts_per_tok",
            "moe_hidden": "moe_intermediate_size", "renormalize_gates": "norm_topk_prob"}
_ROPE_FIELDS = ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor",
                "rope_high_freq_factor", "rope_original_max_seq_len")
# ``force_balanced_routing`` (a benchmark setting) is not exported: a model out of the trainer routes by its router.
_OWN_KEYS = tuple(f.name for f in dataclasses.fields(ModelArgs)
                  if f.name not in (*_HF_KEYS, *_ROPE_FIELDS, "force_balanced_routing"))

# Our FQN pieces -> transformers' (Llama-family naming).
_BLOCK = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
          "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
          "feed_forward.w2": "mlp.down_proj"}
# MoDE pieces -> the Hub names of each MoE class (transformers 5 stacks the per-expert tensors on load).
_MOE = {"MixtralForCausalLM": ("block_sparse_moe.gate", "block_sparse_moe.experts.{e}.",
                               {"w1": "w1", "w3": "w3", "w2": "w2"}),
        "Qwen3MoeForCausalLM": ("mlp.gate", "mlp.experts.{e}.",
                                {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})}


class ExportError(ConfigError):
    """A model or folder that cannot be converted; the message is one line naming the feature or file."""


class HFLayout(NamedTuple):
    """How one of our models is written as a transformers folder.

    ``names`` has every key of ``Decoder(args).state_dict()``; its value is

    * one name: the tensor under that name, same shape (experts stay stacked in the custom architecture);
    * one name per expert (MoDE's stacked ``experts.w1/w3/w2`` in a native MoE class, at least 2 experts):
      ``ours[e]`` is the tensor named ``names[key][e]``;
    * no name: nothing is written. Only MoDE's ``expert_bias`` buffer in a native MoE class, chosen only
      when ``bias_update_rate == 0``, where the bias takes no part in the forward pass; the importer leaves
      it at zero (``Decoder.init_buffers``).
    """
    architecture: str  # config.json's "architectures"[0]
    native: bool  # a transformers class; False: our modeling file, loaded with trust_remote_code=True
    config: dict  # config.json (the exporter adds torch_dtype and the tokenizer's ids)
    names: dict[str, tuple[str, ...]]
    reason: str = ""  # why no transformers class computes the model (custom architecture only)


def stacked(names: tuple[str, ...]) -> bool:
    """Whether our tensor is written as one transformers tensor per expert (ours stacks them along dim 0)."""
    return len(names) > 1


def _custom_reason(a: ModelArgs) -> str:
    """The first feature of ``a`` that no native class computes, or "" when one does."""
    checks = [(a.activation != "swiglu", f"squared ReLU (activation = {a.activation!r})"),
              (a.rope_dims != a.hdim, f"partial RoPE (rope_fraction = {a.rope_fraction})"),
              (a.logit_softcap > 0, f"logit soft-cap (logit_softcap = {a.logit_softcap})"),
              (a.residual_scalars, "residual scalars (residual_scalars = true)"),
              (a.kv_share != "none", f"KV sharing (kv_share = {a.kv_share!r})"),
              (a.parametrization != "standard", f"muP (parametrization = {a.parametrization!r})")]
    if a.n_experts > 0:
        checks += [(a.n_experts < 2, "MoDE with one expert"),
                   (a.shared_expert, "MoDE with a shared expert"),
                   (a.bias_update_rate > 0, f"MoDE routing bias (bias_update_rate = {a.bias_update_rate})"),
                   (a.nope_every > 0, "MoDE with NoPE layers"),
                   (not a.qk_norm and a.moe_every != 1, f"MoDE every {a.moe_every} layers without QK-norm"),
                   (not a.qk_norm and not a.renormalize_gates, "MoDE without gate renormalisation or QK-norm")]
    else:
        checks.append((a.nope_every > 0 and a.qk_norm, "NoPE layers with QK-norm"))
    return next((why for failed, why in checks if failed), "")


def architecture(a: ModelArgs) -> str:
    """The transformers architecture computing the same function as ``a`` (the custom one when none does)."""
    if _custom_reason(a):
        return CUSTOM_ARCHITECTURE
    if a.n_experts > 0:
        return "Qwen3MoeForCausalLM" if a.qk_norm else "MixtralForCausalLM"
    if a.nope_every:
        return "SmolLM3ForCausalLM"
    return "Qwen3ForCausalLM" if a.qk_norm else "LlamaForCausalLM"


def _rope_parameters(a: ModelArgs) -> dict:
    rope = {"rope_type": "default", "rope_theta": a.rope_theta}
    if a.rope_scaling == "llama3":
        rope.update(rope_type="llama3", factor=a.rope_scaling_factor, low_freq_factor=a.rope_low_freq_factor,
                    high_freq_factor=a.rope_high_freq_factor,
                    original_max_position_embeddings=a.rope_original_max_seq_len)
    return rope


def _config(a: ModelArgs, arch: str) -> dict:
    """config.json of ``a`` as ``arch`` (token ids None: the exporter sets them)."""
    cfg = {"architectures": [arch], "model_type": _ARCH_TYPES[arch], "vocab_size": a.vocab_size,
           "hidden_size": a.dim, "intermediate_size": a.ffn_hidden, "num_hidden_layers": a.n_layers,
           "num_attention_heads": a.n_heads, "num_key_value_heads": a.kv_heads, "head_dim": a.hdim,
           "max_position_embeddings": a.max_seq_len, "rms_norm_eps": a.norm_eps,
           "tie_word_embeddings": a.tie_embeddings, "rope_parameters": _rope_parameters(a), "use_cache": True,
           "bos_token_id": None, "eos_token_id": None, "pad_token_id": None}
    if arch == CUSTOM_ARCHITECTURE:
        cfg["auto_map"] = dict(_AUTO_MAP)
        cfg.update(num_experts=a.n_experts, num_experts_per_tok=a.top_k, moe_intermediate_size=a.expert_hidden,
                   norm_topk_prob=a.renormalize_gates)
        cfg.update({k: getattr(a, k) for k in _OWN_KEYS})
        return cfg
    cfg.update(hidden_act="silu", attention_bias=False)
    if arch in ("LlamaForCausalLM", "SmolLM3ForCausalLM"):
        cfg["mlp_bias"] = False
    if arch != "LlamaForCausalLM":
        cfg["sliding_window"] = None
    if arch in ("Qwen3ForCausalLM", "SmolLM3ForCausalLM", "Qwen3MoeForCausalLM"):
        cfg["use_sliding_window"] = False
    if arch == "SmolLM3ForCausalLM":
        cfg.update(no_rope_layer_interval=a.nope_every, no_rope_layers=[int(a.uses_rope(i)) for i in range(a.n_layers)])
    if a.n_experts > 0:  # the training-only coefficients travel under our names (transformers keeps them)
        cfg.update(num_experts_per_tok=a.top_k, output_router_logits=False, aux_loss_coef=a.aux_loss_coef,
                   router_z_loss_coef=a.router_z_loss_coef)
    if arch == "MixtralForCausalLM":
        cfg.update(num_local_experts=a.n_experts, intermediate_size=a.expert_hidden, router_jitter_noise=0.0)
    elif arch == "Qwen3MoeForCausalLM":
        cfg.update(num_experts=a.n_experts, moe_intermediate_size=a.expert_hidden, decoder_sparse_step=a.moe_every,
                   norm_topk_prob=a.renormalize_gates, mlp_only_layers=[])
    return cfg


def _names(a: ModelArgs, arch: str, keys: list[str]) -> dict[str, tuple[str, ...]]:
    if arch == CUSTOM_ARCHITECTURE:
        return {k: ("lm_head.weight" if k == "output.weight" else f"model.{k}",) for k in keys}
    names = {}
    for k in keys:
        if ".feed_forward." in k and a.is_moe(int(k.split(".")[1])):
            layer, piece = k.split(".")[1], k.split(".feed_forward.")[1]
            gate, expert, weights = _MOE[arch]
            if piece == "router.weight":
                names[k] = (f"model.layers.{layer}.{gate}.weight",)
            elif piece == "expert_bias":
                names[k] = ()
            else:  # experts.w1 / w3 / w2
                leaf = f"{weights[piece.split('.')[1]]}.weight"
                names[k] = tuple(f"model.layers.{layer}.{expert.format(e=e)}{leaf}" for e in range(a.n_experts))
        else:
            names[k] = (hf_name(k),)
    return names


def hf_layout(a: ModelArgs) -> HFLayout:
    """The folder layout of a model of shape ``a``: a native class when one computes the same function, else
    the custom architecture (``reason`` says why). Refuses nothing."""
    arch = architecture(a)
    return HFLayout(arch, arch != CUSTOM_ARCHITECTURE, _config(a, arch), _names(a, arch, state_names(a)),
                    _custom_reason(a))


def remote_code_files() -> dict[str, bytes]:
    """File name -> contents of the modeling files the custom architecture loads (written beside the weights)."""
    return {p.name: p.read_bytes() for p in sorted(REMOTE_CODE.glob("*.py"))}


def hf_name(name: str) -> str:
    """transformers' name of one of our dense state-dict entries (the Llama family's naming)."""
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


# ---- import ----

def _refuse(where: str, key: str, value: object, why: str) -> ExportError:
    return ExportError(f"{where}: {key} = {value!r} is not supported ({why})")


def _check_sliding(c: dict, model_type: str, where: str) -> None:
    """Refuse sliding-window attention where the config really uses it (Qwen3 and SmolLM3 configs carry a
    window that ``use_sliding_window = false`` turns off)."""
    window = c.get("sliding_window")
    if model_type == "mixtral":
        if window is not None:
            raise _refuse(where, "sliding_window", window, "sliding-window attention")
        return
    if not c.get("use_sliding_window") or window is None:
        return
    n, types = c["num_hidden_layers"], c.get("layer_types")
    if types is not None:
        used = "sliding_attention" in types
    elif model_type == "qwen3":  # the layers from max_window_layers on
        used = c.get("max_window_layers", _DEFAULTS["qwen3"]["max_window_layers"]) < n
    elif model_type == "smollm3":  # the NoPE layers
        used = 0 in _no_rope_layers(c)
    else:  # qwen3_moe: every layer (llama and ours have no window)
        used = model_type == "qwen3_moe"
    if used:
        raise _refuse(where, "use_sliding_window", True, f"sliding-window attention, sliding_window = {window}")


def _no_rope_layers(c: dict) -> list[int]:
    interval = c.get("no_rope_layer_interval", _DEFAULTS["smollm3"]["no_rope_layer_interval"])
    return c.get("no_rope_layers") or [int((i + 1) % interval != 0) for i in range(c["num_hidden_layers"])]


def _nope_every(c: dict, where: str) -> int:
    """SmolLM3's ``no_rope_layers`` as ``nope_every`` (the pattern must be every Nth layer)."""
    layers = _no_rope_layers(c)
    if all(layers):
        return 0
    every = layers.index(0) + 1
    if layers != [int((i + 1) % every != 0) for i in range(len(layers))]:
        raise _refuse(where, "no_rope_layers", layers, "NoPE layers must be every Nth layer")
    return every


def _rope_fields(c: dict, model_type: str, where: str) -> dict:
    """The ModelArgs RoPE fields of ``rope_parameters`` (transformers 5) or ``rope_theta`` / ``rope_scaling``
    (older configs)."""
    key = "rope_parameters" if c.get("rope_parameters") else "rope_scaling"
    rope = c.get(key) or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        raise _refuse(where, key, rope, "one set of RoPE parameters for every layer expected")
    theta = rope.get("rope_theta") or c.get("rope_theta") or _DEFAULTS[model_type]["rope_theta"]
    fields = {"rope_theta": float(theta)}
    type_key = "rope_type" if "rope_type" in rope else "type"  # "type": configs older than transformers 4.45
    rope_type = rope.get(type_key, "default")
    partial_key = f"{key}.partial_rotary_factor" if "partial_rotary_factor" in rope else "partial_rotary_factor"
    partial = rope.get("partial_rotary_factor", c.get("partial_rotary_factor")) or 1.0
    if partial != 1.0:  # ours is rope_fraction (the custom config's own key)
        raise _refuse(where, partial_key, partial, "this architecture rotates whole heads")
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor") if k not in rope]
        if missing:
            raise ExportError(f"{where}: {key} of rope_type 'llama3' has no {missing[0]!r}")
        original = (rope.get("original_max_position_embeddings") or c.get("max_position_embeddings")
                    or _DEFAULTS[model_type]["max_position_embeddings"])
        fields.update(rope_scaling="llama3", rope_scaling_factor=float(rope["factor"]),
                      rope_low_freq_factor=float(rope["low_freq_factor"]),
                      rope_high_freq_factor=float(rope["high_freq_factor"]), rope_original_max_seq_len=int(original))
    elif rope_type != "default":
        raise _refuse(where, f"{key}.{type_key}", rope_type, "supported: default, llama3")
    return fields


def args_from_config(c: dict, where: str) -> ModelArgs:
    """The ``ModelArgs`` of a transformers config.json of a Llama, Qwen3, SmolLM3, Mixtral, Qwen3-MoE or
    exported custom model; ExportError (one line naming ``where`` and the key) for anything we would not
    compute exactly. Keys a Hub config leaves out take that class's transformers default. ``head_dim`` and
    ``moe_hidden`` come back as 0 when they equal what 0 means, and Mixtral (no dense FFN) gives
    ``ffn_hidden`` = its expert size: ``hf_layout`` of the result writes the same config.json."""
    if not isinstance(c, dict):
        raise ExportError(f"{where}: not a JSON object")
    model_type = c.get("model_type")
    if model_type not in _MODEL_TYPES:
        raise _refuse(where, "model_type", model_type, f"supported: {', '.join(_MODEL_TYPES)}")
    for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
        if k not in c:
            raise ExportError(f"{where}: no {k!r} (expected a {model_type} config)")
    custom = model_type == CUSTOM_MODEL_TYPE
    for k in ("attention_bias", "mlp_bias"):
        if c.get(k):
            raise _refuse(where, k, c[k], "our layers have no biases")
    if not custom and c.get("hidden_act", "silu") != "silu":
        raise _refuse(where, "hidden_act", c["hidden_act"], "supported: silu")
    _check_sliding(c, model_type, where)
    d = _DEFAULTS[model_type]

    def get(key: str) -> object:  # the config's value, or the class's default when absent or null
        value = c.get(key)
        return d.get(key) if value is None else value

    dim, heads = c["hidden_size"], c["num_attention_heads"]
    head_dim = get("head_dim") or 0
    fields = dict(vocab_size=c["vocab_size"], dim=dim, n_layers=c["num_hidden_layers"], n_heads=heads,
                  n_kv_heads=get("num_key_value_heads") or heads,
                  head_dim=0 if heads and head_dim * heads == dim else head_dim, ffn_hidden=c["intermediate_size"],
                  max_seq_len=get("max_position_embeddings"), norm_eps=float(get("rms_norm_eps")),
                  tie_embeddings=bool(get("tie_word_embeddings")), **_rope_fields(c, model_type, where))
    if custom:
        fields.update({k: c[k] for k in _OWN_KEYS if k in c})
        fields.update(n_experts=c.get("num_experts", 0), top_k=c.get("num_experts_per_tok", ModelArgs.top_k),
                      renormalize_gates=c.get("norm_topk_prob", ModelArgs.renormalize_gates))
        moe_hidden = c.get("moe_intermediate_size") or 0
        fields["moe_hidden"] = 0 if moe_hidden == fields["ffn_hidden"] else moe_hidden
    elif model_type == "qwen3":
        fields["qk_norm"] = True
    elif model_type == "smollm3":
        fields["nope_every"] = _nope_every(c, where)
    elif model_type == "mixtral":
        fields.update(n_experts=get("num_local_experts"), top_k=get("num_experts_per_tok"))
    elif model_type == "qwen3_moe":
        if c.get("mlp_only_layers"):
            raise _refuse(where, "mlp_only_layers", c["mlp_only_layers"], "MoE on every decoder_sparse_step-th "
                          "layer only")
        moe_hidden = get("moe_intermediate_size")
        fields.update(qk_norm=True, n_experts=get("num_experts"), top_k=get("num_experts_per_tok"),
                      moe_hidden=0 if moe_hidden == fields["ffn_hidden"] else moe_hidden,
                      moe_every=get("decoder_sparse_step"), renormalize_gates=bool(get("norm_topk_prob")))
    if model_type in ("mixtral", "qwen3_moe"):
        fields.update({k: float(c[k]) for k in ("aux_loss_coef", "router_z_loss_coef") if k in c})
    args = ModelArgs(**fields)
    try:
        args.validate()
    except ValueError as e:
        raise ExportError(f"{where}: {e}") from None
    return args
