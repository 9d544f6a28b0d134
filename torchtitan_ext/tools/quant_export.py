"""``python -m torchtitan_ext.quant.export --checkpoint DUMP_FOLDER --bits 8|6 [--output FILE]``.

Loads a job's latest checkpoint (its ``config.toml`` and ``checkpoint/``, saved under any layout) in one
process, takes the EMA weights when the job kept an EMA, quantises them (``quant/export``) and reports the
file's size against bf16 and the validation loss of the dequantised model against the original's. A copied or
moved dump folder is read where it is (its recorded ``job.dump_folder`` is said when it is another folder);
the checkpoint read is said on stderr.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from torchtitan_ext import cli
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.eval.locate import config_dump_folder, find_checkpoint
from torchtitan_ext.outputs import new_output

log = logging.getLogger("torchtitan_ext.quant.export")


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.quant.export", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="a job's dump folder (config.toml + checkpoint/)")
    p.add_argument("--bits", type=int, choices=(8, 6), default=8)
    p.add_argument("--output", default="", help="default: <checkpoint>/export-int<bits>.pt")
    return p


def validation_streams(cfg):
    """The run's validation streams (``eval.validation``, imported when the checkpoint is loaded)."""
    from torchtitan_ext.eval.validation import validation_streams as streams

    return streams(cfg)


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    folder = Path(args.checkpoint)
    if not (folder / "config.toml").is_file():
        raise ConfigError(f"--checkpoint {folder}: no config.toml (expected a job's dump folder)")
    find_checkpoint(folder)  # the paths are checked before the imports below take their seconds
    out = new_output("--output", args.output or folder / f"export-int{args.bits}.pt", folder=False)
    import torch

    from torchtitan_ext.eval.load import load_ema, load_trained
    from torchtitan_ext.eval.validation import evaluate_model
    from torchtitan_ext.quant.export import dequantize, export

    model, tokenizer, cfg, checkpoint = load_trained(folder)
    note = config_dump_folder(folder / "config.toml", cfg)[1]  # a copied or moved folder: said, as eval says it
    print(f"quant.export: read checkpoint {checkpoint}{f' ({note})' if note else ''}", file=sys.stderr, flush=True)
    try:
        streams = validation_streams(cfg)
    except ConfigError:  # no validation split: the sizes alone are reported
        streams = None

    def val_loss() -> float | None:
        return evaluate_model(model, tokenizer, cfg, streams)[0] if streams is not None else None

    weights = "EMA" if load_ema(model, checkpoint) else "trained"
    original = val_loss()
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    torch.save(export(state, args.bits), out)
    model.load_state_dict(dequantize(torch.load(out, weights_only=True)))
    quantized = val_loss()
    bf16 = sum(2 * t.numel() for t in state.values())
    size = out.stat().st_size
    log.info(f"export: {weights} weights of {checkpoint.name.replace('-', ' ')}, {args.bits}-bit per-row -> {out}: "
             f"{size:,} bytes ({size / bf16:.3f} of bf16's {bf16:,})")
    if original is not None:
        log.info(f"validation loss: original {original:.4f}, dequantised {quantized:.4f} "
                 f"(+{quantized - original:.4f})")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)
