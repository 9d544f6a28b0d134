"""Evaluation (bits per byte, sliding windows, the eval CLI), generation with a KV cache, and Hugging Face
export / import (logits against transformers, ``load_hf`` round trip, ``checkpoint.initial_load_path``)."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from data_builders import random_decoder
from trainer_utils import REPO, TEST_CACHE, read_metrics, run_trainer

from torchtitan_ext.data.shards import read_shard
from torchtitan_ext.eval.load import load_trained
from torchtitan_ext.generate.decoding import KVCache, forward_cached, generate
from torchtitan_ext.hf.export import export_model
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.models.flavors import get_flavor

# A Llama-shaped tiny model (the 1b flavor's features), trained 6 steps by 2 FSDP processes.
LLAMA = ["--model.flavor", "1b", "--model.dim", "64", "--model.n_layers", "2", "--model.n_heads", "4",
         "--model.n_kv_heads", "2", "--model.ffn_hidden", "128", "--model.vocab_size", "320",
         "--training.steps", "6", "--eval.steps", "100", "--checkpoint.enabled", "true", "--checkpoint.interval", "6"]


def _cli(module: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env={"OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PATH": ""})


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    dump = tmp_path_factory.mktemp("llama")
    run_trainer(dump, 2, *LLAMA)
    return dump


@pytest.fixture(scope="module")
def eval_of_trained(trained):
    """The eval CLI on ``trained`` in one process, each set of arguments run once (the TP2 and PP2 sliding-eval
    tests compare with the same two evaluations): arguments -> the result's JSON."""
    done: dict[tuple[str, ...], dict] = {}

    def run(*args: str) -> dict:
        if args not in done:
            out = _cli("torchtitan_ext.eval", "--config", str(trained / "config.toml"), *args)
            assert out.returncode == 0, out.stderr
            done[args] = json.loads(out.stdout)
        return done[args]

    return run


def test_val_bpb_on_bytes_and_eval_cli(trained, tmp_path):
    final = [r for r in map(json.loads, (trained / "metrics.jsonl").read_text().splitlines()) if "loss" not in r][-1]
    # The validation windows (100 steps x 4 sequences of 64, split over the 2 ranks) score these; bytes exclude EOT.
    val = np.asarray(read_shard(next(TEST_CACHE.glob("stdlib_*_byte/val.bin"))))
    targets = val[1:100 * 4 * 64 + 1]
    n_eot = int((targets == 256).sum())
    assert n_eot > 0
    expected = final["val_loss"] / math.log(2) * len(targets) / (len(targets) - n_eot)
    assert final["val_bpb"] == pytest.approx(expected, rel=1e-9)
    # The eval CLI on one process, non-overlapping windows over the same tokens: the trainer's numbers.
    common = ["--config", str(trained / "config.toml"), "--eval.steps", "100"]  # 100 x 4 x 64: what the 2 ranks saw
    out = _cli("torchtitan_ext.eval", *common)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    assert res["checkpoint"].endswith("step-6") and res["scored_tokens"] == len(targets)
    assert res["val_loss"] == pytest.approx(final["val_loss"], rel=1e-5)
    assert res["val_bpb"] == pytest.approx(final["val_bpb"], rel=1e-5)
    slid = json.loads(_cli("torchtitan_ext.eval", *common, "--eval.stride", "16").stdout)
    assert slid["scored_tokens"] == len(targets) and slid["val_loss"] != res["val_loss"]
    bad = _cli("torchtitan_ext.eval", *common, "--checkpoint.load_step", "3")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "load_step = 3" in bad.stderr


@pytest.mark.parametrize("layout", [["--training.local_batch_size", "3"], ["--parallelism.tp", "2"],
                                    ["--parallelism.pp", "2"]], ids=["fsdp2", "tp2", "pp2"])
def test_trainer_sliding_eval_equals_eval_cli(trained, eval_of_trained, tmp_path, layout):
    """The trainer's evaluation with eval.stride, resumed at the last step of the trained job with that step's
    validation record removed (so it only evaluates): 2 FSDP ranks splitting the windows (3 per rank: the last
    global batch padded with windows that score nothing), TP2 (loss parallel over the vocabulary), or PP2
    (2 micro-batches of different scored token counts, weighted by them), equals the one-process eval CLI."""
    shutil.copytree(trained, tmp_path / "job")
    # without the last step's validation record the finished run validates again instead of "nothing to train"
    metrics = tmp_path / "job" / "metrics.jsonl"
    metrics.write_text("".join(line + "\n" for line in metrics.read_text().splitlines()
                               if not (json.loads(line).get("step") == 6 and "val_loss" in json.loads(line))))
    sliding = ["--eval.stride", "16", "--eval.steps", "8"]  # 8 x batch x 64 + 1 tokens, in windows of 64 + 1
    run_trainer(tmp_path / "job", 2, *LLAMA, *sliding, *layout)
    final = [r for r in map(json.loads, (tmp_path / "job" / "metrics.jsonl").read_text().splitlines())][-1]
    batch = layout[1] if layout[0] == "--training.local_batch_size" else "4"
    res = eval_of_trained(*sliding, "--training.local_batch_size", batch)
    assert res["scored_tokens"] == 8 * int(batch) * 64 and res["stride"] == 16
    assert final["step"] == 6 and final["val_loss"] == pytest.approx(res["val_loss"], rel=1e-5)
    assert final["val_bpb"] == pytest.approx(res["val_bpb"], rel=1e-5)
    plain = eval_of_trained("--eval.steps", "8", "--training.local_batch_size", batch)
    assert abs(final["val_loss"] - plain["val_loss"]) > 1e-3  # the stride made a difference


def test_trainer_sliding_eval_refusals(tmp_path):
    for extra, why in ((["--eval.stride", "65"], "expected 0 or 1 .. seq_len (64)"),
                       (["--eval.stride", "16", "--data.attention", "document"], "plain causal windows")):
        proc = run_trainer(tmp_path, 0, "--eval.steps", "2", *extra, check=False)
        err = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(err) == 1 and why in err[0], proc.stderr[-2000:]


def test_generation_kv_cache_equals_no_cache(trained):
    model, tok, _, _ = load_trained(trained)
    prompts = [list(tok.encode("def main(")), list(tok.encode("import os\n")), list(tok.encode("x"))]
    cached = generate(model, prompts, 20)
    assert cached == generate(model, prompts, 20, use_cache=False)
    assert all(len(c) == 20 for c in cached)
    # The cached forward's logits equal Decoder.forward's, prefill and per step (features of the debug flavor).
    extra = {k: v for k, v in (("kv_share", "interleaved"), ("residual_scalars", True))
             if k in {f.name for f in dataclasses.fields(ModelArgs)}}  # other issues' features, when present
    rnd = random_decoder(qk_norm=True, rope_fraction=0.5, nope_every=2, logit_softcap=20.0, n_layers=4, **extra)
    seq = torch.randint(0, 97, (2, 24))
    cache = KVCache(rnd, 2, 24, torch.zeros(2, dtype=torch.long))
    parts = [forward_cached(rnd, seq[:, :10], cache)] + [forward_cached(rnd, seq[:, i:i + 1], cache)
                                                         for i in range(10, 24)]
    torch.testing.assert_close(torch.cat(parts, dim=1), rnd(seq), rtol=1e-5, atol=1e-5)
    sampled = generate(model, prompts, 10, temperature=0.8, top_p=0.9, seed=1)
    assert sampled == generate(model, prompts, 10, temperature=0.8, top_p=0.9, seed=1, use_cache=False)
    out = _cli("torchtitan_ext.generate", "--checkpoint", str(trained), "--prompt", "def f(", "--prompt", "a",
               "--max-new-tokens", "8", "--json")
    assert out.returncode == 0, out.stderr
    assert len(json.loads(out.stdout)["completions"]) == 2 and json.loads(out.stdout)["compiled"] is False  # CPU
    bad = _cli("torchtitan_ext.generate", "--checkpoint", str(trained / "nothing"), "--prompt", "a")
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1


def test_damaged_checkpoint_is_one_line_for_generate_eval_export(trained, tmp_path):
    """A truncated shard in the checkpoint that generate / eval / export would read: one line naming it,
    exit 2 (the trainer skips such a checkpoint; these tools are told which one to read)."""
    dump = tmp_path / "dump"
    shutil.copytree(trained, dump)
    step = max((dump / "checkpoint").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    for shard in step.glob("*.distcp"):
        shard.write_bytes(shard.read_bytes()[:100])
    for args in (("torchtitan_ext.generate", "--checkpoint", str(step), "--prompt", "a"),
                 ("torchtitan_ext.export", "--checkpoint", str(step), "--output", str(tmp_path / "hf"))):
        out = _cli(*args)
        assert out.returncode == 2, out.stderr
        assert out.stderr.strip().splitlines() == [out.stderr.strip()]
        assert f"{step}: damaged checkpoint" in out.stderr


def test_export_architectures_and_initial_load_path(trained, tmp_path):
    """Nothing is refused: the debug flavor's features (partial RoPE, NoPE with QK-norm) are written as our
    modeling file, mode_debug's MoDE as Mixtral; the CLI says which it wrote."""
    for flavor, arch, native in [("debug", "TorchtitanExtForCausalLM", False),
                                 ("mode_debug", "MixtralForCausalLM", True)]:
        args = dataclasses.replace(get_flavor(flavor), vocab_size=64, dim=64, n_heads=4, n_layers=2)
        res = export_model(Decoder(args), tmp_path / flavor)
        assert (res.architecture, res.native) == (arch, native)
        assert any(p.suffix == ".py" for p in (tmp_path / flavor).iterdir()) == (not native)
    out = _cli("torchtitan_ext.export", "--checkpoint", str(trained), "--output", str(tmp_path / "hf"),
               "--dtype", "float32")  # the default, bfloat16, would round the weights
    assert out.returncode == 0, out.stderr
    assert "as LlamaForCausalLM (native transformers class)" in out.stdout
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    # A new job starting from the exported weights with lr 0 validates exactly like the source job.
    start = tmp_path / "start"
    run_trainer(start, 2, *LLAMA, "--checkpoint.enabled", "false", "--optimizer.lr", "0", "--training.steps", "1",
                "--checkpoint.initial_load_path", str(tmp_path / "hf"))
    src = [r for r in map(json.loads, (trained / "metrics.jsonl").read_text().splitlines()) if "loss" not in r][-1]
    new = [r for r in map(json.loads, (start / "metrics.jsonl").read_text().splitlines()) if "loss" not in r][-1]
    assert new["val_loss"] == pytest.approx(src["val_loss"], rel=1e-5)
    bad = run_trainer(tmp_path / "bad", 0, *LLAMA, "--model.n_layers", "3", "--checkpoint.enabled", "false",
                      "--checkpoint.initial_load_path", str(tmp_path / "hf"), check=False)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith("error: checkpoint.initial")
    assert read_metrics(start)
