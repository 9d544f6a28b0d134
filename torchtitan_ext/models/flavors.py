"""Named model sizes. ``vocab_size = 0`` takes the tokenizer's vocabulary (the debug models)."""

from __future__ import annotations

import dataclasses

from torchtitan_ext.config.job_config import JobConfig
from torchtitan_ext.errors import ConfigError
from torchtitan_ext.models.args import ModelArgs

FLAVORS: dict[str, ModelArgs] = {
    # Trains on a CPU in seconds; exercises every block feature except MoDE.
    "debug": ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=768, qk_norm=True,
                       rope_fraction=0.5, nope_every=4),
    # The time-to-loss benchmark's size (train_configs/base_200m.toml, fast_200m.toml): a plain Llama block,
    # 180M parameters in the blocks, the vocabulary the tokenizer's.
    "200m": ModelArgs(dim=1024, n_layers=16, n_heads=16, n_kv_heads=4, ffn_hidden=2816),
    # Qwen3-0.6B-like: 128-dim heads (attention width 2048 > d_model), tied 152k vocabulary.
    "600m": ModelArgs(vocab_size=151936, dim=1024, n_layers=24, n_heads=16, n_kv_heads=8, head_dim=128,
                      ffn_hidden=4096, qk_norm=True, tie_embeddings=True, rope_theta=1000000.0,
                      max_seq_len=4096),
    # The benchmark shape of the foundation issue (compared with a plain single-file PyTorch script).
    "1b": ModelArgs(vocab_size=32000, dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, ffn_hidden=5632,
                    max_seq_len=4096),
    "7b": ModelArgs(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_hidden=11008,
                    max_seq_len=4096),
    "llama3_8b": ModelArgs(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                           ffn_hidden=14336, rope_theta=500000.0, max_seq_len=8192),
    "32b": ModelArgs(vocab_size=128256, dim=7168, n_layers=64, n_heads=56, n_kv_heads=8, ffn_hidden=19456,
                     rope_theta=500000.0, max_seq_len=8192, qk_norm=True),
    # MoDE: top-k routed expert FFNs (Zen report sizes).
    "mode_debug": ModelArgs(dim=256, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=768,
                            n_experts=8, top_k=2, moe_hidden=256),
    "mode_235b": ModelArgs(vocab_size=151936, dim=7168, n_layers=94, n_heads=56, n_kv_heads=8,
                           ffn_hidden=18432, n_experts=128, top_k=2, moe_hidden=864, qk_norm=True,
                           rope_theta=1000000.0, max_seq_len=8192),
    "mode_480b": ModelArgs(vocab_size=151936, dim=8192, n_layers=128, n_heads=64, n_kv_heads=8,
                           ffn_hidden=24576, n_experts=256, top_k=2, moe_hidden=576, qk_norm=True,
                           rope_theta=1000000.0, max_seq_len=8192),
}


def get_flavor(name: str) -> ModelArgs:
    if name not in FLAVORS:
        raise ConfigError(f"model.flavor = {name!r}: expected one of {', '.join(FLAVORS)}")
    return FLAVORS[name]


def model_overrides(section) -> dict:
    """The ``[model]`` keys that are set: every ModelSection field except ``flavor`` that is not None."""
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section)
            if f.name != "flavor" and getattr(section, f.name) is not None}


def resolve_model_args(cfg: JobConfig, tokenizer_vocab: int) -> ModelArgs:
    """The flavor with every set ``[model]`` key applied (``model_overrides``); ``max_seq_len`` defaults to
    training.seq_len and a missing vocabulary to the tokenizer's. Errors name the key."""
    args = get_flavor(cfg.model.flavor)
    overrides = model_overrides(cfg.model)
    if not overrides.get("vocab_size", args.vocab_size):
        if not tokenizer_vocab:
            raise ConfigError("data.tokenizer = 'none' needs model.vocab_size (for example 50304 for "
                              "GPT-2-tokenized FineWeb shards)")
        overrides["vocab_size"] = -(-tokenizer_vocab // 64) * 64  # padded: divisible by tp, aligned GEMMs
    overrides.setdefault("max_seq_len", cfg.training.seq_len)
    args = dataclasses.replace(args, **overrides)
    if args.vocab_size < tokenizer_vocab:
        raise ConfigError(f"model.vocab_size = {args.vocab_size} is smaller than the tokenizer's vocabulary "
                          f"({tokenizer_vocab}); set model.vocab_size >= {tokenizer_vocab} or 0 (the tokenizer's)")
    if args.max_seq_len < cfg.training.seq_len:
        raise ConfigError(f"training.seq_len = {cfg.training.seq_len} exceeds model.max_seq_len = "
                          f"{args.max_seq_len}")
    try:
        args.validate()
    except ValueError as e:  # its messages start with the field's name, which is also the [model] key
        raise ConfigError(f"model.{e} (flavor {cfg.model.flavor!r} with the [model] keys applied)") from None
    return args
