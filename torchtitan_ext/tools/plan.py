"""Memory and communication planner, without a GPU:

    python -m torchtitan_ext.plan --config FILE [--gpus N] [--device-memory GiB] [--section.key value ...]
    python -m torchtitan_ext.plan --config FILE --gpus N --search [--gpus-per-node 8] [--top 10] ...

Per rank: parameters, gradients, optimizer state, FSDP's unsharded copies, saved activations (with the
configured activation checkpointing and without), the logits / cross-entropy buffers, the bytes each mesh
dimension moves per step, whether the peak fits the device memory (``torchtitan_ext/plan/estimate.py``) and
the expected step time. With --search: every layout the trainer accepts on N GPUs (pp x dp_replicate x
dp_shard x cp x tp, ep for MoDE, ring / all-to-all context parallelism, 1F1B / Interleaved1F1B, activation
checkpointing, local batch), simplest first within --search-seconds, the fastest that fit, and the chosen
one's overrides (``torchtitan_ext/plan/search.py``, whose docstring states the cost model). Step times are
model estimates, not measurements.
"""

from __future__ import annotations

from torchtitan_ext import cli
from torchtitan_ext.errors import UserError


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.plan", description=__doc__, epilog=cli.CONFIG_EPILOG)
    cli.add_config_option(p)
    p.add_argument("--gpus", action=cli.OptionValue, type=cli.positive_whole, metavar="N",
                   help="GPUs of the job (default: the world the config's parallelism names)")
    p.add_argument("--device-memory", action=cli.OptionValue, type=cli.positive_number, default=80.0,
                   metavar="GiB", help="memory of one device (default: 80)")
    p.add_argument("--search", action="store_true",
                   help="rank every layout that fits on --gpus N instead of planning the configured one")
    p.add_argument("--search-seconds", action=cli.OptionValue, type=cli.positive_number, default=20.0,
                   metavar="S", help="--search: stop trying layouts after S seconds and rank those tried (default: 20)")
    p.add_argument("--top", action=cli.OptionValue, type=cli.positive_whole, default=10, metavar="K",
                   help="--search: layouts in the table (default: 10)")
    p.add_argument("--gpus-per-node", action=cli.OptionValue, type=cli.positive_whole, default=8, metavar="G",
                   help="GPUs per node: a mesh dimension spanning nodes moves at --inter-node-gbps (default: 8)")
    p.add_argument("--mfu", action=cli.OptionValue, type=cli.positive_number, default=0.45, metavar="F",
                   help="achievable share of the peak for the compute alone (default: 0.45)")
    p.add_argument("--peak-tflops", action=cli.OptionValue, type=cli.positive_number, default=989.0, metavar="T",
                   help="dense bf16 peak of one GPU, TFLOP/s (default: 989)")
    p.add_argument("--intra-node-gbps", action=cli.OptionValue, type=cli.positive_number, default=360.0,
                   metavar="GB/s", help="bus bandwidth per GPU inside a node (default: 360, NVLink)")
    p.add_argument("--inter-node-gbps", action=cli.OptionValue, type=cli.positive_number, default=50.0,
                   metavar="GB/s", help="bandwidth per GPU across nodes (default: 50, 400 Gb/s InfiniBand)")
    p.add_argument("--tp-gbps", action=cli.OptionValue, type=cli.positive_number, default=120.0, metavar="GB/s",
                   help="effective bandwidth of tensor parallelism's collectives inside a node (default: 120)")
    p.add_argument("--hbm-gbps", action=cli.OptionValue, type=cli.positive_number, default=2600.0, metavar="GB/s",
                   help="HBM bandwidth the optimizer step achieves (default: 2600)")
    return p


def _main(argv: list[str]) -> int:
    from torchtitan_ext.config.loader import parse_args
    from torchtitan_ext.plan.estimate import GIB, plan_job, report
    from torchtitan_ext.plan.search import Hardware, search, search_report, step_time, time_report

    ns, rest = parser().parse_known_args(argv)
    if ns.mfu > 1:
        raise UserError(f"--mfu {ns.mfu:g}: expected a share of the peak, > 0 and <= 1")
    if ns.gpus and ns.gpus > ns.gpus_per_node and ns.gpus % ns.gpus_per_node:
        raise UserError(f"--gpus {ns.gpus}: expected a multiple of --gpus-per-node {ns.gpus_per_node} "
                        "for a job on more than one node")
    hw = Hardware(ns.peak_tflops * 1e12, ns.mfu, ns.intra_node_gbps * 1e9, ns.inter_node_gbps * 1e9,
                  ns.gpus_per_node, ns.tp_gbps * 1e9, ns.hbm_gbps * 1e9)
    cfg = parse_args(cli.job_argv(ns, rest))
    if not ns.search:
        p = plan_job(cfg, ns.gpus)
        print("\n".join(report(p, ns.device_memory, cfg) + time_report(step_time(cfg, p, hw), hw)))
        return 0
    if ns.gpus is None:
        raise UserError("--search: expected --gpus N (the GPUs to lay the job out on)")
    result = search(cfg, ns.gpus, ns.device_memory * GIB, hw, ns.search_seconds)
    if not result.ranked:
        low = result.smallest
        why = (f"the smallest predicted peak is {low.plan.peak / GIB:.1f} GiB per GPU ({low.layout}, AC "
               f"{low.cfg.activation_checkpoint.mode}, local batch {low.cfg.training.local_batch_size})"
               if low else "the trainer's checks refused every layout")
        if result.untried:
            why += f"; {result.untried} layouts left untried after --search-seconds {ns.search_seconds:g}"
        raise UserError(f"--device-memory {ns.device_memory:g}: no layout of {cfg.model.flavor} on {ns.gpus} GPUs "
                        f"fits {ns.device_memory:g} GiB per GPU; {why}; expected more GPUs or more memory")
    print("\n".join(search_report(result, cfg.model.flavor, ns.top)))
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)
