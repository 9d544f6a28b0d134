"""A grid of small runs for a scaling-law fit on this machine (one after another, or several at once): each
width (``model.dim``) with each token budget (``training.steps`` of the config's global batch), the rest of the
job as configured.

A width keeps the config's shape: heads of the same head_dim (n_heads = dim x n_heads / dim of the config,
which is dim // head_dim when head_dim is dim / n_heads), the same queries per K/V head where the head count
allows it (else the nearest divisor), FFN hidden sizes in the same ratio to dim; depth stays as configured.
"""

from __future__ import annotations

import logging
import math
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.scaling import Run, ScalingError, final_validation, non_embedding_params, read_dump

log = logging.getLogger(__name__)


class PlannedRun(NamedTuple):
    """One run of the grid: its width, token budget (as asked), steps, non-embedding parameters, dump folder
    and trainer command line."""
    dim: int
    tokens: int
    steps: int
    params: int
    folder: Path
    command: list[str]


def width_overrides(args: ModelArgs, dim: int) -> dict[str, int]:
    """The ``[model]`` keys that scale the model ``args`` to width ``dim`` (see the module's docstring)."""
    if dim * args.n_heads % args.dim:
        step = args.dim // math.gcd(args.dim, args.n_heads)
        raise ScalingError(f"--widths {dim}: not a whole number of heads of the config's shape (dim {args.dim}, "
                           f"{args.n_heads} heads); use multiples of {step}")
    heads = dim * args.n_heads // args.dim
    group = args.n_heads // args.kv_heads
    kv = max(d for d in range(1, max(heads // group, 1) + 1) if heads % d == 0)
    out = {"dim": dim, "n_heads": heads, "n_kv_heads": kv,
           "ffn_hidden": max(round(dim * args.ffn_hidden / args.dim), 1)}
    if args.moe_hidden:
        out["moe_hidden"] = max(round(dim * args.moe_hidden / args.dim), 1)
    return out


def global_batch_tokens(cfg: JobConfig, nproc: int) -> int:
    """Tokens of one optimizer step of ``cfg`` on ``nproc`` processes."""
    from torchtitan_ext.parallel.dims import ParallelDims

    t = cfg.training
    sequences = t.global_batch_size if t.global_batch_size > 0 else \
        t.local_batch_size * ParallelDims.from_config(cfg.parallelism, nproc).dp
    return sequences * t.seq_len


def plan_sweep(job_argv: Sequence[str], widths: Sequence[int], budgets: Sequence[int], out: str | Path,
               nproc: int = 1) -> list[PlannedRun]:
    """Every (width, budget) run of the job that ``job_argv`` (``--config FILE`` and overrides) describes, dumped
    under ``out/w{dim}_t{tokens}``; ``nproc`` > 1 launches each with ``torch.distributed.run``."""
    from torchtitan_ext.config.loader import parse_args
    from torchtitan_ext.data.tokenizers import vocab_size_of
    from torchtitan_ext.models.flavors import resolve_model_args

    cfg = parse_args(list(job_argv))
    if cfg.eval.steps == 0:
        raise ScalingError("eval.steps = 0: the sweep needs each run's final validation loss")
    vocab = vocab_size_of(cfg.data.tokenizer, cfg.data.tokenizer_vocab_size)
    args = resolve_model_args(cfg, vocab)
    batch = global_batch_tokens(cfg, nproc)
    launcher = [sys.executable, "-m", "torchtitan_ext.train"] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
         "-m", "torchtitan_ext.train"]
    runs = []
    for dim in widths:
        sized = [*job_argv, *(f"--model.{k}={v}" for k, v in width_overrides(args, dim).items())]
        params = non_embedding_params(resolve_model_args(parse_args(sized), vocab))
        for tokens in budgets:
            steps = max(round(tokens / batch), 1)
            folder = Path(out) / f"w{dim}_t{tokens}"
            command = [*launcher, *sized, f"--training.steps={steps}", f"--job.dump_folder={folder}"]
            runs.append(PlannedRun(dim, tokens, steps, params, folder, command))
    return runs


def run_sweep(plan: Sequence[PlannedRun], parallel: int = 1) -> list[Run]:
    """Run the planned jobs, ``parallel`` at a time (small models leave a GPU mostly idle, so several can share
    it), and read back their results in plan order. One at a time, a run's console output passes through;
    several at a time, each writes it to ``<its dump folder>.log`` beside the folder. A run whose dump already
    holds a validation loss at its last step is read, not rerun, so a stopped sweep continues."""
    todo = [job for job in plan if not _finished(job)]
    for job in plan:
        if job not in todo:
            log.info(f"sweep: {job.folder} finished before, read back")
    with ThreadPoolExecutor(max(1, parallel)) as pool:
        for job, code in zip(todo, pool.map(lambda job: _train(job, parallel > 1), todo), strict=True):
            if code != 0:
                raise ScalingError(f"{job.folder}: the trainer exited with code {code} (its log: "
                                   f"{job.folder / 'logs' / 'rank-0.log'})")
    return [read_dump(job.folder) for job in plan]


def _train(job: PlannedRun, to_file: bool) -> int:
    log.info(f"sweep: {job.folder}: dim {job.dim}, N = {job.params:,}, {job.steps} steps")
    if not to_file:
        return subprocess.run(job.command).returncode
    job.folder.parent.mkdir(parents=True, exist_ok=True)
    with open(job.folder.with_name(job.folder.name + ".log"), "w") as out:
        return subprocess.run(job.command, stdout=out, stderr=subprocess.STDOUT).returncode


def _finished(job: PlannedRun) -> bool:
    try:
        return final_validation(job.folder)[0] == job.steps
    except ScalingError:
        return False
