"""Learning-rate transfer across widths (issue 29): an AdamW learning-rate sweep at two widths 4x apart, under
the standard parametrization and under muP (``model.mup_base_dim`` = the smaller width), every run through
``python -m torchtitan_ext.train`` with the same depth, tokens and data. Several small runs share the GPU.

    python benchmarks/mup_lr_transfer.py --out /tmp/mup [--widths 256 1024] [--steps 300] [--parallel 4]

Writes ``runs.json`` (width, parametrization, lr, final validation loss, wall seconds) and
``lr_transfer.png`` (validation loss against learning rate, one curve per width, one panel per
parametrization) into ``--out`` and prints the best grid point per (parametrization, width)."""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def command(out: Path, width: int, param: str, lr: float, a: argparse.Namespace) -> list[str]:
    heads = width // a.head_dim
    return [sys.executable, "-m", "torchtitan_ext.train", "--config", str(REPO / "train_configs/debug.toml"),
            "--job.dump_folder", str(out), "--model.dim", str(width), "--model.n_heads", str(heads),
            "--model.n_kv_heads", str(heads), "--model.ffn_hidden", str(3 * width), "--model.n_layers", str(a.layers),
            "--model.parametrization", param, "--model.mup_base_dim", str(a.widths[0]),
            "--optimizer.lr", f"{lr:.6g}", "--training.steps", str(a.steps), "--training.seq_len", "256",
            "--training.local_batch_size", str(a.batch), "--lr_scheduler.warmup_steps", str(a.steps // 10),
            "--checkpoint.enabled", "false", "--metrics.tensorboard", "false", "--metrics.log_freq", "50",
            "--eval.steps", "20", "--job.seed", str(a.seed)]


def final_val_loss(folder: Path) -> float:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    vals = [r["val_loss"] for r in rows if "val_loss" in r]
    return vals[-1] if vals and math.isfinite(vals[-1]) else float("nan")


def run_one(job: tuple[int, str, float], a: argparse.Namespace) -> dict:
    width, param, lr = job
    folder = a.out / f"{param}_w{width}_lr{lr:.3g}"
    t0 = time.time()
    proc = subprocess.run(command(folder, width, param, lr, a), capture_output=True, text=True, cwd=REPO)
    loss = final_val_loss(folder) if proc.returncode == 0 else float("nan")
    if proc.returncode != 0:
        print(f"{folder.name}: exit {proc.returncode}: {proc.stderr.strip().splitlines()[-1:]}", flush=True)
    return {"width": width, "parametrization": param, "lr": lr, "val_loss": loss,
            "seconds": round(time.time() - t0, 1)}


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    params = sorted({r["parametrization"] for r in rows})
    fig, axes = plt.subplots(1, len(params), figsize=(6 * len(params), 4.5), sharey=True)
    for ax, param in zip(axes if len(params) > 1 else [axes], params, strict=True):
        for width in sorted({r["width"] for r in rows}):
            pts = sorted((r["lr"], r["val_loss"]) for r in rows
                         if r["parametrization"] == param and r["width"] == width)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"width {width}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("AdamW learning rate")
        ax.set_title(param)
        ax.legend()
    (axes[0] if len(params) > 1 else axes).set_ylabel("final validation loss")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=Path("/tmp/mup_lr_transfer"))
    p.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--lrs", type=float, nargs="+", default=[2.0 ** e for e in range(-12, -4)])
    p.add_argument("--params", nargs="+", default=["standard", "mup"])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", type=int, default=4)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    # One short run first: the builtin tokenizer and corpus shards are built once, not by every run at once.
    subprocess.run(command(a.out / "warmup", a.widths[0], "standard", 1e-3, a)[:-2] + ["--training.steps", "1"],
                   check=True, capture_output=True, cwd=REPO)
    jobs = [(w, param, lr) for param in a.params for w in a.widths for lr in a.lrs]
    t0 = time.time()
    with ThreadPoolExecutor(a.parallel) as pool:
        rows = list(pool.map(lambda job: run_one(job, a), jobs))
    (a.out / "runs.json").write_text(json.dumps(rows, indent=1))
    for param in a.params:
        for w in a.widths:
            mine = [r for r in rows
                    if r["parametrization"] == param and r["width"] == w and math.isfinite(r["val_loss"])]
            best = min(mine, key=lambda r: r["val_loss"]) if mine else None
            print(json.dumps({"parametrization": param, "width": w, "best_lr": best and best["lr"],
                              "best_val_loss": best and round(best["val_loss"], 4),
                              "losses": {f"{r['lr']:.3g}": round(r["val_loss"], 4) for r in mine}}))
    print(json.dumps({"runs": len(rows), "wall_s": round(time.time() - t0, 1)}))
    plot(rows, a.out / "lr_transfer.png")


if __name__ == "__main__":
    main()
