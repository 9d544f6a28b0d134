"""Evaluate a job's checkpoint on one process and print JSON:

    python -m torchtitan_ext.eval --config FILE [--checkpoint.load_step N] [--eval.stride 64] [...]

The same config (and overrides) as the training job; the latest complete checkpoint in its dump folder (or
``checkpoint.load_step``) is loaded whatever layout saved it. Each validation split (every domain's with
``[[data.domains]]``) contributes its first ``eval.steps x local_batch_size`` windows' worth of tokens
(all of it when ``eval.steps = 0``), scored with sliding windows when ``eval.stride > 0``.
"""

from __future__ import annotations

import json
import sys

import numpy as np
import torch

from torchtitan_ext.config.loader import ConfigError, parse_args
from torchtitan_ext.data.shards import ShardError


def _streams(cfg) -> dict[str, np.ndarray]:
    """Validation token stream by domain name ("" without domains)."""
    from torchtitan_ext.data.loader import build_data
    from torchtitan_ext.eval.sliding import eval_tokens, split_stream

    d, t = cfg.data, cfg.training
    _, _, val = build_data(dataset=d.dataset, train_path=d.train_path, val_path=d.val_path, tokenizer=d.tokenizer,
                           tokenizer_vocab_size=d.tokenizer_vocab_size, cache_dir=d.cache_dir, seq_len=t.seq_len,
                           local_batch_size=1, dp_rank=0, dp_world_size=1, seed=cfg.job.seed, shuffle=False,
                           domains=dict(domains=d.domains, mixing="static", rate=0.0, floor=0.0, cap=1.0))
    if val is None:
        raise ConfigError("no validation split: set data.val_path, or val in every [[data.domains]] table")
    loaders = val if isinstance(val, dict) else {"": val}
    limit = eval_tokens(cfg.eval.steps, t.local_batch_size, t.seq_len)
    return {name: split_stream(loader, limit) for name, loader in loaders.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print(__doc__)
        return 0
    from torchtitan_ext.eval.bpb import summarize, token_bytes
    from torchtitan_ext.eval.load import load_trained
    from torchtitan_ext.eval.sliding import sliding_sums

    try:
        cfg = parse_args(argv)
        device = "cuda" if cfg.job.device != "cpu" and torch.cuda.is_available() else "cpu"
        model, tok, _, ckpt = load_trained(cfg.job.dump_folder, device, cfg=cfg)
        table = token_bytes(tok, model.args.vocab_size)
        table = table.to(device) if table is not None else None
        streams = _streams(cfg)
        sums = torch.stack([sliding_sums(model, torch.from_numpy(s.astype(np.int64)), cfg.training.seq_len,
                                         cfg.eval.stride, cfg.training.local_batch_size, table)
                            for s in streams.values()])
    except (ConfigError, ShardError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    val, metrics = summarize(list(streams), sums)
    print(json.dumps({"checkpoint": str(ckpt), "stride": cfg.eval.stride or cfg.training.seq_len,
                      "scored_tokens": int(sums[:, 1].sum()), "val_loss": val, **metrics}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
