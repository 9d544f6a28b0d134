"""Load a trained model on one process (CPU or one GPU) from a job's dump folder or checkpoint folder.

The job's resolved ``config.toml`` gives the model shape, and its ``tokenizer/`` folder the tokenizer (the
copy the trainer saved at its start; older runs: the one ``data.tokenizer`` names); DCP stores parameters by FQN
with their global shapes, so a checkpoint saved under any layout loads into the plain Decoder.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from torchtitan_ext.checkpoint.manager import load_on_one_process
from torchtitan_ext.checkpoint.safe_reader import checkpoint_metadata
from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.data.filters import model_scores
from torchtitan_ext.data.registry import build_tokenizer
from torchtitan_ext.data.tokenizers import RUN_FOLDER, load_tokenizer, read_meta
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.eval.locate import find_checkpoint
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder


def trained_run(path: str | Path, cfg: JobConfig | None = None) -> tuple[Path, JobConfig, object, ModelArgs]:
    """(checkpoint folder, job config, tokenizer, model arguments) of the run in a dump or checkpoint folder:
    the config is the run's ``config.toml`` unless given, the tokenizer the run's saved copy (``<dump>/tokenizer/``)
    when there is one, else the one ``cfg.data`` names (a run from before tokenizers were saved, or
    ``data.tokenizer = 'none'``)."""
    from torchtitan_ext.models.flavors import resolve_model_args

    dump, ckpt = find_checkpoint(path, cfg)
    if cfg is None:
        toml = dump / "config.toml"
        if not toml.is_file():
            raise ConfigError(f"{dump}: no config.toml (the trainer writes it into the dump folder)")
        cfg = parse_args(["--config", str(toml)])
    saved = dump / RUN_FOLDER
    if cfg.data.tokenizer != "none" and read_meta(saved) is not None:
        cfg.data.tokenizer = str(saved)
        tok = load_tokenizer(saved)
    else:
        tok = build_tokenizer(cfg.data)
    return ckpt, cfg, tok, resolve_model_args(cfg, getattr(tok, "vocab_size", 0))


def load_trained(path: str | Path, device: str | torch.device = "cpu", cfg: JobConfig | None = None,
                 dtype: torch.dtype = torch.float32) -> tuple[Decoder, object, JobConfig, Path]:
    """(model in eval mode, tokenizer, job config, checkpoint folder) from a dump or checkpoint folder. When the
    dump folder holds the run's tokenizer, the config's ``data.tokenizer`` is set to that folder (so what
    rebuilds the tokenizer from the config, the validation streams, reads the run's copy)."""
    ckpt, cfg, tok, args = trained_run(path, cfg)
    device = torch.device(device)
    with torch.device(device):
        model = Decoder(args)
    model.init_buffers(device)
    state = {k: v for k, v in model.state_dict().items()}
    load_on_one_process({"model": state}, ckpt, "name an earlier step-N folder or set checkpoint.load_step")
    model.load_state_dict(state)
    return model.to(dtype).eval(), tok, cfg, ckpt


def load_ema(model: Decoder, checkpoint: Path) -> bool:
    """Copy the checkpoint's EMA weights into ``model`` (from :func:`load_trained`) when the job kept a started
    EMA; whether it did."""
    if not any(key.startswith("ema.") for key in checkpoint_metadata(checkpoint)):
        return False
    shadow = {f"shadow.{n}": torch.empty_like(p, dtype=torch.float32) for n, p in model.named_parameters()}
    state = {"ema": {"started": torch.tensor(0), **shadow}}
    load_on_one_process(state, checkpoint)
    if not int(state["ema"]["started"]):
        return False
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state["ema"][f"shadow.{n}"])
    return True


def perplexity_scores(texts: list[str], checkpoint: str, max_tokens: int = 2048) -> np.ndarray:
    """Mean next-token loss (nats) of each text under a dump folder's model, with its own tokenizer (on GPU
    when present): the scorer of ``data.prepare``'s ``ppl`` filter."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model, tok, _, _ = load_trained(checkpoint, device)
    return model_scores(texts, model, tok, device, max_tokens)
