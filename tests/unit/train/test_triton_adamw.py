"""``TritonAdamW`` (``train/triton_adamw.py``): on CPU under TRITON_INTERPRET=1 its kernel steps like torch's
AdamW (updates and moments within float32 rounding, over steps with clipping, a skipped non-finite step and
two param groups), its state dict continues in torch's AdamW exactly, and the config key picks it or fails
in one line; on a GPU the same against torch's fused kernel."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

TESTS = Path(__file__).resolve().parent
LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.1
SHAPES = [(64, 48), (3000,), (7, 5)]  # above and below min_numel (256), one not a multiple of the block


def make_params(device: str) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(*s, generator=gen).to(device)) for s in SHAPES]


def run_steps(opt: torch.optim.AdamW, params: list[torch.Tensor], steps: range) -> None:
    """Steps with gradients seeded by the step: step 2 clipped by 4, step 3 skipped as non-finite."""
    for step in steps:
        gen = torch.Generator().manual_seed(100 + step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen).to(p.device) * (1 + step)
        opt.grad_scale = torch.tensor(4.0, device=params[0].device) if step == 2 else None
        opt.found_inf = torch.tensor(float(step == 3), device=params[0].device)
        opt.step()
    opt.grad_scale = opt.found_inf = None


def build(kind: str, params: list[torch.Tensor], device: str) -> torch.optim.AdamW:
    groups = [{"params": params[:2], "weight_decay": DECAY}, {"params": params[2:], "weight_decay": 0.0}]
    if kind == "triton":
        from torchtitan_ext.train.triton_adamw import TritonAdamW

        return TritonAdamW(groups, lr=LR, betas=BETAS, eps=EPS, min_numel=256, kernel_on_cpu=device == "cpu")
    return torch.optim.AdamW(groups, lr=LR, betas=BETAS, eps=EPS, fused=True)


def check_steps(device: str = "cpu") -> None:
    """Run in a fresh process with TRITON_INTERPRET=1 on CPU (triton reads it when kernels are decorated)."""
    start = make_params(device)
    mine, ref = make_params(device), make_params(device)
    opt_mine, opt_ref = build("triton", mine, device), build("torch", ref, device)
    run_steps(opt_mine, mine, range(1, 2))
    assert [opt_mine._streams(p) for p in mine] == [True, True, False]  # the kernel takes the large ones
    run_steps(opt_mine, mine, range(2, 6))
    run_steps(opt_ref, ref, range(1, 6))
    for p0, p, q in zip(start, mine, ref, strict=True):
        assert not torch.equal(p, p0)
        # the updates (about 0.05) within a few float32 ulps of the weights (|w| < 5: ulp <= 4.8e-7)
        torch.testing.assert_close(p - p0, q - p0, rtol=1e-5, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):  # within float32 rounding of the moments' scale
            got, want = opt_mine.state[p][key], opt_ref.state[q][key]
            assert (got - want).abs().max() <= 1e-6 * want.abs().max(), key
        assert opt_mine.state[p]["step"].item() == opt_ref.state[q]["step"].item() == 4  # step 3 skipped
    # the skipped step changed nothing: rerun steps 1-3 and compare with steps 1-2
    again = make_params(device)
    opt_again = build("triton", again, device)
    run_steps(opt_again, again, range(1, 3))
    before = [p.detach().clone() for p in again] + [opt_again.state[p]["exp_avg"].clone() for p in again]
    run_steps(opt_again, again, range(3, 4))
    after = [p.detach() for p in again] + [opt_again.state[p]["exp_avg"] for p in again]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    # the state dict moves to torch's AdamW and continues exactly as the kernel continues
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in mine]
    opt_resumed = build("torch", resumed, device)
    opt_resumed.load_state_dict(copy.deepcopy(opt_mine.state_dict()))  # as saved: no tensor shared
    run_steps(opt_mine, mine, range(6, 8))
    run_steps(opt_resumed, resumed, range(6, 8))
    for p, q in zip(mine, resumed, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_kernel_steps_like_torch_adamw_on_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", "import test_triton_adamw as t; t.check_steps()"], cwd=TESTS,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]


def test_config_picks_the_kernel_or_fails_in_one_line():
    from torchtitan_ext.config.job_config import OptimizerSection
    from torchtitan_ext.errors import ConfigError
    from torchtitan_ext.train.optim import adamw

    groups = [{"params": [torch.nn.Parameter(torch.ones(3))]}]
    assert type(adamw(groups, OptimizerSection())) is torch.optim.AdamW  # auto: CPU parameters
    assert type(adamw(groups, OptimizerSection(adamw_kernel="triton"))).__name__ == "TritonAdamW"
    if torch.cuda.is_available():
        on_gpu = [{"params": [torch.nn.Parameter(torch.ones(3, device="cuda"))]}]
        assert type(adamw(on_gpu, OptimizerSection())).__name__ == "TritonAdamW"
    with pytest.raises(ConfigError, match="optimizer.adamw_kernel = 'triton' needs optimizer.fused = true"):
        adamw(groups, OptimizerSection(adamw_kernel="triton", fused=False))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_kernel_steps_like_torch_fused_adamw():
    check_steps("cuda")


def _fsdp_steps(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Three steps of a sharded model (uneven shards) with the kernel on its local shards, beside an unsharded
    copy stepped by torch's AdamW; every rank sees the same batch, so the averaged gradients are the copy's."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from torchtitan_ext.train.triton_adamw import TritonAdamW

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(24, 41), torch.nn.Tanh(), torch.nn.Linear(41, 5))
    reference = copy.deepcopy(model)
    fully_shard(model)
    opt = TritonAdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY, min_numel=16,
                      kernel_on_cpu=True)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=DECAY)
    for step in range(3):
        x = torch.randn(8, 24, generator=torch.Generator().manual_seed(step))
        for net, o in ((model, opt), (reference, opt_ref)):
            net(x).square().mean().backward()
            if o is opt:
                o.grad_scale, o.found_inf = torch.tensor(2.0), torch.tensor(0.0)
                assert all(isinstance(p, DTensor) for p in net.parameters())
                # the kernel takes every shard but the last bias's (3 or 2 elements, below min_numel)
                assert [o._streams(p) for p in net.parameters()] == [True, True, True, False]
            else:
                for p in net.parameters():
                    p.grad /= 2.0
            o.step()
            o.zero_grad()
    return {n: (p.full_tensor(), dict(reference.named_parameters())[n].detach())
            for n, p in model.named_parameters()}


def test_kernel_steps_fsdp_shards_like_torch_adamw_on_the_interpreter(monkeypatch):
    from dist_utils import run_distributed

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the spawned ranks import triton afresh
    for result in run_distributed(_fsdp_steps, 2):
        for name, (got, want) in result.items():
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_unsupported_options_fail_at_construction():
    from torchtitan_ext.train.triton_adamw import TritonAdamW

    for option in ("amsgrad", "maximize"):
        with pytest.raises(ValueError, match="amsgrad and maximize are not supported"):
            TritonAdamW([torch.nn.Parameter(torch.ones(3))], **{option: True})


def test_summary_names_the_kernel():
    from torchtitan_ext.config.job_config import OptimizerSection
    from torchtitan_ext.train.optim import Optimizers

    model = torch.nn.Linear(4, 3)
    assert Optimizers([model], OptimizerSection()).summary() == "optimizer: AdamW (torch's fused kernel)"
    assert Optimizers([model], OptimizerSection(fused=False)).summary() == "optimizer: AdamW (torch's foreach kernel)"
    assert Optimizers([model], OptimizerSection(adamw_kernel="triton")).summary() == (
        "optimizer: TritonAdamW (Triton kernel on 0 of 2 parameter tensors, the local ones of >= 1,048,576 "
        "elements)")  # CPU parameters: torch's kernel steps them


def test_moments_the_kernel_cannot_stream_go_to_torch():
    """A loaded state whose moments are not contiguous float32 (a transposed copy here) stays on torch's kernel."""
    from torchtitan_ext.train.triton_adamw import TritonAdamW

    p = torch.nn.Parameter(torch.ones(32, 16))
    p.grad = torch.ones(32, 16)
    opt = TritonAdamW([p], min_numel=1, kernel_on_cpu=True)
    assert opt._streams(p)
    opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros(16, 32).t(), "exp_avg_sq": torch.zeros(32, 16)}
    assert not opt._streams(p)
