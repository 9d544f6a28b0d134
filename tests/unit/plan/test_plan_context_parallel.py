"""The planner's context parallelism (``parallelism.cp``): per-rank activations of seq_len / cp tokens, FSDP
sharded over dp_shard x cp, the ring's and the all-to-all's bytes and buffers, the ring's transfers hidden
behind attention where it outlasts them, the one-line refusals; the long-sequence memory of one GPU."""

from __future__ import annotations

import pytest

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.plan.__main__ import main
from torchtitan_ext.plan.estimate import GIB, GRADS, PARAMS, plan
from torchtitan_ext.plan.search import Hardware, search, step_time

TINY = ["--model.flavor", "debug", "--data.tokenizer", "byte", "--model.dim", "64", "--model.n_layers", "2",
        "--model.n_heads", "4", "--model.n_kv_heads", "2", "--model.ffn_hidden", "128",
        "--training.seq_len", "64", "--training.local_batch_size", "2"]
# the 1b shape of issue 63's one-GPU rows: compiled, op-level selective AC, byte tokenizer, batch 1
LONG_1B = ["--config", "train_configs/debug.toml", "--data.tokenizer", "byte", "--training.compile", "true",
           "--model.flavor", "1b", "--training.local_batch_size", "1",
           "--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_every", "0"]
H200 = 139 * GIB


def _plan(argv: list[str], world: int):
    return plan(parse_args(argv), world)


@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_cp_cuts_the_sequence_and_shards_fsdp_over_dp_shard_x_cp(ac):
    """CP 2 on 2 ranks holds what one rank holds for half the sequence (activations, logits) and the FSDP 2
    parameter shards; the ring adds its K/V blocks in flight."""
    argv = [*TINY, "--activation_checkpoint.mode", ac, "--activation_checkpoint.selective_every", "0"]
    cp2 = _plan([*argv, "--parallelism.cp", "2"], 2)
    half = _plan([*argv, "--training.seq_len", "32"], 1)
    fsdp2 = _plan(argv, 2)
    assert cp2.memory["activations"] == pytest.approx(half.memory["activations"])
    assert cp2.memory["logits / cross-entropy"] == pytest.approx(half.memory["logits / cross-entropy"])
    for key in (PARAMS, GRADS, "optimizer state", "unsharded params + grads (bf16 / reduce dtype)"):
        assert cp2.memory[key] == pytest.approx(fsdp2.memory[key]), key
    assert cp2.comm["dp_shard reduce-scatter"] == pytest.approx(fsdp2.comm["dp_shard reduce-scatter"])
    # ring: the block in use and the next, each K and V with its gradient (bf16), and dQ's fp32 accumulator
    tokens, q, kv = 2 * 32, 4 * 16, 2 * 2 * 16
    assert cp2.memory["cp ring buffers (one layer's backward)"] == pytest.approx(tokens * (4 * 2 * kv + 4 * q))
    assert (cp2.cp, cp2.cp_scheme, cp2.dims.dp_shard) == (2, "ring", 1)


def test_ring_and_alltoall_traffic():
    """Per micro-batch, per layer: the ring sends cp - 1 K/V blocks per forward pass (again for a recomputed
    block), cp - 1 K/V and cp dK / dV blocks per backward; the all-to-all scheme (cp - 1) / cp of q, k, v and the
    output per pass, its K/V heads repeated up to a multiple of cp."""
    tokens, layers, bf16 = 2 * 64 // 4, 2, 2
    kv = 2 * 2 * 16 * tokens * bf16  # 2 kv heads of 16 per rank
    q = 4 * 16 * tokens * bf16
    for ac, forwards in (("none", 1), ("selective", 1), ("full", 2)):
        argv = [*TINY, "--parallelism.cp", "4", "--activation_checkpoint.mode", ac,
                "--activation_checkpoint.selective_every", "0"]
        ring = _plan(argv, 4).comm["cp ring send / recv of K/V"]
        assert ring == pytest.approx(layers * (forwards * 3 * kv + 3 * kv + 4 * kv)), ac
        a2a = _plan([*argv, "--parallelism.cp_scheme", "alltoall"], 4).comm["cp alltoall all-to-all of q, k, v, out"]
        assert a2a == pytest.approx(layers * (forwards + 1) * (2 * q + 2 * kv) * 3 / 4), ac  # 2 kv heads -> 4
    # the all-to-all keeps attention's output in both layouts: one more q-sized tensor per layer and token
    plain = _plan([*TINY, "--parallelism.cp", "2"], 2)
    a2a = _plan([*TINY, "--parallelism.cp", "2", "--parallelism.cp_scheme", "alltoall"], 2)
    assert a2a.activations_no_ac - plain.activations_no_ac == pytest.approx(layers * 2 * 32 * 4 * 16 * bf16)


def test_ring_transfers_hide_behind_long_attention_only():
    """The ring's exposed time is what its transfers take beyond (cp - 1) / cp of the attention: none for the 8B
    at 128k over NVLink, some for a 1,024-token chunk per rank across nodes; the all-to-all's is all of its
    bytes / bandwidth."""
    long = parse_args(["--model.flavor", "llama3_8b", "--data.tokenizer", "byte", "--training.seq_len", "131072",
                       "--training.local_batch_size", "1", "--parallelism.cp", "8", "--activation_checkpoint.mode",
                       "full"])
    p = plan(long, 8)
    assert p.comm["cp ring send / recv of K/V"] > 0 and step_time(long, p, Hardware()).comm["cp"] == 0
    across = Hardware(gpus_per_node=1)
    short = parse_args(["--model.flavor", "llama3_8b", "--data.tokenizer", "byte", "--training.seq_len", "8192",
                        "--training.local_batch_size", "1", "--parallelism.cp", "8"])
    p = plan(short, 8)
    raw = p.comm["cp ring send / recv of K/V"] / across.inter_node_bw
    exposed = step_time(short, p, across).comm["cp"]
    assert 0 < exposed < raw
    a2a = parse_args(["--model.flavor", "llama3_8b", "--data.tokenizer", "byte", "--training.seq_len", "8192",
                      "--training.local_batch_size", "1", "--parallelism.cp", "8", "--parallelism.cp_scheme",
                      "alltoall"])
    p = plan(a2a, 8)
    assert step_time(a2a, p, across).comm["cp"] == pytest.approx(
        p.comm["cp alltoall all-to-all of q, k, v, out"] / across.inter_node_bw)


@pytest.mark.parametrize("argv,expect", [
    (["--gpus", "4", "--parallelism.cp", "3"], "parallelism.cp = 3 must divide the world size 4"),
    (["--gpus", "4", "--parallelism.cp", "4", "--training.seq_len", "36"],
     "training.seq_len = 36 must be divisible by 2 x parallelism.cp = 8 (context parallelism cuts each sequence "
     "into 2 x cp equal chunks)"),
    (["--gpus", "8", "--parallelism.cp", "2", "--parallelism.tp", "4", "--training.seq_len", "36"],
     "training.seq_len = 36 must be divisible by 2 x parallelism.cp x parallelism.tp = 16 (each of the 2 x cp "
     "chunks is split over the TP ranks)"),
    (["--gpus", "8", "--parallelism.cp", "8", "--parallelism.cp_scheme", "alltoall"],
     "parallelism.cp_scheme = 'alltoall' needs the attention heads per TP rank (4) divisible by parallelism.cp = 8"),
    (["--gpus", "4", "--parallelism.cp", "2", "--parallelism.dp_mode", "ddp"], "parallelism.dp_mode = 'ddp' with"),
])
def test_cp_bad_layouts_are_one_line(argv, expect, capsys):
    assert main([*TINY, *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err


def test_cli_reports_the_cp_layout(capsys):
    assert main([*TINY, "--gpus", "8", "--parallelism.cp", "2"]) == 0
    out = capsys.readouterr().out
    assert ("world 8 = pp 1 x dp_replicate 1 x dp_shard 4 (ep 1) x cp 2 (ring) x tp 1; data parallel 4, FSDP over "
            "dp_shard x cp = 8") in out
    assert "cp ring send / recv of K/V" in out and "cp ring buffers" in out


def test_search_chooses_cp_where_heads_allow_alltoall():
    """Every CP layout the search returns cuts the sequence evenly, and alltoall appears only where the heads per
    TP rank divide by cp (4 heads: cp 2 and 4, not 8)."""
    cfg = parse_args([*TINY, "--training.seq_len", "65536", "--training.local_batch_size", "1"])
    result = search(cfg, 8, 80 * GIB)
    schemes = {(c.plan.cp, c.plan.dims.tp, c.plan.cp_scheme) for c in result.ranked}
    assert {(2, 1, "alltoall"), (4, 1, "alltoall"), (8, 1, "ring")} <= schemes
    assert (8, 1, "alltoall") not in schemes
    for cp, tp, scheme in schemes:
        assert 65536 % (2 * cp * tp) == 0 and (scheme == "ring" or 4 // tp % cp == 0)


def test_long_sequence_memory_is_linear_in_tokens():
    """Attention on a fused kernel saves no score matrix: at a fixed token count per step the predicted peak
    does not depend on how the tokens are cut into sequences (issue 63 measured 37.4 GiB for 16k x 2 and for 32k
    x 1), and every activation term doubles with the sequence."""
    short = _plan([*LONG_1B, "--training.seq_len", "16384", "--training.local_batch_size", "2"], 1)
    long = _plan([*LONG_1B, "--training.seq_len", "32768"], 1)
    assert long.peak == pytest.approx(short.peak)
    for ac in ("selective", "full"):
        at = {s: _plan([*LONG_1B, "--training.seq_len", str(s), "--activation_checkpoint.mode", ac], 1)
              for s in (32768, 65536)}
        for key in ("activations", "logits / cross-entropy"):
            assert at[65536].memory[key] == pytest.approx(2 * at[32768].memory[key]), (ac, key)


def test_1b_at_128k_on_one_h200_gets_an_ac_that_fits():
    """The search's choice for the 1b shape at 131,072 tokens on one H200 fits it; without checkpointing it would
    not."""
    cfg = parse_args([*LONG_1B, "--training.seq_len", "131072"])
    none = plan(parse_args([*LONG_1B, "--training.seq_len", "131072", "--activation_checkpoint.mode", "none"]), 1)
    assert none.peak > H200
    best = search(cfg, 1, H200).ranked[0]
    assert best.cfg.activation_checkpoint.mode in ("selective", "full") and best.plan.peak <= H200


def test_search_counts_cp_ranks_out_of_the_data_parallel_degree():
    """One sequence per step on 8 GPUs: only layouts with one data-parallel rank take it, CP 8 among them (the cp
    ranks of a data-parallel rank read the same batch)."""
    cfg = parse_args([*TINY, "--training.seq_len", "65536", "--training.local_batch_size", "1",
                      "--training.global_batch_size", "1"])
    result = search(cfg, 8, 80 * GIB)
    assert result.ranked and all(c.plan.dims.dp == 1 for c in result.ranked)
    assert any(c.plan.cp == 8 for c in result.ranked)
