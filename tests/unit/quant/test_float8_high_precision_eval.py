"""``float8.high_precision_eval``: the validation runs the float8 linears and experts on their own weights,
as the eval tool (a plain Decoder) runs the trained model, and training goes on in float8 afterwards.

Emulated float8 on CPU: each float8 GEMM is a float32 matmul of float8-rounded operands, so "without float8
rounding" is bit-equal to the plain modules here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn
from float8_utils import TINY, float8_gpu_skip_reason, init_decoder, needs_torchao, tiny_float8, tiny_tokens
from trainer_utils import REPO, run_trainer

from torchtitan_ext.config.job_config import Float8Section
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.models.mode import GroupedExperts
from torchtitan_ext.parallel.compile import apply_compile
from torchtitan_ext.quant import float8 as f8
from torchtitan_ext.quant.float8_blockwise import BlockwiseFloat8Linear
from torchtitan_ext.quant.float8_experts import Float8GroupedExperts


def _plain_twin(model: nn.Module) -> Decoder:
    plain = Decoder(TINY)
    plain.load_state_dict(model.state_dict())
    plain.init_buffers(torch.device("cpu"))
    return plain


@needs_torchao
def test_float8_linears_run_their_weights_inside_and_float8_again_after():
    model, converted = tiny_float8(Float8Section(enabled=True, min_dim=16, include_output=True))
    assert "output" in converted and len(converted) == 2 * 7 + 1
    tokens = tiny_tokens()[:, :-1]
    with torch.no_grad():
        rounded = model(tokens)
        plain = _plain_twin(model)(tokens)
        with f8.high_precision_forward([model]):
            inside = model(tokens)
        after = model(tokens)
    assert torch.equal(inside, plain)
    assert (rounded - plain).abs().max() > 1e-3  # the float8 forward rounds: the test would see a no-op
    assert torch.equal(after, rounded)
    assert not any("forward" in vars(m) for m in model.modules())


@needs_torchao
def test_compiled_blocks_and_head_switch_graphs_with_the_forward():
    """Compiled as the trainer compiles (each block, the head in place), validation calls alternate between
    float8 and plain: each call runs its own graph, none reuses the other's."""
    model, _ = tiny_float8(Float8Section(enabled=True, min_dim=16, include_output=True))
    tokens = tiny_tokens()[:, :-1]
    with torch.no_grad():
        rounded, plain = model(tokens), _plain_twin(model)(tokens)
        model.eval()
        apply_compile(model, experts_in_graph=True, tensor_parallel=False, compile_head=True)
        calls = [model(tokens)]
        for _ in range(2):
            with f8.high_precision_forward([model]):
                calls.append(model(tokens))
            calls.append(model(tokens))
    for i, out in enumerate(calls):
        torch.testing.assert_close(out, plain if i % 2 else rounded, rtol=1e-4, atol=1e-4)
    assert (rounded - plain).abs().max() > 1e-2


@needs_torchao
def test_the_plain_forward_is_restored_when_the_validation_raises():
    model, _ = tiny_float8(Float8Section(enabled=True, min_dim=16))
    with pytest.raises(RuntimeError, match="stop"), f8.high_precision_forward([model]):
        raise RuntimeError("stop")
    assert not any("forward" in vars(m) for m in model.modules())


def test_blockwise_linear_and_float8_experts_run_their_weights_inside():
    torch.manual_seed(0)
    linear = BlockwiseFloat8Linear(256, 128, bias=False, emulate=True)
    x = torch.randn(8, 256)
    experts = Float8GroupedExperts(4, 32, 48, emulate=True)
    plain_experts = GroupedExperts(4, 32, 48)
    for w in (experts.w1, experts.w2, experts.w3):
        nn.init.normal_(w, std=0.2)
    plain_experts.load_state_dict(experts.state_dict())
    rows, counts = torch.randn(20, 32), torch.tensor([5, 0, 9, 6])
    with torch.no_grad():
        rounded = linear(x), experts(rows, counts)
        with f8.high_precision_forward([linear, experts]):
            inside = linear(x), experts(rows, counts)
        after = linear(x), experts(rows, counts)
    assert torch.equal(inside[0], x @ linear.weight.t())
    assert torch.equal(inside[1], plain_experts(rows, counts))
    for r, i, a in zip(rounded, inside, after, strict=True):
        assert (r - i).abs().max() > 1e-4 and torch.equal(a, r)


def test_high_precision_eval_needs_float8():
    with pytest.raises(ConfigError, match=r"^float8.high_precision_eval = true needs float8.enabled = true$"):
        f8.check_float8_supported(Float8Section(high_precision_eval=True), torch.device("cpu"))


@needs_torchao
def test_trainer_validation_in_high_precision_equals_eval_tool(tmp_path):
    """A compiled float8 (emulated) run, head included, with float8.high_precision_eval: its final validation
    loss (after a validation at step 2 and training on in float8) is the eval tool's on the checkpoint it
    saved, which loads the weights into a plain Decoder."""
    dump = tmp_path / "run"
    run_trainer(dump, 0, "--float8.enabled", "true", "--float8.emulate", "true", "--float8.high_precision_eval",
                "true", "--float8.include_output", "true", "--training.compile", "true", "--training.steps", "3",
                "--eval.interval", "2", "--eval.steps", "2", "--checkpoint.enabled", "true",
                "--checkpoint.interval", "100")
    rows = [json.loads(line) for line in (dump / "metrics.jsonl").read_text().splitlines()]
    validations = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in validations] == [2, 3]
    final = validations[-1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "torchtitan_ext.eval", "--config", str(dump / "config.toml")],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["checkpoint"].endswith("step-3")
    assert res["val_loss"] == pytest.approx(final["val_loss"], rel=1e-5, abs=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(float8_gpu_skip_reason() is not None, reason=str(float8_gpu_skip_reason()))
def test_gpu_compiled_validation_alternates_between_float8_and_bf16():
    """Real float8 GEMMs, compiled as the trainer compiles (head included), bf16 autocast: inside the context
    the logits are the plain bf16 model's, outside float8's, call after call."""
    args = ModelArgs(vocab_size=4096, dim=1024, n_layers=2, n_heads=8, n_kv_heads=4, ffn_hidden=2816,
                     max_seq_len=512)
    tokens = torch.randint(0, 4096, (4, 512), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    with torch.device("cuda"):
        model = init_decoder(Decoder(args), seed=0, device="cuda")
        plain = init_decoder(Decoder(args), seed=0, device="cuda")
    cfg = Float8Section(enabled=True, include_output=True)
    f8.check_float8_supported(cfg, torch.device("cuda"))
    assert len(f8.convert_to_float8(model, cfg, log=lambda s: None)) == 2 * 7 + 1
    model.eval()
    apply_compile(model, experts_in_graph=True, tensor_parallel=False, compile_head=True)
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        reference = plain(tokens).float()
        calls = [model(tokens).float()]
        for _ in range(2):
            with f8.high_precision_forward([model]):
                calls.append(model(tokens).float())
            calls.append(model(tokens).float())
    errors = [((out - reference).norm() / reference.norm()).item() for out in calls]
    plain_errors, float8_errors = errors[1::2], errors[0::2]
    assert max(plain_errors) < 0.02 and max(plain_errors) < 0.25 * min(float8_errors), errors
