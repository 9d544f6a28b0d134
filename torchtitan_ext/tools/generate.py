"""Continue prompts with a trained checkpoint (greedy, or temperature and top-p sampling):

    python -m torchtitan_ext.generate --checkpoint outputs/debug --prompt "def main(" --max-new-tokens 64

Prints each prompt followed by its continuation, or one JSON object with ``--json``. The KV-cache decoding
and its compiled step are described in ``torchtitan_ext/generate/decoding.py``.
"""

from __future__ import annotations

import argparse
import json
import sys

from torchtitan_ext import cli
from torchtitan_ext.eval.locate import find_checkpoint
from torchtitan_ext.generate.options import check_sampling


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.generate", description=__doc__, allow_abbrev=True)
    p.add_argument("--checkpoint", required=True, help="dump folder (latest checkpoint) or a step-N folder")
    p.add_argument("--prompt", action="append", required=True, help="repeat for a batch of prompts")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="compile the decoding step (CUDA graphs on CUDA); default: on CUDA, off on CPU")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    return p


def _main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    check_sampling(args.max_new_tokens, args.temperature, args.top_p)
    find_checkpoint(args.checkpoint)  # a folder without a checkpoint: said before the imports below
    from torchtitan_ext.generate.decoding import complete

    out = complete(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                   args.device, args.compile)
    print(f"generate: read checkpoint {out.checkpoint}", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"checkpoint": str(out.checkpoint), "completions": out.texts, "compiled": out.compiled,
                          "tokens_per_sec": out.tokens_per_sec}))
    else:
        for prompt, text in zip(args.prompt, out.texts, strict=True):
            print(prompt + text)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)
