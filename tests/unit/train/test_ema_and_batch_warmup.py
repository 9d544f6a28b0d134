"""EMA against a float64 reference (one process and FSDP2), batch-size warmup's schedule, and exact resume
mid-ramp with the EMA in the checkpoint."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from dist_utils import run_distributed

from torchtitan_ext.train.batch_warmup import BatchWarmup
from torchtitan_ext.train.ema import EMA


def _updates(model: nn.Module, steps: int) -> list[dict[str, torch.Tensor]]:
    """Deterministic parameter trajectories (what optimizer steps would produce), float64."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        out.append({n: torch.randn(p.shape, generator=g, dtype=torch.float64) for n, p in model.named_parameters()})
    return out


def _reference(traj: list[dict], decay: float, every: int, start: int) -> dict[str, torch.Tensor]:
    ema = None
    for step, params in enumerate(traj, start=1):
        if step < start or (step - start) % every:
            continue
        ema = dict(params) if ema is None else {n: decay * ema[n] + (1 - decay) * params[n] for n in ema}
    return ema


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


@pytest.mark.parametrize("every, start", [(1, 0), (2, 3)])
def test_ema_equals_float64_reference(every, start):
    model = _model()
    ema = EMA([model], 0.9, every, start)
    traj = _updates(model, 12)
    for step, params in enumerate(traj, start=1):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(params[n])
        ema.update(step)
    ref = _reference(traj, 0.9, every, start)
    for n in ref:
        assert ema.shadow[n].dtype == torch.float32
        torch.testing.assert_close(ema.shadow[n].double(), ref[n], rtol=1e-6, atol=1e-6)
    # swapped in for evaluation, then the trained weights come back
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.swapped_in():
        for n, p in model.named_parameters():
            torch.testing.assert_close(p.detach(), ema.shadow[n])
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), before[n])


def _fsdp_ema(rank: int, world: int) -> dict[str, torch.Tensor]:
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    model = _model()
    traj = _updates(model, 10)
    fully_shard(model)
    ema = EMA([model], 0.8, 1, 0)
    for step, params in enumerate(traj, start=1):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.copy_(torch.distributed.tensor.distribute_tensor(params[n].float(), p.device_mesh, p.placements))
        ema.update(step)
    assert all(isinstance(t, DTensor) and t.to_local().numel() < t.numel() or t.numel() < world
               for t in ema.shadow.values())  # sharded like the parameters
    return {n: t.full_tensor() for n, t in ema.shadow.items()}


def test_ema_under_fsdp_equals_float64_reference():
    ref = _reference(_updates(_model(), 10), 0.8, 1, 0)
    for shadows in run_distributed(_fsdp_ema, 2):
        for n in ref:
            torch.testing.assert_close(shadows[n].double(), ref[n], rtol=1e-6, atol=1e-6)


def test_ema_names_do_not_depend_on_activation_checkpointing():
    """The average's keys are the plain model's parameter names, with or without AC wrappers and compile, so
    a checkpoint's EMA state loads after activation checkpointing is switched on or off."""
    from torchtitan_ext.models.args import ModelArgs
    from torchtitan_ext.models.decoder import Decoder
    from torchtitan_ext.parallel.activation_checkpoint import apply_activation_checkpointing

    args = ModelArgs(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16)
    plain = Decoder(args)
    names = [n for n, _ in plain.named_parameters()]
    wrapped = Decoder(args)
    apply_activation_checkpointing(wrapped, "full", 1)
    assert any("_checkpoint_wrapped_module" in n for n, _ in wrapped.named_parameters())
    assert list(EMA([wrapped], 0.9).shadow) == names == list(EMA([plain], 0.9).shadow)


def test_batch_warmup_schedule_by_hand():
    w = BatchWarmup(full_micro=4, start_micro=1, micro_tokens=100, warmup_tokens=1000, steps=10)
    # tokens consumed before steps 1..8: 0, 100, 200, 300, 400, 600, 800, 1100 -> 1 + 3 * consumed // 1000
    # micro-batches while consumed < 1000, then the full 4
    assert [w.micro_batches(s) for s in range(1, 9)] == [1, 1, 1, 1, 2, 2, 3, 4]
    assert w.tokens_through(8) == 1500
    assert w.effective_step(8) == pytest.approx(15 / 4)
    assert [BatchWarmup(4, 4, 100, 1000, 3).micro_batches(s) for s in (1, 2, 3)] == [4, 4, 4]
