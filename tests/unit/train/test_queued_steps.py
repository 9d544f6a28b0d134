"""Steps queued without host reads: fused AdamW clips and skips non-finite steps on the device exactly as
the host path does, and reading each step's loss one step late changes nothing a run computes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from trainer_utils import TINY

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.train.trainer import Trainer


def _steps_with_a_poisoned_third(tmp_path, fused: str) -> tuple[list[tuple[float, float]], list[torch.Tensor]]:
    """Five steps, clipping active (max_norm 0.05), step 3's gradients made infinite: (loss, norm) per step
    and the output weight after each."""
    cfg = parse_args([*TINY, "--job.dump_folder", str(tmp_path / fused), "--optimizer.fused", fused,
                      "--training.max_norm", "0.05"])
    os.environ.pop("RANK", None)
    trainer = Trainer(cfg)
    try:
        assert trainer.optimizers.skips_on_device == (fused == "true")
        weight = trainer.model_parts[0].output.weight
        weight.register_hook(lambda g: g * float("inf") if trainer.step == 3 else g)
        scalars, weights = [], []
        for step in range(1, 6):
            trainer.step = step
            loss, norm, _ = trainer.train_step()
            scalars.append((loss, norm))
            weights.append(weight.detach().clone())
        return scalars, weights
    finally:
        trainer.metrics.close()
        dist.destroy_process_group()


def test_device_clip_and_skip_equal_the_host_path(tmp_path):
    device_path = _steps_with_a_poisoned_third(tmp_path, "true")
    host_path = _steps_with_a_poisoned_third(tmp_path, "false")
    for (scalars, weights) in (device_path, host_path):
        assert scalars[0][1] > 0.05 * 10  # clipping scales the update by more than 10x
        assert not torch.isfinite(torch.tensor(scalars[2][1]))
        assert torch.equal(weights[2], weights[1])  # the non-finite step left the weights as they were
        assert not torch.equal(weights[3], weights[2])
    for (d_loss, d_norm), (h_loss, h_norm) in zip(device_path[0], host_path[0], strict=True):
        assert d_loss == pytest.approx(h_loss, rel=1e-5)
        assert d_norm == pytest.approx(h_norm, rel=1e-5) or d_norm != d_norm and h_norm != h_norm
    for d, h in zip(device_path[1], host_path[1], strict=True):
        torch.testing.assert_close(d, h, rtol=1e-5, atol=1e-7)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_settling_a_step_does_not_wait_for_the_work_queued_after_it(tmp_path):
    """The one-step-late read waits for its own step only: with half a second of GPU work queued after step
    1, settling step 1 returns while that work still runs, with the loss and norm a direct read gives."""
    cfg = parse_args([*TINY, "--job.dump_folder", str(tmp_path)])
    os.environ.pop("RANK", None)
    trainer = Trainer(cfg)
    try:
        trainer.step = 1
        queued = trainer.queue_step()
        torch.cuda.synchronize()
        expected = queued.scalars.tolist()
        trainer.step = 2
        second = trainer.queue_step()
        torch.cuda._sleep(2_000_000_000)  # about a second of one thread spinning, behind step 2
        loss, norm, _ = trainer.settle(queued)
        assert not torch.cuda.current_stream().query(), "settle waited for the work queued after its step"
        assert [loss, norm] == expected
        assert trainer.settle(second)[0] > 0
    finally:
        trainer.metrics.close()
        dist.destroy_process_group()
