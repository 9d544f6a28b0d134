"""Context parallelism in real gloo processes against one process, in float64: the same tiny model trained
3 steps on the same batches, the CP ranks each holding their head-tail part of every sequence (ring and
all-to-all; GQA and MQA; causal, document and tree masks). Losses and every gradient must agree."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from dist_utils import run_distributed

from torchtitan_ext.data.documents import document_batch
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.ops.visibility import tree_visibility
from torchtitan_ext.parallel.context_parallel import apply_cp, shard_batch, token_share

EOT, SEQ, STEPS, LR = 1, 32, 3, 0.05
ARGS = ModelArgs(vocab_size=50, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=SEQ,
                 qk_norm=True, rope_fraction=0.5)
TREE = ([-1, 0, 1, 0, 3, -1], [6, 5, 6, 4, 7, 4])  # two roots; node 0 has two children: 32 tokens


def _model(args: ModelArgs) -> Decoder:
    torch.manual_seed(0)
    model = Decoder(args).double()
    model.init_buffers(torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 1.0))
    return model


def _batch(step: int, mask: str) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """Two sequences of SEQ tokens, their labels (some ignored under the tree mask) and model kwargs."""
    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(2, 50, (2, SEQ), generator=g)
    labels = torch.randint(2, 50, (2, SEQ), generator=g)
    if mask == "document":
        tokens[0, [5, 19]] = EOT
        tokens[1, [12]] = EOT
        vis, pos = document_batch(tokens, EOT)
        return tokens, labels, {"visibility": vis, "positions": pos}
    if mask == "tree":
        labels[:, :6] = -100  # the root prompt is not scored: the CP ranks score different counts
        start, limit = tree_visibility(*TREE)
        return tokens, labels, {"visibility": (start.expand(2, SEQ), limit.expand(2, SEQ))}
    return tokens, labels, {}


def _train(model: Decoder, mask: str, shard=None) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """STEPS of plain SGD; ``shard`` (cp, rank, group) runs this rank's part and averages over the group."""
    losses, grads = [], []
    for step in range(STEPS):
        tokens, labels, kwargs = _batch(step, mask)
        if shard is not None:
            tokens, labels, kwargs = shard_batch(tokens, labels, kwargs, shard[0], shard[1])
        logits = model(tokens, **kwargs)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten())
        if shard is not None:
            loss = loss * token_share(labels, shard[2]).to(loss.dtype)
        model.zero_grad()
        loss.backward()
        loss = loss.detach()
        step_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        if shard is not None:
            dist.all_reduce(loss)
            loss /= shard[0]
            for g in step_grads.values():
                dist.all_reduce(g)
                g /= shard[0]
        with torch.no_grad():
            for n, p in model.named_parameters():
                p -= LR * step_grads[n]
        losses.append(loss.item())
        grads.append(step_grads)
    return losses, grads


def _compare(rank: int, world: int, cases: list[tuple[str, str, int]]) -> list[tuple]:
    """Every case (scheme, mask, kv heads): (losses, gradients) of the CP run and of one process."""
    results = []
    for scheme, mask, kv_heads in cases:
        args = dataclasses.replace(ARGS, n_kv_heads=kv_heads)
        reference = _model(args)
        sharded = copy.deepcopy(reference)
        apply_cp(sharded, dist.group.WORLD, scheme)
        results.append((_train(sharded, mask, (world, rank, dist.group.WORLD)), _train(reference, mask)))
    return results


def _check(cases, results) -> None:
    for rank_results in results:
        for (scheme, mask, kv), ((losses, grads), (ref_losses, ref_grads)) in zip(cases, rank_results, strict=True):
            where = f"{scheme}, {mask}, kv_heads {kv}"
            torch.testing.assert_close(losses, ref_losses, atol=1e-10, rtol=1e-10, msg=where)
            for step, (g, ref) in enumerate(zip(grads, ref_grads, strict=True)):
                for name in ref:
                    torch.testing.assert_close(g[name], ref[name], atol=1e-10, rtol=1e-8,
                                               msg=f"{where}, step {step}, {name}")


CP2_CASES = [(scheme, mask, 2) for scheme in ("ring", "alltoall") for mask in ("causal", "document", "tree")] + [
    ("alltoall", "causal", 1), ("ring", "document", 1)]  # MQA: one K/V head, repeated up to cp for all-to-all


def test_cp2_equals_one_process_float64():
    _check(CP2_CASES, run_distributed(_compare, 2, CP2_CASES))


@pytest.mark.slow
def test_cp4_equals_one_process_float64():
    cases = [(scheme, mask, 2) for scheme in ("ring", "alltoall") for mask in ("causal", "document", "tree")]
    _check(cases, run_distributed(_compare, 4, cases))
