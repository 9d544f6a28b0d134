"""The model in TOML: every ModelArgs field is a [model] key (a key left out keeps the flavor's, any value a model
can have overrides it), new architectures need no code, every key round-trips through config.toml (an unset one
is left out), a config.toml written before keys were unset by omission reads as it did, bad values are one line
naming the key; the parallel degrees' -1 ("the ranks left"); the shipped 600m job and the multi-node layouts."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from trainer_utils import REPO

from torchtitan_ext.config.job_config import JobConfig, ModelSection, ParallelismSection
from torchtitan_ext.config.loader import help_text, parse_args, to_toml
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.args import ModelArgs
from torchtitan_ext.models.decoder import Decoder
from torchtitan_ext.models.flavors import FLAVORS, model_overrides, resolve_model_args
from torchtitan_ext.models.param_count import count_params
from torchtitan_ext.parallel.dims import ParallelDims, ParallelDimsError

MODEL_KEYS = [f.name for f in dataclasses.fields(ModelSection) if f.name != "flavor"]

# A value for every [model] key that differs from the debug flavor's value.
SET_VALUES = {
    "vocab_size": 1024, "dim": 96, "n_layers": 6, "n_heads": 6, "n_kv_heads": 3, "head_dim": 24,
    "ffn_hidden": 320, "activation": "relu2", "max_seq_len": 512, "rope_theta": 500000.0,
    "rope_fraction": 0.25, "nope_every": 3, "qk_norm": False, "norm_eps": 1e-6, "tie_embeddings": True,
    "logit_softcap": 30.0, "residual_scalars": True, "n_experts": 4, "top_k": 1, "moe_hidden": 64,
    "moe_every": 2, "shared_expert": True, "renormalize_gates": False, "aux_loss_coef": 0.02,
    "router_z_loss_coef": 0.0, "bias_update_rate": 0.001, "force_balanced_routing": True,
    "kv_share": "interleaved", "kv_share_group": 3,
    "parametrization": "mup", "mup_base_dim": 64, "mup_base_head_dim": 32,
    "rope_scaling": "llama3", "rope_scaling_factor": 16.0, "rope_low_freq_factor": 2.0,
    "rope_high_freq_factor": 8.0, "rope_original_max_seq_len": 1024,
}


def _toml(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return f'"{value}"' if isinstance(value, str) else repr(value)


def _load(tmp_path, text: str, *args: str) -> JobConfig:
    f = tmp_path / "job.toml"
    f.write_text(text)
    return parse_args(["--config", str(f), *args])


def test_every_model_arg_is_a_key_with_help():
    assert sorted(MODEL_KEYS) == sorted(f.name for f in dataclasses.fields(ModelArgs))
    assert sorted(SET_VALUES) == sorted(MODEL_KEYS), "give every new [model] key a test value"
    text = help_text()
    for f in dataclasses.fields(ModelSection):
        assert f.metadata["help"] and f"--model.{f.name} = " in text


@pytest.mark.parametrize("flavor", sorted(FLAVORS))
def test_unset_keys_keep_the_flavor(flavor):
    """A [model] table with only the flavor resolves to the flavor itself (max_seq_len: training.seq_len,
    no vocabulary: the tokenizer's, padded)."""
    cfg = parse_args(["--model.flavor", flavor])
    assert model_overrides(cfg.model) == {}
    want = FLAVORS[flavor]
    padded = 4032  # the tokenizer's 4000, padded to a multiple of 64
    want = dataclasses.replace(want, max_seq_len=cfg.training.seq_len, vocab_size=want.vocab_size or padded)
    assert resolve_model_args(cfg, 4000) == want


def test_new_architecture_in_toml_only(tmp_path):
    """A dense architecture no flavor has (attention wider than d_model, GQA, partial RoPE, tied head, soft-capped
    logits, QK-norm turned off), then a MoDE one on the same base; both build and count as expected."""
    cfg = _load(tmp_path, """
[model]
flavor = "debug"
vocab_size = 512
dim = 96
n_layers = 3
n_heads = 4
n_kv_heads = 2
head_dim = 32
ffn_hidden = 256
rope_theta = 500000.0
rope_fraction = 0.75
nope_every = 0
qk_norm = false
norm_eps = 1e-6
tie_embeddings = true
logit_softcap = 30.0
[training]
seq_len = 64
""")
    args = resolve_model_args(cfg, 300)
    assert args == ModelArgs(vocab_size=512, dim=96, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=32,
                             ffn_hidden=256, max_seq_len=64, rope_theta=500000.0, rope_fraction=0.75,
                             nope_every=0, qk_norm=False, norm_eps=1e-6, tie_embeddings=True, logit_softcap=30.0)
    per_layer = 96 * 128 * 2 + 96 * 64 * 2 + 2 * 96 + 3 * 96 * 256  # wq, wo; wk, wv; 2 norms; SwiGLU
    expected = 512 * 96 + 3 * per_layer + 96  # tied embedding, final norm
    with torch.device("meta"):
        model = Decoder(args)
    assert count_params(args)["total"] == expected == sum(p.numel() for p in model.parameters())
    assert model.output is None

    moe = parse_args(["--config", str(tmp_path / "job.toml"), "--model.n_experts", "4", "--model.top_k", "1",
                      "--model.moe_hidden", "64", "--model.moe_every", "2", "--model.shared_expert", "true",
                      "--model.renormalize_gates", "false", "--model.kv_share", "interleaved",
                      "--model.kv_share_group", "3"])
    margs = resolve_model_args(moe, 300)
    assert margs == dataclasses.replace(args, n_experts=4, top_k=1, moe_hidden=64, moe_every=2, shared_expert=True,
                                        renormalize_gates=False, kv_share="interleaved", kv_share_group=3)
    with torch.device("meta"):
        mmodel = Decoder(margs)
    counts = count_params(margs)
    assert counts["total"] == sum(p.numel() for p in mmodel.parameters())
    # layer 1 is MoDE (4 experts + router + shared expert); layers 1 and 2 reuse layer 0's K and V
    moe_layer = 96 * 128 * 2 + 2 * 96 + 96 * 4 + 5 * 3 * 96 * 64
    dense_layer = 96 * 128 * 2 + 2 * 96 + 3 * 96 * 256
    assert counts["total"] == 512 * 96 + 96 + 96 * 64 * 2 + 2 * dense_layer + moe_layer


def test_every_model_key_round_trips_through_config_toml(tmp_path):
    """Set every [model] key in a TOML file; the resolved config written as config.toml loads back to the
    same values, and to the same model."""
    text = '[model]\nflavor = "debug"\n' + "".join(f"{k} = {_toml(v)}\n" for k, v in SET_VALUES.items())
    cfg = _load(tmp_path, text + "[training]\nseq_len = 128\n")
    assert {k: getattr(cfg.model, k) for k in MODEL_KEYS} == SET_VALUES
    assert model_overrides(cfg.model) == SET_VALUES
    again = _load(tmp_path, to_toml(cfg))
    assert dataclasses.asdict(again) == dataclasses.asdict(cfg)
    assert resolve_model_args(again, 0) == resolve_model_args(cfg, 0) == dataclasses.replace(
        FLAVORS["debug"], **SET_VALUES)
    # Unset keys round-trip too (left out of config.toml: TOML has no null), and the command line sets each one.
    plain = parse_args([])
    assert "[model]\nflavor = \"debug\"\n\n" in to_toml(plain)
    assert dataclasses.asdict(_load(tmp_path, to_toml(plain))) == dataclasses.asdict(plain)
    cli = parse_args([a for k, v in SET_VALUES.items() for a in (f"--model.{k}", _toml(v).strip('"').lower())])
    assert dataclasses.asdict(cli.model) == dataclasses.asdict(cfg.model)


def test_switches_override_either_way_and_unset_keeps_the_flavor(tmp_path):
    """true / false override the flavor's either way; a switch left out keeps it; "" is no longer a value."""
    assert FLAVORS["debug"].qk_norm and FLAVORS["debug"].renormalize_gates
    cfg = _load(tmp_path, '[model]\nqk_norm = false\ntie_embeddings = true\n')
    assert (cfg.model.qk_norm, cfg.model.renormalize_gates, cfg.model.tie_embeddings) == (False, None, True)
    args = resolve_model_args(cfg, 300)
    assert (args.qk_norm, args.renormalize_gates, args.tie_embeddings) == (False, True, True)
    cli = parse_args(["--model.qk_norm", "0", "--model.shared_expert", "TRUE"])
    assert (cli.model.qk_norm, cli.model.shared_expert, cli.model.tie_embeddings) == (False, True, None)
    assert "qk_norm = false" in to_toml(cli) and "tie_embeddings" not in to_toml(cli)
    with pytest.raises(ConfigError) as e:
        parse_args(["--model.tie_embeddings", ""])
    assert str(e.value) == "argument --model.tie_embeddings: model.tie_embeddings: expected bool, got ''"


@pytest.mark.parametrize("flavor, key, value", [
    ("debug", "rope_fraction", 0.0), ("debug", "nope_every", 0), ("debug", "n_kv_heads", 0), ("600m", "head_dim", 0),
    ("600m", "vocab_size", 0), ("mode_debug", "moe_hidden", 0), ("mode_debug", "n_experts", 0),
])
def test_old_unset_value_now_overrides_the_flavor(flavor, key, value):
    """Values that once meant "the flavor's" (0) or sit next to it, on flavors with another value: each one
    overrides, from the command line as from TOML."""
    base = resolve_model_args(parse_args(["--model.flavor", flavor]), 4000)
    cfg = parse_args(["--model.flavor", flavor, f"--model.{key}", str(value)])
    assert getattr(cfg.model, key) == value and model_overrides(cfg.model) == {key: value}
    args = resolve_model_args(cfg, 4000)
    expected = {"vocab_size": 4032}.get(key, value)  # 0: the tokenizer's 4000, padded to a multiple of 64
    assert getattr(args, key) == expected != getattr(FLAVORS[flavor], key)
    assert args == dataclasses.replace(base, **{key: expected})


def test_zero_softcap_overrides_the_file(tmp_path):
    """No flavor caps its logits: a job file does, and --model.logit_softcap 0 takes the cap off again."""
    capped = _load(tmp_path, "[model]\nlogit_softcap = 30.0\n")
    assert resolve_model_args(capped, 300).logit_softcap == 30.0
    uncapped = parse_args(["--config", str(tmp_path / "job.toml"), "--model.logit_softcap", "0"])
    assert uncapped.model.logit_softcap == 0.0 and resolve_model_args(uncapped, 300).logit_softcap == 0.0


# What the trainer wrote as config.toml before a key was unset by leaving it out: every key, "the flavor's"
# spelled 0, -1 or "" (the mode_debug flavor has n_kv_heads = 2 and moe_hidden = 256, where 0 now overrides).
OLD_DUMP = """[model]
flavor = "mode_debug"
vocab_size = 0
dim = 0
n_layers = 3
n_heads = 0
n_kv_heads = 0
head_dim = 0
ffn_hidden = 0
activation = ""
max_seq_len = 0
rope_theta = 0.0
rope_scaling = ""
rope_scaling_factor = 0.0
rope_low_freq_factor = 0.0
rope_high_freq_factor = 0.0
rope_original_max_seq_len = 0
rope_fraction = -1.0
nope_every = -1
qk_norm = true
norm_eps = 0.0
tie_embeddings = ""
logit_softcap = -1.0
residual_scalars = ""
n_experts = -1
top_k = 0
moe_hidden = 0
moe_every = 0
shared_expert = ""
renormalize_gates = ""
aux_loss_coef = -1.0
router_z_loss_coef = -1.0
bias_update_rate = -1.0
kv_share = ""
kv_share_group = -1
parametrization = ""
mup_base_dim = 0
mup_base_head_dim = 0
"""


def test_config_toml_written_before_reads_as_it_did(tmp_path):
    cfg = _load(tmp_path, OLD_DUMP)
    assert model_overrides(cfg.model) == {"n_layers": 3, "qk_norm": True}
    assert resolve_model_args(cfg, 300) == dataclasses.replace(FLAVORS["mode_debug"], n_layers=3, qk_norm=True,
                                                               vocab_size=320, max_seq_len=cfg.training.seq_len)
    # Written again, it holds the set keys only, and reads back to the same model.
    assert dataclasses.asdict(_load(tmp_path, to_toml(cfg))) == dataclasses.asdict(cfg)
    assert "n_kv_heads" not in to_toml(cfg)


def test_resume_diagnosis_reads_old_and_new_config_toml(tmp_path):
    """The previous start's config.toml, in either form, against a job that sets one more key: only that key is
    named, with the flavor's value from run.json (or "unset" without it)."""
    from torchtitan_ext.checkpoint.manager import config_changes
    from torchtitan_ext.checkpoint.run_folder import write_identity

    before = ["--model.flavor", "mode_debug", "--model.n_layers", "3", "--model.qk_norm", "true"]
    job = parse_args([*before, "--model.dim", "128"])
    for text in (OLD_DUMP, to_toml(parse_args(before))):
        (tmp_path / "config.toml").write_text(text)
        assert config_changes(tmp_path, job, ("model.",)) == [
            "model.dim changed since the last start (unset -> 128): leave model.dim unset to resume it"]
    write_identity(tmp_path, {"model": dataclasses.asdict(FLAVORS["mode_debug"])}, 0)
    assert config_changes(tmp_path, parse_args(before[:4]), ("model.",)) == [
        "model.qk_norm changed since the last start (true -> unset): set model.qk_norm = true to resume it"]
    assert config_changes(tmp_path, job, ("model.",)) == [
        "model.dim changed since the last start (256 -> 128): set model.dim = 256 to resume it"]


@pytest.mark.parametrize("content, message", [
    ('[model]\nqk_norm = "maybe"\n', "model.qk_norm: expected bool, got 'maybe'"),
    ("[model]\ntie_embeddings = 1\n", "model.tie_embeddings: expected bool, got 1"),
    ("[model]\ndim = 96.5\n", "model.dim: expected int, got 96.5"),
    ('[model]\nn_layers = "4"\n', "model.n_layers: expected int, got '4'"),
    ("[model]\nrope_fraction = 1.5\n", "model.rope_fraction: 1.5 is above the maximum 1.0"),
    ("[model]\nnope_every = -2\n", "model.nope_every: -2 is below the minimum 0"),
    ("[model]\ndim = 0\n", "model.dim: 0 is below the minimum 1"),
    ("[model]\nhead_dim = -8\n", "model.head_dim: -8 is below the minimum 0"),
    ("[model]\nrope_theta = -1.0\n", "model.rope_theta: -1.0 is below the minimum 0.0"),
    ('[model]\nkv_share = "all"\n', "model.kv_share: 'all' is not one of"),
    ("[model]\nlogit_softcap = nan\n", "model.logit_softcap: expected a finite float"),
])
def test_bad_model_value_is_one_line_naming_the_key(tmp_path, content, message):
    with pytest.raises(ConfigError) as e:
        _load(tmp_path, content)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("args, message", [
    (["--model.rope_fraction", "-0.5"], "argument --model.rope_fraction: model.rope_fraction: -0.5 is below the "
                                        "minimum 0.0"),
    (["--model.kv_share_group", "0"], "argument --model.kv_share_group: model.kv_share_group: 0 is below the "
                                      "minimum 1"),
    (["--model.logit_softcap", "-1"], "argument --model.logit_softcap: model.logit_softcap: -1.0 is below the "
                                      "minimum 0.0"),
    (["--model.dim", "wide"], "argument --model.dim: model.dim: expected int, got 'wide'"),
    (["--model.qk_norm", "maybe"], "argument --model.qk_norm: model.qk_norm: expected bool, got 'maybe'"),
    (["--model.rope_theta", "0"], "model.rope_theta = 0.0: expected > 0 (flavor 'debug' with the [model] keys "
                                  "applied)"),
    (["--model.n_heads", "3"], "model.dim = 256 is not divisible by n_heads = 3"),
    (["--model.n_experts", "2", "--model.top_k", "3"], "model.top_k = 3: expected between 1 and n_experts = 2"),
])
def test_inconsistent_model_is_one_line_naming_the_key(args, message):
    """Bad values on the command line: the loader's refusals (type, bounds), then those it passes but the
    resolved model refuses (ModelArgs.validate)."""
    with pytest.raises(ConfigError) as e:
        resolve_model_args(parse_args(args), 300)
    assert message in str(e.value) and "\n" not in str(e.value)


# Parallel degrees: -1 takes the ranks left after the others.

def _dims(world: int, **degrees) -> ParallelDims:
    return ParallelDims.from_config(ParallelismSection(**degrees), world)


def test_dp_shard_minus_one_takes_the_rest():
    assert _dims(8).dp_shard == 8
    d = _dims(64, tp=4, pp=2)
    assert (d.dp_shard, d.tp, d.pp, d.dp) == (8, 4, 2, 8)
    d = _dims(16, dp_replicate=2, tp=2)
    assert (d.dp_replicate, d.dp_shard) == (2, 4)
    d = _dims(32, dp_replicate=-1, dp_shard=4, tp=2)  # one replica per node of 8
    assert (d.dp_replicate, d.dp_shard, d.tp, d.dp) == (4, 4, 2, 16)
    assert _dims(8, dp_replicate=-1, dp_shard=4, tp=2).dp_replicate == 1


@pytest.mark.parametrize("world, degrees, message", [
    (6, {"tp": 4}, "parallelism: dp_replicate(1) x tp(4) x pp(1) = 4, but the world size is 6"),
    (12, {"dp_replicate": -1, "dp_shard": 4, "tp": 2}, "dp_shard(4) x tp(2) x pp(1) = 8, but the world size is 12"),
    (8, {"dp_replicate": -1, "dp_shard": -1}, "dp_replicate and dp_shard are both -1"),
    (8, {"dp_replicate": 0}, "parallelism.dp_replicate = 0: expected >= 1, or -1"),
    (8, {"dp_shard": 4}, "= 4, but the world size is 8; set dp_shard = -1"),
])
def test_bad_degrees_are_one_line(world, degrees, message):
    with pytest.raises(ParallelDimsError) as e:
        _dims(world, **degrees)
    assert message in str(e.value) and "\n" not in str(e.value)


# Shipped jobs.

def test_600m_job_parses_and_resolves():
    cfg = parse_args(["--config", str(REPO / "train_configs/600m.toml")])
    args = resolve_model_args(cfg, 4096)  # the builtin tokenizer's vocabulary
    assert args == FLAVORS["600m"]
    assert 0.55e9 < count_params(args)["total"] < 0.65e9
    for world in (1, 8, 16):
        dims = ParallelDims.from_config(cfg.parallelism, world)
        assert dims.dp_shard == world and cfg.training.global_batch_size % (cfg.training.local_batch_size * world) == 0


def test_7b_job_runs_on_any_node_count_of_8_gpus():
    cfg = parse_args(["--config", str(REPO / "train_configs/7b.toml")])
    for nodes in (1, 2, 4, 8, 16):
        dims = ParallelDims.from_config(cfg.parallelism, 8 * nodes)
        assert (dims.dp_replicate, dims.dp_shard, dims.tp) == (nodes, 4, 2)
        assert cfg.training.global_batch_size % (cfg.training.local_batch_size * dims.dp) == 0
    assert resolve_model_args(cfg, 0).vocab_size >= 50257  # GPT-2-tokenized FineWeb shards


@pytest.mark.parametrize("path", sorted(str(p) for p in (REPO / "train_configs").glob("*.toml")))
def test_shipped_multi_gpu_jobs_take_the_rest(path):
    """Every shipped layout leaves one data-parallel degree at -1, so it runs on any multiple of the others."""
    p = parse_args(["--config", path]).parallelism
    assert -1 in (p.dp_shard, p.dp_replicate), path
