"""How far one run's training loss is from a reference run's, window by window, for two runs of the same data:

  python benchmarks/loss_gap.py REFERENCE RUN [--window 50]

Each of REFERENCE and RUN is a run's metrics.jsonl, or its console log (the ``<scenario>_<run>.log`` files that
``benchmarks/run.py`` keeps in logs.tar.gz). Both must log the same steps (``log_freq = 1`` for every step).
Prints one line per window of steps: the mean loss of each run over the window and their relative difference.
A single window's difference is noisy; how it moves from window to window says how much of it is noise.
"""

from __future__ import annotations

import re
import statistics
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCH.parent), str(BENCH)]

import steady  # noqa: E402  (this folder)

from torchtitan_ext.cli import ArgumentParser, positive_whole, run_tool  # noqa: E402
from torchtitan_ext.errors import UserError  # noqa: E402

CONSOLE_STEP = re.compile(r"^step\s+(\d+)\s+loss\s+([\d.eE+-]+|nan|inf)\b")


def step_losses(path: Path) -> dict[int, float]:
    """The training loss of every logged step of a metrics.jsonl or console log."""
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    if path.suffix == ".jsonl":
        try:
            rows = steady.metrics_rows(path)
        except ValueError as e:
            raise UserError(f"{path}: {e}") from None
        losses = {row.get("step"): row["loss"] for row in rows if "loss" in row and "tokens_per_sec" in row}
        if bad := next(((s, v) for s, v in losses.items() if not isinstance(s, int) or isinstance(v, bool)
                        or not isinstance(v, (int, float))), None):
            raise UserError(f"{path}: step {bad[0]!r} logs loss {bad[1]!r}; expected a whole step and a number")
    else:
        losses = {int(m[1]): float(m[2]) for line in path.read_text(errors="replace").splitlines()
                  if (m := CONSOLE_STEP.match(line))}
    if not losses:
        raise UserError(f"{path}: no training step's loss in it (expected metrics.jsonl rows or 'step N  loss X' "
                        f"console lines)")
    return losses


def windowed_gaps(reference: dict[int, float], run: dict[int, float], window: int
                  ) -> list[tuple[int, int, float, float, float]]:
    """(first step, last step, reference mean, run mean, run / reference - 1) per window of the steps both
    logged, the last window ending at their last common step."""
    steps = sorted(set(reference) & set(run))
    if not steps:
        raise UserError("the two runs logged no step in common")
    out = []
    for end in range(len(steps), 0, -window):
        chunk = steps[max(end - window, 0):end]
        ref, got = statistics.fmean(reference[s] for s in chunk), statistics.fmean(run[s] for s in chunk)
        out.append((chunk[0], chunk[-1], ref, got, got / ref - 1))
    return out[::-1]


def main(argv: list[str]) -> int:
    p = ArgumentParser(prog="python benchmarks/loss_gap.py", description=__doc__.splitlines()[0])
    p.add_argument("reference", type=Path, help="the reference run's metrics.jsonl or console log")
    p.add_argument("run", type=Path, help="the compared run's metrics.jsonl or console log")
    p.add_argument("--window", type=positive_whole, default=50, help="steps per window (default 50)")
    ns = p.parse_args(argv)
    for first, last, ref, got, gap in windowed_gaps(step_losses(ns.reference), step_losses(ns.run), ns.window):
        print(f"steps {first:>5}-{last:<5} reference {ref:.4f}  run {got:.4f}  {100 * gap:+.2f}%")
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
