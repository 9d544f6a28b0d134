"""Export a trained checkpoint as a Hugging Face folder (safetensors + config.json):

    python -m torchtitan_ext.export --checkpoint outputs/debug --output hf/debug

The architectures and the features refused are described in ``torchtitan_ext/hf/architectures.py``.
"""

from __future__ import annotations

import sys

from torchtitan_ext import cli


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.export", description=__doc__, allow_abbrev=True)
    p.add_argument("--checkpoint", required=True, help="dump folder (latest checkpoint) or a step-N folder")
    p.add_argument("--output", required=True, help="folder for model.safetensors + config.json")
    return p


def _main(argv: list[str]) -> int:
    from torchtitan_ext.export import export_checkpoint

    args = parser().parse_args(argv)
    ckpt, arch, out = export_checkpoint(args.checkpoint, args.output)
    print(f"exported {ckpt} as {arch} -> {out}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
