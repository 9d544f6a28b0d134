"""Weight export in 8 or 6 bits: every matrix quantised per row (symmetric, ``scale = absmax(row) /
(2^(bits-1) - 1)``, rounded to the nearest level; 6-bit values packed 4 to 3 bytes), vectors (norms, scalars)
kept in float32, one ``torch.save`` file. The command line is ``tools/quant_export.py``."""

from __future__ import annotations

import torch


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
