"""What the float8 tests share: whether torchao's float8 imports here, an initialised decoder, a tiny decoder
converted to emulated float8 the trainer's way, and short training loops."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from torchtitan_ext.config.job_config import Float8Section
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder, fill_param_
from torchtitan_ext.quant import float8 as f8

try:
    import torchao.float8  # noqa: F401

    TORCHAO_ERROR = None
except Exception as e:  # ImportError, or a torchao built for another torch failing at import
    TORCHAO_ERROR = f"torchao.float8 does not import here: {type(e).__name__}: {e}"

needs_torchao = pytest.mark.skipif(TORCHAO_ERROR is not None, reason=str(TORCHAO_ERROR))


def float8_gpu_skip_reason() -> str | None:
    """Why real float8 GEMMs cannot run here (no CUDA, a GPU below compute capability 8.9, no torchao), or None."""
    if not torch.cuda.is_available():
        return "needs CUDA"
    if torch.cuda.get_device_capability() < f8.MIN_CAPABILITY:
        return f"needs compute capability >= 8.9, {torch.cuda.get_device_name()} is below"
    return TORCHAO_ERROR


def init_decoder(model: Decoder, seed: int, device: str = "cpu") -> Decoder:
    """``model`` with the trainer's initialisation (its init plan, seeded) and its buffers on ``device``."""
    plan = model.init_plan()
    for name, p in model.named_parameters():
        fill_param_(name, p.data, *plan[name], seed)
    model.init_buffers(torch.device(device))
    return model


def train_losses(model: nn.Module, tokens: torch.Tensor, steps: int, lr: float = 3e-3) -> list[float]:
    """The next-token losses of ``steps`` AdamW steps on the one batch ``tokens``."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


TINY = ModelArgs(vocab_size=128, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32)


def tiny_float8(cfg: Float8Section, parallelize=None) -> tuple[Decoder, list[str]]:
    """A TINY decoder in the trainer's order: built on meta, converted by ``cfg`` (emulated float8), parallelized,
    materialised and initialised; and the names of the converted linears."""
    from torchtitan_ext.parallel.init import materialize_and_init

    with torch.device("meta"):
        model = Decoder(TINY)
    plan = model.init_plan()
    converted = f8.convert_to_float8(model, cfg, emulate=True, log=lambda s: None)
    if parallelize is not None:
        parallelize(model)
    materialize_and_init(model, torch.device("cpu"), seed=0, plan=plan)
    model.init_buffers(torch.device("cpu"))
    return model, converted


def tiny_tokens() -> torch.Tensor:
    """4 sequences of 33 TINY token ids (32 inputs and their next tokens), always the same."""
    return torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))


def train_accumulated(model: nn.Module, batches: list[torch.Tensor], steps: int) -> torch.Tensor:
    """AdamW steps, gradients accumulated over ``batches`` (one micro-batch each); mean loss per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for _ in range(steps):
        total = 0.0
        for tokens in batches:
            logits = model(tokens[:, :-1])
            loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()) / len(batches)
            loss.backward()
            total += loss.detach()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return torch.stack(losses)
