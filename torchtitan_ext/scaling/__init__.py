"""Scaling laws of this trainer's runs: L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022, their
third approach), fitted to (N, D, final validation loss) of a grid of runs; the compute-optimal N and D for a
FLOP budget follow in closed form. The command line is ``tools/scaling.py``; ``sweep.py`` runs the grid.

N counts the non-embedding parameters a token goes through (``non_embedding_params``): the small models a
sweep can afford are mostly vocabulary tables, which bend a law over total parameters (Kaplan et al. 2020).
D counts training tokens, and a budget C is C = 6 N D FLOPs (matmuls of forward and backward, attention
scores and the output head left out)."""

from __future__ import annotations

import csv
import dataclasses
import io
import itertools
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from torchtitan_ext.errors import UserError
from torchtitan_ext.metrics.logger import step_records
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.param_count import count_params

INSTALL_HINT = "pip install -e '.[scaling]'"
LAW = ("L(N, D) = E + A / N^alpha + B / D^beta; N: non-embedding parameters per token, D: training tokens, "
       "C = 6 N D FLOPs")
COLUMNS = ("params", "tokens", "loss")
HUBER_DELTA = 1e-3  # on log-loss residuals: near-L1 beyond 0.1 %, so a diverged or unlucky run weighs little
# Hoffmann et al.'s starting points for (a, alpha, b, beta, e), with A = exp(a), B = exp(b), E = exp(e).
START_GRID = np.array(list(itertools.product(range(0, 30, 5), (0, 0.5, 1, 1.5, 2), range(0, 30, 5),
                                             (0, 0.5, 1, 1.5, 2), (-1, -0.5, 0, 0.5, 1))), dtype=float)
# L-BFGS-B runs from the starts with the lowest objective only: on synthetic runs (0.1 % and 1 % noise) and a
# tiny sweep's, the 20 lowest reached the optimum of all 4500, in 0.5 s instead of 90 s.
REFINED_STARTS = 20
_BOUNDS = [(None, None), (0, None), (None, None), (0, None), (None, None)]  # exponents >= 0
MIN_RUNS = 5  # the law's parameters
MAX_LOG_COEFFICIENT = 700.0  # exp() of more overflows a float64: the optimiser ran off along a flat direction


class ScalingError(UserError):
    """Runs that cannot be read or fitted; one line naming the file, column or run."""


@dataclasses.dataclass(frozen=True)
class Run:
    """One training run: non-embedding parameters, training tokens, final validation loss; ``source`` names
    where it came from (a CSV line, a dump folder) for messages and ``write_csv``."""
    params: float
    tokens: float
    loss: float
    source: str = ""


@dataclasses.dataclass(frozen=True)
class ComputeOptimal:
    """The (N, D) on C = 6 N D with the lowest predicted loss."""
    flops: float
    params: float
    tokens: float
    loss: float


@dataclasses.dataclass(frozen=True)
class ScalingLaw:
    """A fitted law; ``objective`` is the summed Huber loss of the log residuals at the optimum."""
    E: float
    A: float
    alpha: float
    B: float
    beta: float
    objective: float = 0.0
    runs: int = 0

    def loss(self, params: float | np.ndarray, tokens: float | np.ndarray) -> float | np.ndarray:
        return self.E + self.A / np.power(params, self.alpha) + self.B / np.power(tokens, self.beta)

    def compute_optimal(self, flops: float) -> ComputeOptimal:
        """Minimise L(N, C / 6N): N_opt = G (C/6)^(beta / (alpha + beta)), G = (alpha A / (beta B))^(1 / (alpha +
        beta)), D_opt = C / (6 N_opt)."""
        if self.alpha <= 0 or self.beta <= 0:
            raise ScalingError(f"the fit has alpha = {self.alpha:.3g}, beta = {self.beta:.3g}: with an exponent of "
                               "0 the loss keeps falling along the iso-FLOP line, there is no compute-optimal point")
        s = self.alpha + self.beta
        g = (self.alpha * self.A / (self.beta * self.B)) ** (1 / s)
        n = g * (flops / 6) ** (self.beta / s)
        d = flops / (6 * n)
        return ComputeOptimal(flops, n, d, float(self.loss(n, d)))


def fit_law(runs: Sequence[Run], source: str = "the runs") -> ScalingLaw:
    """Minimise sum Huber_delta(log L_pred - log L) over (a, alpha, b, beta, e), log L_pred = logsumexp(a - alpha
    log N, b - beta log D, e) (positive A, B, E by construction; the log keeps every loss scale equally
    weighted), with L-BFGS-B from the ``REFINED_STARTS`` best of ``START_GRID``; the lowest optimum wins."""
    try:
        from scipy.optimize import minimize
    except ImportError:
        raise ScalingError(f"fitting needs scipy: {INSTALL_HINT}") from None
    if len(runs) < MIN_RUNS:
        raise ScalingError(f"{source}: {len(runs)} runs; fitting the law's {MIN_RUNS} parameters needs at least "
                           f"{MIN_RUNS}")
    if len({r.params for r in runs}) < 2 or len({r.tokens for r in runs}) < 2:
        raise ScalingError(f"{source}: the runs need at least 2 different params and 2 different tokens values")
    logs = tuple(np.log(np.array([[r.params, r.tokens, r.loss] for r in runs]).T))
    screen = np.concatenate([_objective(chunk, *logs, HUBER_DELTA)[0] for chunk in np.array_split(START_GRID, 10)])

    def one(theta: np.ndarray) -> tuple[float, np.ndarray]:
        value, grad = _objective(theta, *logs, HUBER_DELTA)
        return float(value[0]), grad[0]
    best = min((minimize(one, start, jac=True, method="L-BFGS-B", bounds=_BOUNDS,
                         options={"maxiter": 1000, "ftol": 1e-15, "gtol": 1e-12})
                for start in START_GRID[np.argsort(screen)[:REFINED_STARTS]]), key=lambda res: res.fun)
    a, alpha, b, beta, e = (float(v) for v in best.x)
    if max(a, b, e) > MAX_LOG_COEFFICIENT:
        raise ScalingError(f"{source}: the fit ran off to log A = {a:.3g}, log B = {b:.3g}, log E = {e:.3g}: the "
                           "runs' losses do not fall with params and tokens as the law needs")
    return ScalingLaw(math.exp(e), math.exp(a), alpha, math.exp(b), beta, float(best.fun), len(runs))


def _objective(theta: np.ndarray, log_n: np.ndarray, log_d: np.ndarray, log_l: np.ndarray,
               delta: float) -> tuple[np.ndarray, np.ndarray]:
    """For each row (a, alpha, b, beta, e) of ``theta``: the summed Huber loss of the log residuals and its
    gradient (screening the grid and L-BFGS-B share it)."""
    a, alpha, b, beta, e = (c[:, None] for c in np.atleast_2d(theta).T)
    terms = np.stack(np.broadcast_arrays(a - alpha * log_n, b - beta * log_d, e))  # (3, starts, runs)
    top = terms.max(0)
    exp = np.exp(terms - top)
    total = exp.sum(0)
    r = top + np.log(total) - log_l
    share = exp / total  # d logsumexp / d term
    slope = np.clip(r, -delta, delta)  # Huber'(r)
    value = np.where(np.abs(r) <= delta, 0.5 * r * r, delta * (np.abs(r) - 0.5 * delta)).sum(-1)
    grad = np.stack([(slope * share[0]).sum(-1), -(slope * share[0] * log_n).sum(-1),
                     (slope * share[1]).sum(-1), -(slope * share[1] * log_d).sum(-1), (slope * share[2]).sum(-1)], -1)
    return value, grad


def report(law: ScalingLaw, flops: float | None = None, predict: tuple[float, float] | None = None) -> dict:
    """The fit as JSON-ready values; with ``flops`` the compute-optimal point, with ``predict`` = (N, D) its loss."""
    out = {"law": LAW, **dataclasses.asdict(law)}
    if flops is not None:
        out["compute_optimal"] = dataclasses.asdict(law.compute_optimal(flops))
    if predict is not None:
        out["prediction"] = {"params": predict[0], "tokens": predict[1], "loss": float(law.loss(*predict))}
    return out


def non_embedding_params(args: ModelArgs) -> int:
    """N of the law: ``count_params``' active parameters (k experts of each MoDE layer) less the input embedding
    and, when untied, the output head."""
    counts = count_params(args)
    return counts["active"] - counts["embedding"] * (1 if args.tie_embeddings else 2)


def read_csv(path: str | Path) -> list[Run]:
    """Runs from a CSV with columns params, tokens, loss (others ignored); each value finite and > 0."""
    path = Path(path)
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ScalingError(f"{path}: not a text (CSV) file") from None
    except OSError as e:
        raise ScalingError(f"{path}: cannot read it ({e.strerror or e})") from None
    reader = csv.DictReader(io.StringIO(text))
    reader.fieldnames = [name.strip() for name in reader.fieldnames or []]
    for column in COLUMNS:
        if column not in reader.fieldnames:
            raise ScalingError(f"{path}: no column {column!r} (expected columns {', '.join(COLUMNS)})")
    runs = []
    for row in reader:
        values = []
        for column in COLUMNS:
            raw = (row[column] or "").strip()
            try:
                value = float(raw)
            except ValueError:
                value = math.nan
            if not (math.isfinite(value) and value > 0):
                raise ScalingError(f"{path} line {reader.line_num}: {column} = {raw!r}: expected a finite number > 0")
            values.append(value)
        runs.append(Run(*values, source=f"{path} line {reader.line_num}"))
    return runs


def write_csv(path: str | Path, runs: Sequence[Run]) -> None:
    """``read_csv``'s format, with each run's source as a fourth column ``run``."""
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*COLUMNS, "run"])
        writer.writerows([int(r.params), int(r.tokens), repr(r.loss), r.source] for r in runs)


def read_dump(folder: str | Path) -> Run:
    """A finished run from its dump folder: N from ``config.toml`` (the model the trainer resolved, with the
    vocabulary of the run's saved tokenizer), the loss and step of the last ``val_loss`` in ``metrics.jsonl``,
    D = the ``tokens`` logged at that step (else step x global batch x seq_len, the batch from ``run.json``)."""
    from torchtitan_ext.checkpoint.run_folder import read_identity
    from torchtitan_ext.config.loader import parse_args
    from torchtitan_ext.data.tokenizers import RUN_FOLDER, read_meta, vocab_size_of
    from torchtitan_ext.models.flavors import resolve_model_args

    folder = Path(folder)
    if not (folder / "config.toml").is_file():
        raise ScalingError(f"{folder}: no config.toml (expected a training run's dump folder)")
    cfg = parse_args(["--config", str(folder / "config.toml")])
    meta = read_meta(folder / RUN_FOLDER)
    vocab = int(meta["vocab_size"]) if meta and "vocab_size" in meta else \
        vocab_size_of(cfg.data.tokenizer, cfg.data.tokenizer_vocab_size)
    params = non_embedding_params(resolve_model_args(cfg, vocab))
    step, loss, tokens = final_validation(folder)
    if tokens is None:
        batch = (read_identity(folder) or {}).get("training.global_batch_size") or cfg.training.global_batch_size
        if batch <= 0:
            raise ScalingError(f"{folder}: metrics.jsonl logs no tokens at step {step} and neither run.json nor "
                               "config.toml gives the global batch size")
        tokens = step * batch * cfg.training.seq_len
    return Run(params, tokens, loss, str(folder))


def final_validation(folder: Path) -> tuple[int, float, int | None]:
    """(step, val_loss) of the last validation in ``metrics.jsonl`` and the tokens logged at that step, if any."""
    path = folder / "metrics.jsonl"
    if not path.is_file():
        raise ScalingError(f"{folder}: no metrics.jsonl (expected a training run's dump folder)")
    last, tokens = None, {}
    for _, record in step_records(path):
        if "tokens" in record:
            tokens[record["step"]] = int(record["tokens"])
        if "val_loss" in record:
            last = (record["step"], float(record["val_loss"]))
    if last is None:
        raise ScalingError(f"{folder}: no val_loss in metrics.jsonl (the trainer logs it after the last step "
                           "unless eval.steps = 0; did the run finish?)")
    if not (math.isfinite(last[1]) and last[1] > 0):
        raise ScalingError(f"{folder}: the last val_loss in metrics.jsonl (step {last[0]}) is {last[1]}; a "
                           "diverged run has no place in the fit")
    return last[0], last[1], tokens.get(last[0])


def plot_fit(law: ScalingLaw, runs: Sequence[Run], path: str | Path) -> None:
    """PNG: loss against tokens, one colour per model size, the runs as points and the law as curves."""
    try:
        from matplotlib import colormaps
        from matplotlib.figure import Figure
    except ImportError:
        raise ScalingError(f"plotting needs matplotlib: {INSTALL_HINT}") from None
    fig = Figure(figsize=(7, 5), layout="constrained")
    ax = fig.add_subplot()
    tokens = np.array([r.tokens for r in runs])
    grid = np.geomspace(tokens.min() / 1.5, tokens.max() * 1.5, 200)
    sizes = sorted({r.params for r in runs})
    for i, n in enumerate(sizes):
        color = colormaps["viridis"](i / max(len(sizes) - 1, 1))
        mine = [r for r in runs if r.params == n]
        ax.scatter([r.tokens for r in mine], [r.loss for r in mine], color=color)
        ax.plot(grid, law.loss(n, grid), color=color, label=f"N = {n:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("training tokens D")
    ax.set_ylabel("validation loss")
    ax.set_title(f"E = {law.E:.3g}, A = {law.A:.3g}, alpha = {law.alpha:.3g}, B = {law.B:.3g}, "
                 f"beta = {law.beta:.3g}", fontsize=9)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=120)
