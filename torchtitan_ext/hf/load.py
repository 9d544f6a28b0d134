"""Hugging Face folder -> our Decoder (``load_hf``) or into a job's (sharded) model (``load_hf_weights``)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from torchtitan_ext.hf.architectures import ExportError, args_from_config, hf_config, hf_name
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder


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
    args = args_from_config(c, f"{p}/config.json")
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
