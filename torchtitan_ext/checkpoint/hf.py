"""Hugging Face interchange: our checkpoints as safetensors + config.json, and back.

    python -m torchtitan_ext.export --checkpoint outputs/debug --output hf/debug

(the command line in ``torchtitan_ext/export/__main__.py``; ``export.export_checkpoint`` is what it runs).

Architectures: the plain decoder is ``LlamaForCausalLM``; with QK-norm it is ``Qwen3ForCausalLM`` (RMSNorm
over each head's dims before RoPE, as ours); with NoPE every Nth layer it is ``SmolLM3ForCausalLM``
(``no_rope_layers``). Features no transformers architecture reproduces (partial RoPE, logit soft-cap,
squared-ReLU FFNs, MoDE layers, shared K/V, residual scalars) are refused with one line naming the feature. The
SentencePiece model (when the job used one) is copied as ``tokenizer.model``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from torchtitan_ext.config.loader import ConfigError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder

# Our FQN pieces -> transformers' (Llama-family naming).
_BLOCK = {"attention.wq": "self_attn.q_proj", "attention.wk": "self_attn.k_proj",
          "attention.wv": "self_attn.v_proj", "attention.wo": "self_attn.o_proj",
          "attention.q_norm": "self_attn.q_norm", "attention.k_norm": "self_attn.k_norm",
          "attention_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
          "feed_forward.w2": "mlp.down_proj"}


class ExportError(ConfigError):
    """A model feature that no transformers architecture reproduces; the message is one line."""


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


def to_hf_state(model: Decoder) -> dict[str, torch.Tensor]:
    return {hf_name(k): v.detach().float().contiguous().cpu() for k, v in model.state_dict().items()}


def export(model: Decoder, output: str | Path, tokenizer=None) -> Path:
    """Write ``model.safetensors`` and ``config.json`` (and the tokenizer) into ``output``."""
    from safetensors.torch import save_file

    cfg = hf_config(model.args)  # refuses first, before anything is written
    if tokenizer is not None:
        cfg["eos_token_id"] = int(tokenizer.eot_id)
    out = Path(output)
    out.mkdir(parents=True, exist_ok=True)
    save_file(to_hf_state(model), str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    sp = getattr(tokenizer, "sp", None)
    if sp is not None:
        (out / "tokenizer.model").write_bytes(sp.serialized_model_proto())
    if tokenizer is not None:
        (out / "torchtitan_tokenizer.json").write_text(json.dumps(
            {"kind": "sentencepiece" if sp is not None else tokenizer.name, "eot_id": int(tokenizer.eot_id)}))
    return out


def load_hf(path: str | Path) -> Decoder:
    """Our Decoder from a folder written by :func:`export` (or any Llama / Qwen3 / SmolLM3 folder of the same
    layout with a single ``model.safetensors``)."""
    from safetensors.torch import load_file

    p = Path(path)
    if not (p / "config.json").is_file() or not (p / "model.safetensors").is_file():
        raise ExportError(f"{p}: expected config.json and model.safetensors")
    try:
        c = json.loads((p / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise ExportError(f"{p}/config.json: not a JSON object ({e})") from None
    required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size",
                "max_position_embeddings", "rms_norm_eps")
    missing_keys = [k for k in required if not isinstance(c, dict) or k not in c]
    if missing_keys:
        raise ExportError(f"{p}/config.json: no {missing_keys[0]!r} (expected a Llama / Qwen3 / SmolLM3 config)")
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
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    try:
        theirs = load_file(str(p / "model.safetensors"))
    except Exception as e:  # safetensors raises its own SafetensorError for a damaged header or body
        raise ExportError(f"{p}/model.safetensors: cannot read it ({type(e).__name__}: {e})") from None
    names = {hf_name(k): k for k in model.state_dict()}
    missing = sorted(set(names) - set(theirs))
    if missing:
        raise ExportError(f"{p}/model.safetensors: missing {missing[0]} ({len(missing)} tensors missing)")
    model.load_state_dict({ours: theirs[hf] for hf, ours in names.items()}, strict=True)
    return model.eval()


def load_hf_weights(parts: list[torch.nn.Module], path: str | Path, args: ModelArgs) -> None:
    """Load an exported folder's weights into the (possibly sharded, possibly pipeline-split) model
    ``parts`` of shape ``args``; ExportError (one line) when the folder's shape differs."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    theirs = load_hf(path)
    mine, saved = hf_config(args), hf_config(theirs.args)
    diff = [k for k in mine if k not in ("max_position_embeddings",) and mine[k] != saved.get(k)]
    if diff:
        raise ExportError(f"checkpoint.initial_load_path = {str(path)!r}: {diff[0]} is {saved.get(diff[0])!r}, "
                          f"the job's model has {mine[diff[0]]!r}")
    full = theirs.state_dict()
    for part in parts:  # each part (pipeline stage) takes its own FQNs; FSDP shards are cut from the full tensors
        set_model_state_dict(part, full, options=StateDictOptions(full_state_dict=True, strict=False))
