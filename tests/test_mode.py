"""MoDE: expert parallelism equals EP1 at the same data-parallel degree, balancing works, checkpoints
load across EP degrees. (Dropless routing against a per-token reference is in test_models.py.)

The Switch balancing loss is computed from each rank's own tokens, so runs are compared at the same
data-parallel degree: EP only moves the expert computation, never the losses.
"""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch
from trainer_utils import losses, read_metrics, run_trainer

from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import fill_param_
from torchtitan_ext.models.mode import MoDE

RTOL = 1e-5
MODE = ["--model.flavor", "mode_debug", "--training.steps", "5"]


@pytest.fixture(scope="module")
def ep1_runs(tmp_path_factory):
    runs = {}
    for nproc, batch in ((2, "2"), (4, "1")):
        dump = tmp_path_factory.mktemp(f"ep1_dp{nproc}")
        run_trainer(dump, nproc, *MODE, "--training.local_batch_size", batch)
        runs[nproc] = dump
    return runs


@pytest.mark.parametrize("nproc, ep", [(2, 2), (4, 4), (4, 2)])
def test_expert_parallel_matches_ep1(ep1_runs, tmp_path, nproc, ep):
    run_trainer(tmp_path, nproc, *MODE, "--training.local_batch_size", str(4 // nproc), "--parallelism.ep", str(ep))
    ref, got = read_metrics(ep1_runs[nproc]), read_metrics(tmp_path)
    assert len(got) == 5
    for r, g in zip(ref, got, strict=True):
        assert g["loss"] == pytest.approx(r["loss"], rel=RTOL)
        assert g["grad_norm"] == pytest.approx(r["grad_norm"], rel=1e-4)
        assert g["moe/layers.0/imbalance"] == r["moe/layers.0/imbalance"]  # the same routing


def test_checkpoint_saved_at_ep2_loads_at_ep1(tmp_path):
    ckpt = ["--training.steps", "8", "--checkpoint.enabled", "true", "--checkpoint.interval", "4",
            "--checkpoint.keep_latest_k", "0", "--training.local_batch_size", "2"]
    src = tmp_path / "ep2"
    run_trainer(src, 2, *MODE[:2], *ckpt, "--parallelism.ep", "2")
    dest = tmp_path / "ep1"
    shutil.copytree(src / "checkpoint" / "step-4", dest / "checkpoint" / "step-4")
    run_trainer(dest, 2, *MODE[:2], *ckpt)
    ref, got = losses(src), losses(dest)
    assert sorted(got) == [5, 6, 7, 8]
    for step in got:
        assert got[step] == pytest.approx(ref[step], rel=RTOL)


def _skewed_layer(**overrides) -> tuple[MoDE, torch.Tensor]:
    """A layer whose router sends nearly every token of the input to the same two experts."""
    args = dataclasses.replace(ModelArgs(vocab_size=8, dim=16, n_heads=2, n_experts=8, top_k=2, moe_hidden=8),
                               **overrides)
    layer = MoDE(args)
    for name, p in layer.named_parameters():
        fill_param_(name, p.data, "normal", 0.1, seed=0)
    with torch.no_grad():
        layer.router.weight[:2] += 0.15  # experts 0 and 1 score high for inputs with a positive mean
    x = torch.randn(512, 16, generator=torch.Generator().manual_seed(0)) * 0.3 + 1.0
    return layer, x


def _imbalance(layer: MoDE, x: torch.Tensor) -> float:
    counts = torch.bincount(layer.route(x)[0].flatten(), minlength=layer.n_experts).float()
    return (counts.max() / counts.mean()).item()


def test_aux_loss_reduces_imbalance():
    layer, x = _skewed_layer(aux_loss_coef=1.0, router_z_loss_coef=0.0)
    before = _imbalance(layer, x)
    # A small step: with a large one the router swings the whole skew onto another pair of experts.
    opt = torch.optim.SGD(layer.router.parameters(), lr=0.02)
    for _ in range(50):
        opt.zero_grad()
        idx, _, logits = layer.route(x)
        layer.balancing_loss(logits, idx, torch.bincount(idx.flatten(), minlength=8)).backward()
        opt.step()
    after = _imbalance(layer, x)
    assert before > 3.0 and after < 0.5 * before, (before, after)


def test_aux_free_bias_reduces_imbalance_without_gradients():
    layer, x = _skewed_layer(aux_loss_coef=0.0, router_z_loss_coef=0.0, bias_update_rate=0.01)
    before = _imbalance(layer, x)
    weights = layer.router.weight.clone()
    for _ in range(100):
        idx = layer.route(x)[0]
        layer.update_bias(torch.bincount(idx.flatten(), minlength=8).float())
    after = _imbalance(layer, x)
    assert torch.equal(layer.router.weight, weights)
    assert before > 3.0 and after < 0.5 * before, (before, after)


def test_aux_loss_gradient_reaches_the_router_through_the_layer():
    layer, x = _skewed_layer(aux_loss_coef=1.0, router_z_loss_coef=0.0)
    layer.train()
    out = layer(x[None])
    (out * 0).sum().backward()  # the main loss contributes nothing: only the balancing loss is left
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
