"""Validation loss of a model loaded on one process, on the tokens ``python -m torchtitan_ext.eval`` describes."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import torch

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.data.registry import build_loaders, build_tokenizer
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.eval.bpb import summarize, token_bytes
from torchtitan_ext.eval.sliding import eval_stream, reads_stream, sliding_sums

log = logging.getLogger(__name__)


def validation_streams(cfg: JobConfig) -> dict[str, np.ndarray]:
    """Validation token stream by domain name ("" without domains)."""
    d, t = cfg.data, cfg.training
    if not reads_stream(cfg):
        what = "data.dataset = 'chat'" if d.dataset == "chat" else (
            f"data.attention = {d.attention!r}" + (", data.position_reset" if d.position_reset else ""))
        log.warning(f"{what}: this evaluation scores plain causal windows of the validation tokens; the trainer's "
                    f"validation uses the job's masked batches, so its val_loss differs")
    # plain causal windows, one per batch, in order: the validation shards' token streams are what is read
    # (tree shards as the plain shards they also are)
    plain = dataclasses.replace(cfg, training=dataclasses.replace(t, local_batch_size=1), data=dataclasses.replace(
        d, dataset="shards" if d.dataset == "trees" else d.dataset, shuffle=False, mixing="static",
        packing="concat", attention="causal", position_reset=False))
    val = build_loaders(plain, build_tokenizer(plain.data), dp_rank=0, dp_world_size=1, vocab_limit=0).val_loader
    if val is None:
        raise ConfigError("no validation split: set data.val_path, or val in every [[data.domains]] table")
    loaders = val if isinstance(val, dict) else {"": val}
    return {name: eval_stream(loader, cfg) for name, loader in loaders.items()}


def evaluate_model(model: torch.nn.Module, tokenizer, cfg: JobConfig,
                   streams: dict[str, np.ndarray] | None = None) -> tuple[float, dict[str, float], int]:
    """(validation loss, val_bpb and per-domain figures, scored tokens) of ``model`` on the job's splits."""
    streams = validation_streams(cfg) if streams is None else streams
    table = token_bytes(tokenizer, model.args.vocab_size)
    table = table.to(next(model.parameters()).device) if table is not None else None
    t = cfg.training
    try:  # per stream [loss x tokens, tokens, bytes] (rows as in ``eval.bpb.batch_sums``)
        sums = torch.stack([sliding_sums(model, torch.from_numpy(s.astype(np.int64)), t.seq_len, cfg.eval.stride,
                                         t.local_batch_size, table) for s in streams.values()])
    except ValueError as e:  # sliding.windows: eval.stride out of range, or fewer tokens than one window
        raise ConfigError(str(e)) from None
    val, metrics = summarize(list(streams), sums)
    return val, metrics, int(sums[:, 1].sum())
