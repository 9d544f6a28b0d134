"""Memory and communication planner, without a GPU:

    python -m torchtitan_ext.plan --config FILE [--gpus N] [--device-memory GiB] [--section.key value ...]

Per rank: parameters, gradients, optimizer state, FSDP's unsharded copies, saved activations (with the
configured activation checkpointing and without), the logits / cross-entropy buffers, the bytes each mesh
dimension moves per step, then whether the peak fits the device memory (``torchtitan_ext/plan/estimate.py``).
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable

from torchtitan_ext import cli


def _positive(kind: type) -> Callable[[str], float]:
    """argparse type: a finite number > 0 of ``kind``, with the planner's messages."""
    def convert(raw: str) -> float:
        try:
            value = kind(raw)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {raw!r}") from None
        if not math.isfinite(value) or value <= 0:
            raise argparse.ArgumentTypeError(f"expected a finite number > 0, got {raw!r}")
        return value
    return convert


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.plan", description=__doc__, epilog=cli.CONFIG_EPILOG)
    cli.add_config_option(p)
    p.add_argument("--gpus", action=cli.OptionValue, type=_positive(int), metavar="N",
                   help="GPUs of the job (default: the world the config's parallelism names)")
    p.add_argument("--device-memory", action=cli.OptionValue, type=_positive(float), default=80.0,
                   metavar="GiB", help="memory of one device (default: 80)")
    return p


def _main(argv: list[str]) -> int:
    from torchtitan_ext.config.loader import parse_args
    from torchtitan_ext.plan.estimate import plan_job, report

    ns, rest = parser().parse_known_args(argv)
    cfg = parse_args(cli.job_argv(ns, rest))
    print("\n".join(report(plan_job(cfg, ns.gpus), ns.device_memory, cfg)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)


if __name__ == "__main__":
    sys.exit(main())
