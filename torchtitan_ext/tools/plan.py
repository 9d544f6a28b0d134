"""Memory and communication planner, without a GPU:

    python -m torchtitan_ext.plan --config FILE [--gpus N] [--device-memory GiB] [--section.key value ...]

Per rank: parameters, gradients, optimizer state, FSDP's unsharded copies, saved activations (with the
configured activation checkpointing and without), the logits / cross-entropy buffers, the bytes each mesh
dimension moves per step, then whether the peak fits the device memory (``torchtitan_ext/plan/estimate.py``).
"""

from __future__ import annotations

from torchtitan_ext import cli


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.plan", description=__doc__, epilog=cli.CONFIG_EPILOG)
    cli.add_config_option(p)
    p.add_argument("--gpus", action=cli.OptionValue, type=cli.positive_whole, metavar="N",
                   help="GPUs of the job (default: the world the config's parallelism names)")
    p.add_argument("--device-memory", action=cli.OptionValue, type=cli.positive_number, default=80.0,
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
