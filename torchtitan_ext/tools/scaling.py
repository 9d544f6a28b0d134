"""Scaling laws of this trainer's runs:

    python -m torchtitan_ext.scaling fit (--input OUT/runs.csv | --runs DUMP ...) [--flops C] [--predict N,D]
                                         [--plot PNG]
    python -m torchtitan_ext.scaling sweep --config FILE --widths DIM ... --tokens D ... [--out DIR] [--nproc N]
                                           [--parallel N] [--fit] [--dry-run] [-- --section.key value ...]

fit: L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022), a Huber loss on log residuals minimised from
a grid of starting points; prints E, A, alpha, B, beta as JSON, with --flops the compute-optimal N and D of
C = 6 N D FLOPs, with --predict the loss of one (N, D). N counts non-embedding parameters per token (MoDE:
k experts; no embedding or output head), D training tokens. --input: a CSV with columns params, tokens, loss,
such as the OUT/runs.csv a sweep writes (fit --input outputs/scaling/runs.csv after sweep --out
outputs/scaling); --runs: dump folders of finished runs (config.toml, and the last val_loss of metrics.jsonl).

sweep: one training run per width (model.dim, with heads of the config's head_dim and FFNs of its ratio) and
token budget (training.steps of the config's global batch), one after another, dumped in OUT/w{dim}_t{tokens};
then OUT/runs.csv (params, tokens, loss, run) and with --fit OUT/fit.json and OUT/fit.png. A run already
finished in OUT is read back, not rerun. --dry-run prints the commands only.
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path

from torchtitan_ext import cli


def _pair(raw: str) -> tuple[float, float]:
    """argparse type: ``N,D``."""
    parts = raw.split(",")
    if len(parts) != 2:
        raise argparse.ArgumentTypeError(f"expected N,D (e.g. 1e9,2e10), got {raw!r}")
    return cli.positive_number(parts[0]), cli.positive_number(parts[1])


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.scaling", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True, metavar="{fit,sweep}")
    fit = sub.add_parser("fit", help="fit the law to runs; print it as JSON", description=__doc__)
    source = fit.add_mutually_exclusive_group(required=True)
    source.add_argument("--input", action=cli.OptionValue, metavar="CSV",
                        help="runs as a CSV with columns params (non-embedding), tokens, loss")
    source.add_argument("--runs", nargs="+", metavar="DUMP", help="dump folders of finished training runs")
    fit.add_argument("--flops", action=cli.OptionValue, type=cli.positive_number, metavar="C",
                     help="a training budget in FLOPs: print the compute-optimal N and D (C = 6 N D) and their loss")
    fit.add_argument("--predict", action=cli.OptionValue, type=_pair, metavar="N,D",
                     help="print the loss the law predicts for N non-embedding parameters and D tokens")
    fit.add_argument("--plot", action=cli.OptionValue, metavar="PNG",
                     help="write a PNG of the runs and the fitted curves (loss against tokens per model size)")
    sweep = sub.add_parser("sweep", help="train the grid of widths x token budgets, write runs.csv",
                           description=__doc__, epilog=cli.CONFIG_EPILOG + "\nOverrides may also follow a lone --.")
    cli.add_config_option(sweep)
    sweep.add_argument("--widths", nargs="+", type=cli.positive_whole, required=True, metavar="DIM",
                       help="model.dim values")
    sweep.add_argument("--tokens", nargs="+", type=cli.positive_whole, required=True, metavar="D",
                       help="training tokens of each run (rounded to whole steps of the global batch)")
    sweep.add_argument("--out", action=cli.OptionValue, default="outputs/scaling", metavar="DIR",
                       help="folder of the runs' dump folders and runs.csv (default: outputs/scaling)")
    sweep.add_argument("--nproc", action=cli.OptionValue, type=cli.positive_whole, default=1, metavar="N",
                       help="processes per run (> 1: torch.distributed.run --standalone; default: 1)")
    sweep.add_argument("--parallel", action=cli.OptionValue, type=cli.positive_whole, default=1, metavar="N",
                       help="runs at once (small models share a GPU; default: 1). Each run's output then goes "
                            "to OUT/w{dim}_t{tokens}.log")
    sweep.add_argument("--fit", action="store_true", help="fit the law afterwards: OUT/fit.json, OUT/fit.png")
    sweep.add_argument("--dry-run", action="store_true", help="print the trainer commands, run nothing")
    return p


def _fit(ns: argparse.Namespace) -> None:
    from torchtitan_ext.scaling import fit_law, plot_fit, read_csv, read_dump, report

    runs = read_csv(ns.input) if ns.input is not None else [read_dump(folder) for folder in ns.runs]
    law = fit_law(runs, ns.input or "--runs")
    out = report(law, ns.flops, ns.predict)
    if ns.plot is not None:
        plot_fit(law, runs, ns.plot)
    print(json.dumps(out, indent=2))


def _sweep(ns: argparse.Namespace, overrides: list[str]) -> None:
    from torchtitan_ext.scaling import fit_law, plot_fit, report, write_csv
    from torchtitan_ext.scaling.sweep import plan_sweep, run_sweep

    plan = plan_sweep(cli.job_argv(ns, overrides), ns.widths, ns.tokens, ns.out, ns.nproc)
    if ns.dry_run:
        print("\n".join(shlex.join(job.command) for job in plan))
        return
    runs = run_sweep(plan, ns.parallel)
    out = Path(ns.out)
    write_csv(out / "runs.csv", runs)
    print(f"wrote {out / 'runs.csv'} ({len(runs)} runs)")
    if ns.fit:
        law = fit_law(runs, str(out / "runs.csv"))
        text = json.dumps(report(law), indent=2)
        (out / "fit.json").write_text(text + "\n")
        plot_fit(law, runs, out / "fit.png")
        print(text)


def _main(argv: list[str]) -> int:
    head, tail = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    ns, rest = parser().parse_known_args(head)
    if ns.command == "fit":
        if rest or tail:
            raise cli.UsageError(f"unrecognized arguments: {' '.join(rest + tail)}")
        _fit(ns)
    else:
        _sweep(ns, rest + tail)
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)
