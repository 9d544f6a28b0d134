"""muP coordinate check: train the config's model at several widths for a few steps and print the RMS of
each layer's output and of the logits after each step, then plot them (PNG):

    python -m torchtitan_ext.mup.coord_check --config FILE --widths 128,256,512,1024 --steps 5

Under model.parametrization = "mup" the RMS stays about the same across widths; under "standard" it grows
with width (compare with --model.parametrization standard). One process on the job's device; the widths must
be multiples of the model's head_dim. Each width and step is one progress line (a width takes minutes on a
CPU). The plot needs matplotlib (pip install -e '.[scaling]'), asked for before anything runs; --plot ''
prints the table alone.
"""

from __future__ import annotations

from pathlib import Path

from torchtitan_ext import cli
from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.errors import UserError


def _widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",")]
    except ValueError:
        raise UserError(f"--widths {text!r}: expected comma-separated integers, e.g. 128,256,512") from None
    if len(widths) < 2 or min(widths) < 1 or len(set(widths)) != len(widths):
        raise UserError(f"--widths {text!r}: expected at least two different positive widths")
    return sorted(widths)


def parser() -> cli.ArgumentParser:
    p = cli.ArgumentParser(prog="python -m torchtitan_ext.mup.coord_check", description=__doc__,
                           epilog=cli.CONFIG_EPILOG)
    cli.add_config_option(p)
    p.add_argument("--widths", action=cli.OptionValue, metavar="W1,W2,...", default="128,256,512,1024",
                   help="model widths (dim) to compare (default 128,256,512,1024)")
    p.add_argument("--steps", action=cli.OptionValue, metavar="N", type=int, default=5,
                   help="optimizer steps at each width (default 5)")
    p.add_argument("--plot", action=cli.OptionValue, metavar="PNG", default="outputs/coord_check.png",
                   help="where to write the plot (default outputs/coord_check.png; '': none)")
    return p


def _main(argv: list[str]) -> int:
    from torchtitan_ext.mup import check_plotting, format_table, plot, run_coord_check

    ns, rest = parser().parse_known_args(argv)
    if ns.steps < 1:
        raise UserError(f"--steps {ns.steps}: expected >= 1")
    widths = _widths(ns.widths)
    if ns.plot:
        check_plotting()  # a missing extra is said now, not after minutes of training
    result = run_coord_check(parse_args(cli.job_argv(ns, rest)), widths, ns.steps)
    print(format_table(result))
    if ns.plot:
        Path(ns.plot).parent.mkdir(parents=True, exist_ok=True)
        plot(result, ns.plot)
        print(f"plot: {ns.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    return cli.run_tool(_main, argv)
