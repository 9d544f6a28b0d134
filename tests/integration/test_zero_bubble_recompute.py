"""Zero-bubble pipeline schedules under full activation checkpointing (``parallel/pp.py`` ``Stage``): a stage's
weight-gradient pass recomputes each checkpointed block once, not once per weight, and the gradients equal
one process's. Two gloo processes, PP 2 with two stages per rank, four micro-batches."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_distributed
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder, fill_param_
from torchtitan_ext.parallel.activation_checkpoint import apply_activation_checkpointing
from torchtitan_ext.parallel.compile import clean_fqn
from torchtitan_ext.parallel.pp import build_schedule, split_stages
from torchtitan_ext.train.losses import cross_entropy_loss

ARGS = ModelArgs(vocab_size=61, dim=32, n_layers=8, n_heads=4, n_kv_heads=2, ffn_hidden=48, max_seq_len=16,
                 tie_embeddings=False)
MICRO, SEQ = 4, 16


def _model() -> Decoder:
    model = Decoder(ARGS).double()
    for name, p in model.named_parameters():
        kind, std = model.init_plan()[name]
        fill_param_(name, p.data, kind, std, seed=0)
    model.init_buffers(torch.device("cpu"))
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, ARGS.vocab_size, (MICRO, SEQ + 1), generator=torch.Generator().manual_seed(1))
    return tokens[:, :-1], tokens[:, 1:]


def _pipeline_step(rank: int, world: int, schedule: str) -> tuple[dict[str, int], dict[str, torch.Tensor]]:
    """One step of ``schedule`` over checkpointed blocks: per block, how often its forward ran (forward pass
    and recomputations), and this rank's gradients."""
    model = _model()
    apply_activation_checkpointing(model, "full", 0)
    stages = split_stages(model, rank, world, 2, schedule, [])
    runs: dict[str, int] = {}
    for _, stage in stages:
        for name, block in stage.layers.items():
            block._checkpoint_wrapped_module.register_forward_pre_hook(
                lambda *_, n=name: runs.__setitem__(n, runs.get(n, 0) + 1))
    n_stages = 2 * world
    pipe = build_schedule(stages, n_stages, torch.device("cpu"), dist.group.WORLD, schedule, MICRO,
                          cross_entropy_loss)
    inputs, labels = _batch()
    sids = [sid for sid, _ in stages]
    last = n_stages - 1 in sids
    for _ in range(2):  # the first step also infers the stages' shapes, running each stage once more
        runs.clear()
        for _, stage in stages:
            stage.zero_grad()
        pipe.step(*((inputs,) if 0 in sids else ()), target=labels if last else None, losses=[] if last else None)
    grads = {clean_fqn(n): p.grad for _, stage in stages for n, p in stage.named_parameters() if p.grad is not None}
    return runs, grads


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "InterleavedZeroBubble"])
def test_weight_pass_recomputes_each_block_once(schedule):
    ranks = run_distributed(_pipeline_step, 2, schedule, timeout=300)
    runs = {name: n for r, _ in ranks for name, n in r.items()}
    # per micro-batch: the forward and the recomputations of the input-gradient pass and the weight pass; the
    # first stage (blocks 0 and 1) runs one full backward instead of the two passes. torch's own stage
    # recomputed a block once per weight in the weight pass: 11 runs per micro-batch (9 weights in a block)
    want_runs = {str(i): (2 if i < 2 else 3) * MICRO for i in range(ARGS.n_layers)}
    assert runs == want_runs

    model = _model()  # the reference: one process, no checkpointing, the micro-batches' mean loss
    inputs, labels = _batch()
    for x, y in zip(inputs.split(1), labels.split(1), strict=True):
        (cross_entropy_loss(model(x), y) / MICRO).backward()
    want = {n: p.grad for n, p in model.named_parameters()}
    got = {n: g for _, grads in ranks for n, g in grads.items()}
    assert sorted(got) == sorted(want)
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-9, atol=1e-12, msg=lambda m, n=name: f"{n}: {m}")
