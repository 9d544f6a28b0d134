"""The layout search (``plan/search.py``): it returns only layouts the trainer's own checks accept and the
memory model fits; its step-time rules; rankings with a known answer; its command line's one-line errors."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch
from test_measured_rows import EIGHT_B, F8_FSDP

from torchtitan_ext.config.loader import parse_args
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.models.flavors import resolve_model_args
from torchtitan_ext.parallel.dims import ParallelDims
from torchtitan_ext.parallel.ep import check_ep
from torchtitan_ext.parallel.pp import check_schedule, split_stages
from torchtitan_ext.parallel.tp import check_tp
from torchtitan_ext.plan.__main__ import main
from torchtitan_ext.plan.estimate import GIB, plan
from torchtitan_ext.plan.search import FSDP_EXPOSED, PP_PASS_OVERHEAD, Hardware, search, step_time
from torchtitan_ext.train.build import plan_batches

DENSE_1B = ["--model.flavor", "1b", "--data.tokenizer", "byte", "--training.seq_len", "2048",
            "--training.local_batch_size", "16"]
# llama3_8b at 64k tokens per sequence: one sequence's logits and activations outgrow a GPU under FSDP alone
LONG_8B = ["--model.flavor", "llama3_8b", "--data.tokenizer", "byte", "--training.seq_len", "65536",
           "--training.local_batch_size", "1", "--training.global_batch_size", "8"]
MODE_TINY = ["--model.flavor", "mode_debug", "--data.tokenizer", "byte", "--training.seq_len", "256",
             "--training.local_batch_size", "8"]


@pytest.fixture(scope="module")
def searches() -> dict[str, tuple]:
    """(the config's arguments, GPUs, budget in bytes, result) of the searches the tests read, each run once."""
    out = {}
    for name, argv, gpus, gib, hw in [
        ("dense 1b, 8 GPUs", DENSE_1B, 8, 80, Hardware()),
        ("8B at 64k, 8 GPUs", LONG_8B, 8, 80, Hardware()),
        ("8B at 64k, 8 GPUs, 4 per node", LONG_8B, 8, 80, Hardware(gpus_per_node=4)),
        ("MoDE, 8 GPUs", MODE_TINY, 8, 80, Hardware()),
    ]:
        out[name] = (argv, gpus, gib * GIB, search(parse_args(argv), gpus, gib * GIB, hw))
    return out


def test_every_layout_passes_the_trainers_checks_and_fits(searches):
    """Each returned layout is rebuilt from its own overrides and put through what the trainer runs at start
    (the mesh degrees, TP / EP divisibility, the batch plan, the pipeline schedule, and the split of a real
    meta-device model into its stages); its planned peak fits the budget."""
    for name, (argv, gpus, budget, result) in searches.items():
        assert result.ranked, name
        for cand in result.ranked:
            c = parse_args([*argv, *" ".join(cand.overrides()).split()])
            cp = c.parallelism.cp  # the other degrees fill world / cp ranks; FSDP shards over dp_shard x cp
            dims = ParallelDims.from_config(dataclasses.replace(c.parallelism, cp=1), gpus // cp)
            args = resolve_model_args(c, 257)
            assert c.training.seq_len % (2 * cp * dims.tp) == 0
            if c.parallelism.cp_scheme == "alltoall":
                assert cp > 1 and args.n_heads // dims.tp % cp == 0
            if dims.tp > 1:
                check_tp(args, dims.tp)
                assert c.training.seq_len % dims.tp == 0
            if dims.ep > 1:
                check_ep(args.n_experts, dims.ep, dims.tp)
            plan_batches(c, dims)
            if dims.pp > 1:
                p = c.parallelism
                check_schedule(p.pp_schedule, p.pp_virtual_stages, p.pp_microbatches, dims.pp,
                               c.training.local_batch_size, c.activation_checkpoint.mode == "selective")
                if args.n_layers <= 8:  # a real split for the small models
                    with torch.device("meta"):
                        model = Decoder(args)
                    for rank in range(dims.pp):
                        assert split_stages(model, rank, dims.pp, p.pp_virtual_stages, p.pp_schedule, [])
            assert plan(c, gpus).peak <= budget, (name, cand.layout)
            assert cand.plan.peak == pytest.approx(plan(c, gpus).peak)


def test_mode_layouts_borrow_ep_from_dp_shard(searches):
    """EP takes ranks of dp_shard, divides the experts over ep x tp, and layouts that break that are refused."""
    _, _, _, result = searches["MoDE, 8 GPUs"]
    assert result.refused > 0
    eps = {c.plan.dims.ep for c in result.ranked}
    assert eps - {1}, eps  # expert parallelism is among the layouts that fit
    for c in result.ranked:
        d = c.plan.dims
        assert d.dp_shard % d.ep == 0 and 8 % (d.ep * d.tp) == 0


def test_small_dense_model_on_one_node_is_data_parallel(searches):
    """1b on 8 GPUs of one node with 16 x 2048 tokens per GPU: the model fits on each GPU, so data parallelism
    alone wins (no TP collectives on the critical path, no pipeline bubble); FSDP 8 is ahead of every TP or PP
    layout."""
    _, _, _, result = searches["dense 1b, 8 GPUs"]
    best = result.ranked[0].plan.dims
    assert (best.tp, best.pp) == (1, 1)
    fsdp8 = next(c for c in result.ranked if (c.plan.dims.dp_shard, c.plan.dims.dp_replicate) == (8, 1))
    assert fsdp8.cfg.training.local_batch_size == 16 and fsdp8.accum_steps == 1
    split = [c for c in result.ranked if c.plan.dims.tp > 1 or c.plan.dims.pp > 1]
    assert split and all(c.time.total > fsdp8.time.total for c in split)


def test_too_big_for_fsdp_alone_gets_tp_pp_or_cp(searches):
    """llama3_8b at 65,536 tokens per sequence: one sequence's logits (128,256 x 64k) and checkpointed blocks
    do not fit 80 GiB under FSDP 8 at the smallest setting (full AC, one sequence), so every layout found
    splits the model with TP or PP, or the sequence with CP; the fastest cuts the sequence over the node with
    the ring (its K/V transfers hide behind 64k-token attention; TP's collectives and PP's bubble do not), with
    the all-to-all scheme next."""
    _, _, budget, result = searches["8B at 64k, 8 GPUs"]
    fsdp_only = parse_args([*LONG_8B, "--parallelism.dp_shard", "8", "--activation_checkpoint.mode", "full"])
    assert plan(fsdp_only, 8).peak > budget
    assert all(c.plan.dims.tp > 1 or c.plan.dims.pp > 1 or c.plan.cp > 1 for c in result.ranked)
    first, second = result.ranked[:2]
    assert (first.plan.cp, first.plan.cp_scheme, first.plan.dims.tp) == (8, "ring", 1)
    assert (second.plan.cp, second.plan.cp_scheme) == (8, "alltoall")
    assert first.time.comm.get("cp", 0.0) == 0.0 < second.time.comm["cp"]


def test_tensor_parallelism_stays_inside_a_node(searches):
    """With 4 GPUs per node, TP 8 would run its per-layer collectives at the inter-node 50 GB/s instead of
    the 120 it gets over NVLink: the winner keeps TP within a node; with 2 per node the same TP 4 layout is slower
    than with 8.
    (At 2 per node no layout with TP <= 2 fits this job: TP without PP keeps 64k x 64,128 logits with the
    loss-parallel backward's three fp32 buffers, and a pipeline's last stage gathers the whole vocabulary.)"""
    _, _, _, four = searches["8B at 64k, 8 GPUs, 4 per node"]
    _, _, _, eight = searches["8B at 64k, 8 GPUs"]
    assert four.ranked[0].plan.dims.tp <= 4
    tp4 = next(c for c in eight.ranked if c.plan.dims.tp == 4)
    across = step_time(tp4.cfg, tp4.plan, Hardware(gpus_per_node=2))
    assert across.comm["tp"] == pytest.approx(tp4.time.comm["tp"] * 120 / 50)
    assert across.total > tp4.time.total


def test_step_time_rules():
    """compute = MFU FLOPs / (peak x MFU); full AC adds a third; the pipeline bubble is (pp - 1) / (micro x
    virtual) of the compute plus a fixed cost per pass; FSDP traffic is exposed by FSDP_EXPOSED while the
    compute hides the rest; the optimizer streams 30 bytes per parameter of the rank with the Triton AdamW
    kernel (the default on a GPU), 40 with torch's."""
    hw = Hardware()
    one = parse_args([*DENSE_1B, "--training.global_batch_size", "16"])
    p1 = plan(one, 1)
    base = step_time(one, p1, hw)
    assert base.comm == {} and base.recompute == 0 and base.bubble == 0
    # the optimizer's HBM traffic per parameter (p1 holds them in fp32, 4 bytes each)
    assert base.optimizer == pytest.approx(p1.memory["parameters (fp32)"] * 30 / 4 / hw.memory_bw)
    assert base.total == pytest.approx(base.compute + base.optimizer)
    torch_kernel = parse_args([*DENSE_1B, "--training.global_batch_size", "16", "--optimizer.adamw_kernel", "torch"])
    assert step_time(torch_kernel, p1, hw).optimizer == pytest.approx(base.optimizer * 40 / 30)
    full = parse_args([*DENSE_1B, "--training.global_batch_size", "16", "--activation_checkpoint.mode", "full"])
    assert step_time(full, plan(full, 1), hw).recompute == pytest.approx(base.compute / 3)
    pp = parse_args([*DENSE_1B, "--training.global_batch_size", "32", "--parallelism.pp", "2",
                     "--parallelism.pp_microbatches", "8"])
    t = step_time(pp, plan(pp, 4), hw)  # PP 2 x FSDP 2, the global batch of 2 data-parallel ranks
    assert t.compute == pytest.approx(base.compute / 2)
    assert t.bubble == pytest.approx(t.compute / 8) and t.passes == pytest.approx(8 * PP_PASS_OVERHEAD)
    fsdp = parse_args([*DENSE_1B, "--training.global_batch_size", "128"])
    p = plan(fsdp, 8)
    t = step_time(fsdp, p, hw)
    raw = sum(v for k, v in p.comm.items() if k.startswith("dp_shard")) / hw.intra_node_bw
    assert raw < t.compute and t.comm["dp_shard"] == pytest.approx(FSDP_EXPOSED * raw)
    assert t.tokens_per_gpu_s == pytest.approx(128 * 2048 / t.total / 8)
    # Without a global batch, the trainer's: the local batch per data-parallel rank (4 GPUs, TP 2: 2 ranks).
    tp = parse_args([*DENSE_1B, "--training.local_batch_size", "2", "--parallelism.tp", "2"])
    t = step_time(tp, plan(tp, 4), hw)
    assert t.tokens_per_gpu_s == pytest.approx(2 * 2 * 2048 / t.total / 4)
    assert t.compute == pytest.approx(base.compute * 4 / 16 / 4)  # 4 of base's 16 sequences over 4 GPUs


def test_cli_search_table(capsys):
    assert main(["--config", "train_configs/7b.toml", "--gpus", "8", "--search", "--top", "3"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("search: 7b on 8 GPUs (1 node of 8), 80 GiB each; global batch 256 sequences")
    assert "model estimates, not measurements" in out[1]
    rows = [line for line in out if line[:3].strip().isdigit()]
    assert len(rows) == 3
    chosen = next(line for line in out if line.startswith("chosen: "))
    assert chosen.startswith(f"chosen: {rows[0][5:63].strip()}, AC ") and "--parallelism.dp_shard" in out[-1]


@pytest.mark.parametrize("argv,expect", [
    (["--gpus", "0", "--search"], "--gpus: expected a finite number > 0"),
    (["--search"], "--search: expected --gpus N"),
    (["--gpus", "12", "--search"], "--gpus 12: expected a multiple of --gpus-per-node 8"),
    (["--gpus", "16", "--gpus-per-node", "0", "--search"], "--gpus-per-node: expected a finite number > 0"),
    (["--gpus", "8", "--search", "--mfu", "2"], "--mfu 2: expected a share of the peak"),
    (["--gpus", "8", "--search", "--device-memory", "2"],
     "--device-memory 2: no layout of 7b on 8 GPUs fits 2 GiB per GPU; the smallest predicted peak is"),
])
def test_cli_bad_input_is_one_line(argv, expect, capsys):
    assert main(["--config", "train_configs/7b.toml", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and expect in err[0], err


def test_search_checks_each_candidate_with_the_trainer():
    """A flavor with tied embeddings: every pipeline layout is refused (the trainer's split needs an output
    head), so none is returned."""
    cfg = parse_args(["--model.flavor", "600m", "--training.seq_len", "1024", "--training.local_batch_size", "4",
                      "--data.tokenizer", "byte"])
    result = search(cfg, 4, 80 * GIB)
    assert result.refused > 0 and result.ranked
    assert all(c.plan.dims.pp == 1 and c.plan.dims.tp == 1 for c in result.ranked)  # TP needs untied too


def test_float8_without_activation_checkpointing_pays_its_fused_kernel():
    """Compiled float8 tensorwise blocks without activation checkpointing run one slow Inductor kernel per block
    (benchmarks/RESULTS.md): on 4 H200s the search now picks op-level selective AC for llama3_8b in float8, the
    measured best (11,730 against 11,293 tokens/s per GPU without AC), and still no AC in bf16 (9,562 against
    9,517: level)."""
    for argv, ac in ((EIGHT_B + F8_FSDP, "selective"), (EIGHT_B, "none")):  # the measured rows' arguments
        best = search(parse_args(argv.split()), 4, 139 * GIB).ranked[0]
        assert (best.plan.dims.dp_shard, best.cfg.activation_checkpoint.mode) == (4, ac), best.overrides()


def test_a_huge_gpu_count_answers_within_its_time_budget():
    """A billion GPUs: the divisors come from the prime factors, the layouts are pruned (TP within a node, PP
    at most the layers), and the search stops after its time budget with the layouts it tried ranked and the
    untried ones counted; the command line says so in one line."""
    cfg = parse_args(DENSE_1B)
    start = time.monotonic()
    result = search(cfg, 10**9, 80 * GIB, seconds=1.0)
    assert time.monotonic() - start < 8.0
    assert result.ranked and result.untried > 0
    assert all(c.plan.dims.tp <= 8 and c.plan.world == 10**9 for c in result.ranked)
    assert search(cfg, 10**9, 80 * GIB, seconds=1.0).ranked[0].layout == result.ranked[0].layout  # simplest first


def test_cli_search_budget_line(capsys):
    assert main([*DENSE_1B, "--gpus", "1000000000", "--search", "--search-seconds", "1", "--top", "2"]) == 0
    out = capsys.readouterr().out.splitlines()
    budget = [line for line in out if line.startswith("time budget: ")]
    assert len(budget) == 1 and "layouts left untried after 1 s (--search-seconds" in budget[0], out
    assert main([*DENSE_1B, "--gpus", "8", "--search", "--search-seconds", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and "--search-seconds: expected a finite number > 0" in err[0]


def test_emulated_float8_is_planned_at_bf16_speed():
    """``float8.emulate`` runs high-precision GEMMs: the planner gives it no float8 speedup; real float8 gets one."""
    base = ["--model.flavor", "llama3_8b", "--data.tokenizer", "byte", "--training.seq_len", "8192",
            "--training.local_batch_size", "1", "--parallelism.dp_shard", "4"]
    float8 = ["--float8.enabled", "true", "--float8.recipe", "tensorwise"]

    def compute(extra: list[str]) -> float:
        cfg = parse_args([*base, *extra])
        return step_time(cfg, plan(cfg, 4), Hardware()).compute

    assert compute([*float8, "--float8.emulate", "true"]) == pytest.approx(compute([]))
    assert compute(float8) < 0.9 * compute([])
