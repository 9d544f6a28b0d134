"""Before benchmarks/scaling_prediction.sh trains anything: every small run's compute (6 N D, N from the sweep's
own planner, D in whole steps) must be at most 1/10 of the target's. Prints the target's ``N,D`` on the first
line (the prediction's input), then a summary; a run over the cap is named and the exit code is 1.

    python benchmarks/scaling_check_cap.py SCALE TARGET SMALL RUNS -- TRAINER_OVERRIDES...

TARGET is ``width:tokens``, SMALL the script's ``width:parallel:t1,t2 ...`` list, RUNS a runs.csv or "". With a
SCALE other than 1 (a smoke test) runs over the cap are counted, not refused.
"""

from __future__ import annotations

import csv
import math
import sys

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.scaling import ScalingError
from torchtitan_ext.scaling.sweep import global_batch_tokens, plan_sweep

CONFIG = ["--config", "train_configs/debug.toml"]


def budget(raw: str, where: str) -> float:
    """A token budget such as ``100e6``: finite and > 0, else a ValueError naming ``where``."""
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{where}: token budget {raw!r}: expected a finite number > 0 (e.g. 100e6)")
    return value


def planned(job_argv: list[str], width: int, budgets: list[float], scale: float) -> list[tuple[int, int]]:
    """(N, D) of each of one width's runs as the sweep will train them (D in its whole steps)."""
    batch = global_batch_tokens(parse_args(job_argv), 1)
    jobs = plan_sweep(job_argv, [width], [int(t * scale) for t in budgets], "/tmp/scaling_check_cap")
    return [(job.params, job.steps * batch) for job in jobs]


def main(argv: list[str]) -> int:
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
        return 0
    if "--" not in argv or argv.index("--") != 4:
        raise ValueError("usage: scaling_check_cap.py SCALE TARGET SMALL RUNS -- TRAINER_OVERRIDES... (--help)")
    head, overrides = argv[:4], argv[5:]
    scale, target, small, runs = float(head[0]), head[1], head[2], head[3]
    job_argv = [*CONFIG, *overrides]
    parts = target.split(":")
    if len(parts) != 2:
        raise ValueError(f"TARGET={target!r}: expected WIDTH:TOKENS (e.g. 512:100e6)")
    [(n_t, d_t)] = planned(job_argv, int(parts[0]), [budget(parts[1], f"TARGET={target!r}")], scale)
    cap = 6 * n_t * d_t / 10
    print(f"{n_t},{d_t}")
    rows = [(float(r["params"]), float(r["tokens"])) for r in csv.DictReader(open(runs))] if runs else []
    for spec in small.split():
        if spec.count(":") != 2:
            raise ValueError(f"SMALL entry {spec!r}: expected WIDTH:PARALLEL:TOKENS[,TOKENS...]")
        w, _, budgets = spec.split(":")
        rows += planned(job_argv, int(w), [budget(t, f"SMALL entry {spec!r}") for t in budgets.split(",")],
                        scale)
    over = [(n, d) for n, d in rows if 6 * n * d > cap * (1 + 1e-9)]
    if over and scale != 1:  # a smoke test's budgets are a few whole steps each: the ratio cannot hold
        print(f"SCALE={scale:g}: {len(over)} runs over the cap, not enforced below SCALE=1")
    elif over:
        print(f"small runs over 1/10 of the target's compute ({cap:.3g} FLOPs): "
              + ", ".join(f"N {n:.0f} x D {d:.0f} ({6 * n * d:.3g})" for n, d in over))
        return 1
    if rows:
        print(f"{len(rows)} small runs; the largest uses {max(6 * n * d for n, d in rows) / (cap * 10):.3f} of the "
              f"target's {cap * 10:.3g} FLOPs")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main(sys.argv[1:]))
    except (ConfigError, ScalingError, ValueError, OSError) as e:
        print(f"scaling_check_cap.py: {e}")
        sys.exit(1)
