"""The coordinate check of muP (``model.parametrization = "mup"``), whose command line is
``python -m torchtitan_ext.mup.coord_check``.

The parametrization itself lives where it acts: ``ModelArgs`` (``width_mult``, ``attention_scale``,
``output_multiplier``), ``Decoder.init_plan`` and ``Decoder.head_input``, the attention core's ``scale`` and
``train/optim.lr_scale``. A coordinate check (Tensor Programs V, appendix D) trains the config's model at
several widths for a few steps with the same hyperparameters and records the RMS of each layer's output:
under muP those stay about the same at every width, while under the standard parametrization the updates'
effect, and with it the activations and logits, grows with width.

Each width is the config's model with ``dim`` set to it: head_dim fixed (heads = width / head_dim, K/V heads
in the config's ratio), FFN and expert hidden sizes scaled with the width, vocabulary, depth and the base
width (``mup_base_dim``, or the config's dim when unset) unchanged. It runs in this process on the job's
device, eagerly (no compile, no fused linear cross-entropy: the logits are measured), built by the trainer's
own stages (``train/build.py``) and stepped by its optimizers (``train/optim.py``) on the same batches of the
config's training data at every width: a constant lr, the config's peak ``optimizer.lr``, and no gradient
clipping, which would tie every layer's update to the global gradient norm and so to the width. After each
step the RMS is measured on one fixed batch (not trained on), in eval mode and without gradients.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import time
from pathlib import Path

import torch
import torch.nn as nn

from torchtitan_ext.config.job_config import JobConfig, ParallelismSection
from torchtitan_ext.data.registry import build_loaders, build_tokenizer
from torchtitan_ext.errors import UserError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.flavors import resolve_model_args
from torchtitan_ext.parallel.grad_norm import grad_norm
from torchtitan_ext.scaling import INSTALL_HINT  # the extra that installs matplotlib
from torchtitan_ext.train.build import build_model, build_runtime, forward_context
from torchtitan_ext.train.losses import cross_entropy_loss
from torchtitan_ext.train.optim import Optimizers

log = logging.getLogger(__name__)


@dataclasses.dataclass
class CoordCheck:
    """RMS of each layer's output (``names``: the embedding, every block, the logits) per width and step:
    ``rms[width][s]`` after s optimizer steps (s = 0: at initialisation)."""
    parametrization: str
    base_dim: int
    widths: list[int]
    names: list[str]
    rms: dict[int, list[dict[str, float]]]

    def spread(self, name: str, step: int) -> float:
        """Largest over smallest RMS of ``name`` across the widths after ``step`` steps (1: width-independent)."""
        values = [self.rms[w][step][name] for w in self.widths]
        return max(values) / min(values)


def width_args(args: ModelArgs, width: int) -> ModelArgs:
    """The model ``args`` at d_model ``width`` (see the module docstring); UserError for a width the heads do
    not divide."""
    hdim = args.hdim
    if width < hdim or width % hdim:
        raise UserError(f"width {width}: expected a multiple of the model's head_dim {hdim}")
    heads = width // hdim
    group = max(1, args.n_heads // args.kv_heads)  # query heads per K/V head
    return dataclasses.replace(
        args, dim=width, n_heads=heads, n_kv_heads=math.gcd(heads, max(1, heads // group)), head_dim=hdim,
        ffn_hidden=max(1, args.ffn_hidden * width // args.dim),
        moe_hidden=max(1, args.moe_hidden * width // args.dim) if args.moe_hidden else 0,
        mup_base_dim=args.mup_base_dim or args.dim)


def _rms(t: torch.Tensor) -> float:
    return t.detach().float().pow(2).mean().sqrt().item()


@torch.no_grad()
def measure(model: nn.Module, inputs: torch.Tensor) -> dict[str, float]:
    """RMS of the embedding's, every block's and the logits' outputs for ``inputs`` (forward hooks)."""
    out: dict[str, float] = {}
    names = {model.tok_embeddings: "embedding", **{block: f"layers.{i}" for i, block in model.layers.items()}}

    def hook(module, args, output):
        out[names[module]] = _rms(output[0] if isinstance(output, tuple) else output)  # a KV-sharing block's (h, kv)

    handles = [module.register_forward_hook(hook) for module in names]
    was_training = model.training
    model.eval()
    try:
        out["logits"] = _rms(model(inputs))
    finally:
        model.train(was_training)
        for handle in handles:
            handle.remove()
    return out


def run_coord_check(cfg: JobConfig, widths: list[int], steps: int) -> CoordCheck:
    """Train the config's model at each width for ``steps`` steps; the RMS after each (see the module
    docstring). UserError for a width the model cannot take."""
    cfg = copy.deepcopy(cfg)  # one process, eagerly, with the logits out (see the module docstring)
    cfg.parallelism = ParallelismSection(dp_shard=1)
    cfg.training.compile = False
    cfg.training.fused_linear_ce = False
    runtime = build_runtime(cfg)
    tokenizer = build_tokenizer(cfg.data)  # the cached tokenizer; nothing is written to the dump folder
    base = resolve_model_args(cfg, tokenizer.vocab_size)
    variants = {w: width_args(base, w) for w in widths}  # every width checked before any work
    loader = build_loaders(cfg, tokenizer, dp_rank=0, dp_world_size=1, vocab_limit=base.vocab_size).loader
    probe, *batches = [loader.next_batch() for _ in range(steps + 1)]
    device = runtime.device
    result = CoordCheck(base.parametrization, base.mup_base_dim or base.dim, list(widths), [], {})
    start = time.monotonic()
    for i, (width, args) in enumerate(variants.items(), 1):
        # progress: a width takes minutes on a CPU, and the widest the longest
        log.info(f"width {width} ({i}/{len(widths)}): {steps} steps, elapsed {time.monotonic() - start:.0f} s")
        # Each width is a new model shape: compiled code of the last one (FlexAttention, which the attention
        # Z-reg runs on CUDA) would only count towards dynamo's recompile limit, past which it runs eagerly.
        torch._dynamo.reset()
        model = build_model(cfg, runtime, args).parts[0]
        optimizers = Optimizers([model], cfg.optimizer, args)
        result.rms[width] = [measure(model, probe.inputs.to(device))]
        for batch in batches:
            optimizers.set_lr(cfg.optimizer.lr)
            optimizers.zero_grad()
            with forward_context(cfg, runtime):
                loss = cross_entropy_loss(model(batch.inputs.to(device)), batch.labels.to(device),
                                          cfg.training.z_loss)
            loss.backward()
            params = list(model.parameters())
            optimizers.step(params, grad_norm(params), max_norm=0.0)
            result.rms[width].append(measure(model, probe.inputs.to(device)))
            log.info(f"  width {width}: step {len(result.rms[width]) - 1}/{steps}, loss {loss.item():.4f}, "
                     f"elapsed {time.monotonic() - start:.0f} s")
        log.info(f"width {width}: loss {loss.item():.4f} at step {steps}; logits RMS "
                 f"{result.rms[width][-1]['logits']:.4g}")
    result.names = list(result.rms[widths[0]][0])
    return result


def format_table(result: CoordCheck) -> str:
    """One row per width and step (0: at initialisation), one column per layer, then each layer's spread
    (largest over smallest RMS across the widths) after the last step."""
    names = result.names
    head = ["width", "step", *names]
    rows = [[str(w), str(s), *(f"{rms[n]:.4g}" for n in names)]
            for w in result.widths for s, rms in enumerate(result.rms[w])]
    last = len(result.rms[result.widths[0]]) - 1
    rows.append(["spread", str(last), *(f"{result.spread(n, last):.3g}x" for n in names)])
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(len(head))]
    lines = [f"coordinate check: parametrization {result.parametrization}, base width {result.base_dim}; "
             "RMS of each layer's output on a fixed batch after each step"]
    lines += ["  ".join(cell.rjust(wd) for cell, wd in zip(row, widths, strict=True)) for row in [head, *rows]]
    return "\n".join(lines)


def check_plotting() -> None:
    """UserError naming the extra when matplotlib is missing: asked before the check runs, not minutes later."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UserError(f"the coordinate-check plot needs matplotlib: {INSTALL_HINT} (or --plot '' for the "
                        "table alone)") from None


def plot(result: CoordCheck, path: str | Path) -> None:
    """PNG: one panel per layer, its RMS against the width (log-log), one line per step."""
    check_plotting()
    from matplotlib import colormaps
    from matplotlib.figure import Figure

    cols = min(4, len(result.names))
    rows = -(-len(result.names) // cols)
    fig = Figure(figsize=(3.2 * cols, 2.6 * rows), layout="constrained")
    steps = len(result.rms[result.widths[0]])
    for i, name in enumerate(result.names):
        ax = fig.add_subplot(rows, cols, i + 1)
        for s in range(steps):
            ax.plot(result.widths, [result.rms[w][s][name] for w in result.widths], marker="o", markersize=3,
                    color=colormaps["viridis"](s / max(steps - 1, 1)), label=f"step {s}")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(name, fontsize=9)
        ax.set_xlabel("width (dim)", fontsize=8)
    fig.axes[0].legend(fontsize=7)
    fig.suptitle(f"coordinate check, {result.parametrization} (base width {result.base_dim})", fontsize=10)
    fig.savefig(path, dpi=110)
