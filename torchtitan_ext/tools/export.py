"""Export a trained checkpoint as a Hugging Face folder (safetensors shards, config.json,
generation_config.json, the tokenizer's files):

    python -m torchtitan_ext.export --checkpoint outputs/debug --output hf/debug [--dtype float32]
        [--max-shard-size 5GB] [--weights ema]

The architectures (a native transformers class, or our modeling file loaded with trust_remote_code=True)
are described in ``torchtitan_ext/hf/architectures.py``. The checkpoint is read one shard at a time.
"""

from __future__ import annotations

import sys

from torchtitan_ext import cli
from torchtitan_ext.errors import EXIT_INTERRUPTED, UserError
from torchtitan_ext.eval.locate import find_checkpoint
from torchtitan_ext.outputs import new_output

DTYPES = ("bfloat16", "float32")


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.export", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="dump folder (latest checkpoint) or a step-N folder")
    p.add_argument("--output", required=True, help="new (or empty) folder for the Hugging Face files")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="dtype of the tensors written")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest safetensors file (5GB, 500MB, 2MiB or bytes); one file when the model fits")
    p.add_argument("--weights", choices=("model", "ema"), default="model",
                   help="the trained weights, or the EMA's average (the run must have a started EMA)")
    return p


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    find_checkpoint(args.checkpoint)  # the paths are checked before the imports below take their seconds
    new_output("--output", args.output, folder=True)
    import torch

    from torchtitan_ext.export.run import export_run
    from torchtitan_ext.hf.safetensors_io import parse_size
    from torchtitan_ext.metrics.logger import os_error_text

    # The folder is written under a temporary name beside --output and renamed at the end (hf/export.py): a
    # failure or an interrupt removes it, so --output is either complete or absent; the checkpoint is only read.
    kept = f"nothing written at {args.output} (the partial folder was removed); the checkpoint is untouched"
    try:
        ckpt, result = export_run(args.checkpoint, args.output, dtype=getattr(torch, args.dtype),
                                  max_shard_size=parse_size(args.max_shard_size), weights=args.weights)
    except OSError as e:  # a full disk, a read-only or forbidden folder: the file, the system's reason
        where = f"{e.filename}: " if e.filename else ""
        raise UserError(f"export failed: {where}{os_error_text(e)}; {kept}") from None
    except KeyboardInterrupt:
        print(f"error: interrupted (SIGINT): export stopped; {kept}", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    print(f"exported {ckpt}{' (EMA weights)' if args.weights == 'ema' else ''} as {result.describe()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)
