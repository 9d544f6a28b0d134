"""``python -m torchtitan_ext.quant.export --checkpoint DUMP_FOLDER --bits 8|6 [--output FILE]``.

Loads a job's latest checkpoint (its ``config.toml`` and ``checkpoint/``, saved under any layout) in one
process, takes the EMA weights when the job kept an EMA, quantises every matrix per row (symmetric,
``scale = absmax(row) / (2^(bits-1) - 1)``, rounded to the nearest level; 6-bit values packed 4 to 3 bytes),
keeps vectors (norms, scalars) in float32, and writes one ``torch.save`` file. It reports the file's size
against bf16 and the validation loss of the dequantised model against the original's.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from torchtitan_ext.config.loader import ConfigError


def quantize_rows(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(int levels in [-qmax, qmax] as int8, float16 per-row scales) of a 2-D float tensor."""
    qmax = 2 ** (bits - 1) - 1
    scale = (w.abs().amax(dim=1, keepdim=True).float() / qmax).clamp_min(1e-12).half()
    return torch.round(w.float() / scale.float()).clamp_(-qmax, qmax).to(torch.int8), scale


def pack(levels: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 bytes: 8-bit levels as they are; 6-bit levels offset by 31 and packed 4 per 3 bytes."""
    flat = levels.flatten()
    if bits == 8:
        return flat.view(torch.uint8).clone()
    u = (flat.to(torch.int32) + 31)
    u = torch.cat([u, u.new_zeros(-len(u) % 4)]).view(-1, 4)
    word = u[:, 0] | (u[:, 1] << 6) | (u[:, 2] << 12) | (u[:, 3] << 18)
    return torch.stack([word & 255, (word >> 8) & 255, (word >> 16) & 255], 1).flatten().to(torch.uint8)


def unpack(data: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    if bits == 8:
        return data.view(torch.int8)[:numel]
    b = data.to(torch.int32).view(-1, 3)
    word = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16)
    u = torch.stack([(word >> s) & 63 for s in (0, 6, 12, 18)], 1).flatten()[:numel]
    return (u - 31).to(torch.int8)


def export(state: dict[str, torch.Tensor], bits: int) -> dict:
    out = {"bits": bits, "tensors": {}}
    for name, t in state.items():
        t = t.detach().float().cpu()
        if t.ndim == 2:
            levels, scale = quantize_rows(t, bits)
            out["tensors"][name] = {"shape": tuple(t.shape), "data": pack(levels, bits), "scale": scale}
        else:
            out["tensors"][name] = {"shape": tuple(t.shape), "raw": t}
    return out


def dequantize(blob: dict) -> dict[str, torch.Tensor]:
    result = {}
    for name, e in blob["tensors"].items():
        if "raw" in e:
            result[name] = e["raw"]
        else:
            rows, cols = e["shape"]
            levels = unpack(e["data"], blob["bits"], rows * cols).view(rows, cols)
            result[name] = levels.float() * e["scale"].float()
    return result


def main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m torchtitan_ext.quant.export", exit_on_error=False)
    p.add_argument("--checkpoint", required=True, help="a job's dump folder (config.toml + checkpoint/)")
    p.add_argument("--bits", type=int, choices=(8, 6), default=8)
    p.add_argument("--output", default="", help="default: <checkpoint>/export-int<bits>.pt")
    try:
        args = p.parse_args(argv)
        folder = Path(args.checkpoint)
        if not (folder / "config.toml").is_file():
            raise ConfigError(f"--checkpoint {folder}: no config.toml (expected a job's dump folder)")
        from torchtitan_ext.config.loader import parse_args
        from torchtitan_ext.train.trainer import Trainer
        cfg = parse_args(["--config", str(folder / "config.toml"), "--job.dump_folder", str(folder),
                          "--checkpoint.enabled", "true", "--metrics.jsonl", "false", "--metrics.tensorboard",
                          "false", "--parallelism.dp_shard", "-1", "--parallelism.tp", "1", "--parallelism.pp",
                          "1", "--parallelism.ep", "1", "--parallelism.dp_replicate", "1", "--distill.path", "",
                          "--eval.use_ema", "false", "--eval.steps", str(max(cfg_steps(folder), 1))])
        trainer = Trainer(cfg)
        if trainer.step == 0:
            raise ConfigError(f"--checkpoint {folder}: no complete checkpoint in {trainer.checkpointer.folder}")
        model = trainer.model_parts[0]
        original = trainer.evaluate()
        weights = "trained"
        if trainer.ema is not None and trainer.ema.started:
            weights = "EMA"
            with torch.no_grad():
                for n, p_ in trainer.ema.params.items():
                    p_.copy_(trainer.ema.shadow[n])
            original = trainer.evaluate()
        state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
        blob = export(state, args.bits)
        out = Path(args.output or folder / f"export-int{args.bits}.pt")
        torch.save(blob, out)
        deq = dequantize(torch.load(out, weights_only=False))
        with torch.no_grad():
            for k, p_ in model.state_dict().items():
                p_.copy_(deq[k].to(p_.dtype))
        quantized = trainer.evaluate()
        bf16 = sum(2 * t.numel() for t in state.values())
        size = out.stat().st_size
        trainer.log(f"export: {weights} weights of step {trainer.step}, {args.bits}-bit per-row -> {out}: "
                    f"{size:,} bytes ({size / bf16:.3f} of bf16's {bf16:,})")
        if original is not None:
            trainer.log(f"validation loss: original {original:.4f}, dequantised {quantized:.4f} "
                        f"(+{quantized - original:.4f})")
        trainer.metrics.close()
    except (ConfigError, argparse.ArgumentError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


def cfg_steps(folder: Path) -> int:
    """The job's own eval.steps (validation batches), read from its config.toml."""
    import tomllib
    try:
        return int(tomllib.loads((folder / "config.toml").read_text()).get("eval", {}).get("steps", 10))
    except (OSError, ValueError):
        return 10


if __name__ == "__main__":
    code = main(sys.argv[1:])
    import torch.distributed as dist
    if dist.is_initialized():
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
