"""Hugging Face architectures (``torchtitan_ext/hf/architectures.py``, ``hf/remote_code/``): every model shape
loads in transformers with our logits, natively or through the custom modeling file; greedy generation
there equals ours; Hub configs map back to ModelArgs, and the keys we would not compute are refused.

The folders are written here from ``hf_layout`` (the exporter itself is tested with the export command)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers", reason="pip install -e .[dev] installs transformers")
from safetensors.torch import load_file, save_file  # noqa: E402

from torchtitan_ext.generate.decoding import generate  # noqa: E402
from torchtitan_ext.hf.architectures import (  # noqa: E402
    CUSTOM_ARCHITECTURE,
    ExportError,
    HFLayout,
    args_from_config,
    hf_layout,
    remote_code_files,
)
from torchtitan_ext.models.args import ModelArgs  # noqa: E402
from torchtitan_ext.models.decoder import Decoder  # noqa: E402
from torchtitan_ext.models.flavors import get_flavor  # noqa: E402
from torchtitan_ext.models.mode import MoDE  # noqa: E402

SIZE = dict(vocab_size=128, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=96, max_seq_len=64)
LLAMA3 = dict(rope_scaling="llama3", rope_scaling_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
              rope_original_max_seq_len=16)  # 16 < 64 positions: the scaling changes the frequencies
EVERYTHING = dict(qk_norm=True, rope_fraction=0.5, nope_every=3, logit_softcap=5.0, residual_scalars=True,
                  kv_share="interleaved", activation="relu2", tie_embeddings=True, n_experts=4, top_k=2,
                  moe_hidden=32, moe_every=2, shared_expert=True, bias_update_rate=0.01, parametrization="mup",
                  mup_base_dim=32, **LLAMA3)
CASES = {
    "llama": ({}, "LlamaForCausalLM"),
    "llama3_scaling": (LLAMA3, "LlamaForCausalLM"),
    "qwen3_tied": (dict(qk_norm=True, tie_embeddings=True), "Qwen3ForCausalLM"),
    "smollm3": (dict(nope_every=2), "SmolLM3ForCausalLM"),
    "mixtral": (dict(n_experts=4, top_k=2), "MixtralForCausalLM"),
    # 12 experts: the per-expert names 10 and 11 must stack after 9, not after 1
    "qwen3_moe_every_2": (dict(qk_norm=True, n_experts=12, top_k=3, moe_hidden=32, moe_every=2),
                          "Qwen3MoeForCausalLM"),
    "qwen3_moe_unnormalised": (dict(qk_norm=True, n_experts=4, top_k=2, moe_hidden=32, renormalize_gates=False,
                                    tie_embeddings=True), "Qwen3MoeForCausalLM"),
    "debug_flavor": ("debug", CUSTOM_ARCHITECTURE),  # partial RoPE, NoPE layers, QK-norm
    "nope_qk_norm": (dict(qk_norm=True, nope_every=2), CUSTOM_ARCHITECTURE),
    "softcap": (dict(logit_softcap=5.0), CUSTOM_ARCHITECTURE),
    "residual_scalars": (dict(residual_scalars=True), CUSTOM_ARCHITECTURE),
    "kv_share": (dict(kv_share="interleaved", kv_share_group=3, qk_norm=True), CUSTOM_ARCHITECTURE),
    "relu2": (dict(activation="relu2"), CUSTOM_ARCHITECTURE),
    "mode_shared_bias": (dict(n_experts=4, top_k=2, moe_hidden=32, shared_expert=True, bias_update_rate=0.01),
                         CUSTOM_ARCHITECTURE),
    "mixtral_unnormalised": (dict(n_experts=4, top_k=2, renormalize_gates=False), CUSTOM_ARCHITECTURE),
    "llama3_partial_rope": (dict(rope_fraction=0.5, **LLAMA3), CUSTOM_ARCHITECTURE),
    "mup": (dict(parametrization="mup", mup_base_dim=32, mup_base_head_dim=4), CUSTOM_ARCHITECTURE),
    "everything": (EVERYTHING, CUSTOM_ARCHITECTURE),
}


def _args(case: str) -> ModelArgs:
    features = CASES[case][0]
    if isinstance(features, str):  # a flavor's features at the test size
        return dataclasses.replace(get_flavor(features), **SIZE)
    return ModelArgs(**SIZE, **features)


def _random_model(args: ModelArgs, std: float = 0.1, seed: int = 0) -> Decoder:
    """Random weights: matrices N(0, std), norms and residual scalars near 1, a routing bias where it counts."""
    gen = torch.Generator().manual_seed(seed)
    with torch.device("meta"):
        model = Decoder(args)
    model.to_empty(device="cpu")
    model.init_buffers(torch.device("cpu"))
    with torch.no_grad():
        for p in model.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else std * noise)
        for m in model.modules():
            if isinstance(m, MoDE) and args.bias_update_rate > 0:
                m.expert_bias.copy_(0.1 * torch.randn(m.expert_bias.shape, generator=gen))
    return model.eval()


def _write(model: Decoder, folder: Path) -> HFLayout:
    """What the exporter writes: the tensors under ``names`` (stacked experts split when there is one name
    per expert), config.json and, for the custom architecture, its modeling files."""
    layout = hf_layout(model.args)
    tensors = {}
    for key, value in model.state_dict().items():
        names = layout.names[key]
        if names:  # none: a buffer the architecture does not use
            parts = [value] if len(names) == 1 else list(value)
            tensors.update({name: part.contiguous() for name, part in zip(names, parts, strict=True)})
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(layout.config, indent=2))
    if not layout.native:
        for name, data in remote_code_files().items():
            (folder / name).write_bytes(data)
    return layout


def _load_hf(folder: Path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, trust_remote_code=True,
                                                                    output_loading_info=True)
    assert not any(info.values()), info  # no missing (newly initialised), unexpected or mismatched tensors
    return model.eval()


@pytest.mark.parametrize("case", list(CASES))
def test_loads_in_transformers_with_our_logits(tmp_path, case):
    args = _args(case)
    model = _random_model(args)
    layout = _write(model, tmp_path)
    assert layout.architecture == CASES[case][1]
    assert layout.native == (layout.architecture != CUSTOM_ARCHITECTURE) == (not layout.reason)
    assert set(layout.names) == set(model.state_dict())
    for key, names in layout.names.items():
        if key.endswith("expert_bias"):  # unused by the native MoE classes (bias_update_rate = 0): not written
            assert len(names) == (0 if layout.native else 1)
        elif ".experts.w" in key and layout.native:
            assert len(names) == args.n_experts
        else:
            assert len(names) == 1
    hf = _load_hf(tmp_path)
    assert type(hf).__name__ == layout.architecture
    x = torch.randint(0, args.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x), rtol=1e-5, atol=1e-5)
    assert args_from_config(json.loads((tmp_path / "config.json").read_text()), "config.json") == args


def test_llama3_rope_scaling_equals_transformers(tmp_path):
    """Llama-3 scaled RoPE against transformers' own implementation of it (``rope_parameters`` written by
    transformers from a legacy ``rope_scaling`` config, then mapped back)."""
    args = ModelArgs(**SIZE, **LLAMA3)
    hub = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128, "hidden_size": 64,
           "intermediate_size": 96, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
           "max_position_embeddings": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                            "original_max_position_embeddings": 16}}
    assert args_from_config(hub, "hub") == args
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hub),
                                                     dtype=torch.float32).eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path)
    assert args_from_config(json.loads((tmp_path / "config.json").read_text()), "saved") == args
    model = _our_model_from(tmp_path, args)
    unscaled = _our_model_from(tmp_path, dataclasses.replace(args, rope_scaling="none"))
    x = torch.randint(0, 128, (2, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-5, atol=1e-5)
        assert (unscaled(x) - model(x)).abs().max() > 1e-3  # the scaling matters at these positions


def _perturb(hf) -> None:
    """transformers initialises norms to one: make them (and every other tensor) random."""
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in hf.parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if p.ndim == 1 else 0.1 * noise)


def _our_model_from(folder: Path, args: ModelArgs) -> Decoder:
    """Our Decoder with the folder's tensors, read through ``hf_layout(args).names``."""
    theirs = load_file(str(folder / "model.safetensors"))
    model = _random_model(args)
    state = model.state_dict()
    for key, names in hf_layout(args).names.items():
        if names:
            state[key] = theirs[names[0]] if len(names) == 1 else torch.stack([theirs[n] for n in names])
    model.load_state_dict(state)
    return model


# Hub config.json files of each family, with their keys as published (sizes and token ids shrunk).
HUB = {
    "Llama-3.2-1B": {"architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                     "bos_token_id": 126, "eos_token_id": 127, "head_dim": 16, "hidden_act": "silu",
                     "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
                     "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
                     "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2, "pretraining_tp": 1,
                     "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0,
                                                             "low_freq_factor": 1.0,
                                                             "original_max_position_embeddings": 8192,
                                                             "rope_type": "llama3"},
                     "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
                     "use_cache": True, "vocab_size": 128},
    # no head_dim: Qwen3's default is 128, not hidden_size / heads
    "Qwen3-0.6B": {"architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                   "bos_token_id": 126, "eos_token_id": 127, "hidden_act": "silu", "hidden_size": 64,
                   "intermediate_size": 96, "max_position_embeddings": 40960, "max_window_layers": 28,
                   "model_type": "qwen3", "num_attention_heads": 4, "num_hidden_layers": 2, "num_key_value_heads": 2,
                   "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
                   "tie_word_embeddings": True, "torch_dtype": "bfloat16", "use_cache": True,
                   "use_sliding_window": False, "vocab_size": 128},
    "SmolLM3-3B": {"architectures": ["SmolLM3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                   "bos_token_id": None, "eos_token_id": 127, "hidden_act": "silu", "hidden_size": 64,
                   "intermediate_size": 96, "layer_types": ["full_attention"] * 4, "max_position_embeddings": 65536,
                   "max_window_layers": 28, "mlp_bias": False, "model_type": "smollm3", "no_rope_layer_interval": 4,
                   "no_rope_layers": [1, 1, 1, 0], "num_attention_heads": 4, "num_hidden_layers": 4,
                   "num_key_value_heads": 2, "pad_token_id": 0, "pretraining_tp": 2, "rms_norm_eps": 1e-06,
                   "rope_scaling": None, "rope_theta": 5000000.0, "sliding_window": None,
                   "tie_word_embeddings": True, "use_cache": False, "use_sliding_window": False, "vocab_size": 128},
    "Mixtral-8x7B": {"architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1,
                     "eos_token_id": 2, "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02,
                     "intermediate_size": 32, "max_position_embeddings": 32768, "model_type": "mixtral",
                     "num_attention_heads": 4, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                     "num_key_value_heads": 2, "num_local_experts": 4, "output_router_logits": False,
                     "rms_norm_eps": 1e-05, "rope_theta": 1e6, "router_aux_loss_coef": 0.02, "sliding_window": None,
                     "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 128},
    "Qwen3-30B-A3B": {"architectures": ["Qwen3MoeForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
                      "bos_token_id": 126, "decoder_sparse_step": 1, "eos_token_id": 127, "head_dim": 32,
                      "hidden_act": "silu", "hidden_size": 64, "initializer_range": 0.02, "intermediate_size": 96,
                      "max_position_embeddings": 40960, "max_window_layers": 48, "mlp_only_layers": [],
                      "model_type": "qwen3_moe", "moe_intermediate_size": 32, "norm_topk_prob": True,
                      "num_attention_heads": 4, "num_experts": 6, "num_experts_per_tok": 2, "num_hidden_layers": 2,
                      "num_key_value_heads": 2, "output_router_logits": False, "rms_norm_eps": 1e-06,
                      "rope_scaling": None, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.001,
                      "sliding_window": None, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
                      "use_cache": True, "use_sliding_window": False, "vocab_size": 128},
}
HUB_ARGS = {
    "Llama-3.2-1B": dict(head_dim=0, tie_embeddings=True, rope_theta=500000.0, rope_scaling="llama3",
                         rope_scaling_factor=32.0, rope_original_max_seq_len=8192, max_seq_len=131072),
    "Qwen3-0.6B": dict(head_dim=128, qk_norm=True, tie_embeddings=True, rope_theta=1e6, norm_eps=1e-6),
    "SmolLM3-3B": dict(nope_every=4, tie_embeddings=True, rope_theta=5e6, norm_eps=1e-6),
    "Mixtral-8x7B": dict(n_experts=4, top_k=2, ffn_hidden=32, rope_theta=1e6),
    "Qwen3-30B-A3B": dict(head_dim=32, qk_norm=True, n_experts=6, top_k=2, moe_hidden=32, rope_theta=1e6),
}


@pytest.mark.parametrize("name", list(HUB))
def test_hub_configs_map_to_our_function(tmp_path, name):
    """A Hub config.json maps to ModelArgs whose Decoder, given the weights transformers saves for that
    config, has transformers' logits (and exports back to the same architecture)."""
    hub = HUB[name]
    args = args_from_config(hub, f"{name}/config.json")
    for field, value in HUB_ARGS[name].items():
        assert getattr(args, field) == value, field
    assert hf_layout(args).architecture == hub["architectures"][0]
    hf = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**hub),
                                                     dtype=torch.float32).eval()
    _perturb(hf)
    hf.save_pretrained(tmp_path)  # transformers writes the Hub's tensor names (per-expert for the MoE classes)
    model = _our_model_from(tmp_path, args)
    x = torch.randint(0, 128, (2, 24), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        torch.testing.assert_close(model(x), hf(x).logits, rtol=1e-5, atol=1e-5)


def _tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, 128)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.WhitespaceSplit(), decoders.WordPiece()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                                padding_side="left")


@pytest.mark.parametrize("case", ["everything", "mixtral"])
def test_greedy_generation_equals_ours(tmp_path, case):
    """Batched greedy decoding of prompts of different lengths (left padding) through transformers' generate,
    with its cache and without, and (custom) through a text-generation pipeline, equals ours."""
    args = _args(case)
    model = _random_model(args, std=0.3)  # larger weights: the tokens do not just repeat the prompt's last
    _write(model, tmp_path)
    hf = _load_hf(tmp_path)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [3, 4, 5, 6, 7, 8, 9, 10]]
    ours = generate(model, prompts, 8)
    assert len({tuple(row) for row in ours}) == 3 and all(len(set(row)) > 1 for row in ours)
    longest = max(map(len, prompts))
    ids = torch.tensor([[0] * (longest - len(p)) + p for p in prompts])
    mask = (torch.arange(longest)[None] >= torch.tensor([longest - len(p) for p in prompts])[:, None]).long()
    for use_cache in (True, False):
        out = hf.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=8, pad_token_id=0,
                          use_cache=use_cache)
        assert out[:, longest:].tolist() == ours
    if case == "everything":
        _tokenizer().save_pretrained(tmp_path)
        pipe = transformers.pipeline("text-generation", model=str(tmp_path), trust_remote_code=True,
                                     dtype=torch.float32)
        texts = [" ".join(f"w{t}" for t in p) for p in prompts]
        got = pipe(texts, max_new_tokens=8, do_sample=False, return_full_text=False, batch_size=3)
        assert [g[0]["generated_text"] for g in got] == [" ".join(f"w{t}" for t in row) for row in ours]


def test_custom_model_padding_and_loss(tmp_path):
    """The modeling file's forward: a row padded on the left or the right gives its unpadded logits at its
    real tokens, and ``labels`` give the mean next-token cross-entropy."""
    model = _random_model(_args("everything"))
    _write(model, tmp_path)
    hf = _load_hf(tmp_path)
    row = torch.randint(2, 128, (1, 10), generator=torch.Generator().manual_seed(5))
    pad = torch.zeros(1, 4, dtype=torch.long)
    ones, zeros = torch.ones(1, 10, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long)
    with torch.no_grad():
        want = model(row)
        left = hf(torch.cat([pad, row], 1), attention_mask=torch.cat([zeros, ones], 1)).logits[:, 4:]
        right = hf(torch.cat([row, pad], 1), attention_mask=torch.cat([ones, zeros], 1)).logits[:, :10]
        torch.testing.assert_close(left, want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(right, want, rtol=1e-5, atol=1e-5)
        loss = hf(row, labels=row).loss
        torch.testing.assert_close(loss, F.cross_entropy(want[0, :-1], row[0, 1:]), rtol=1e-5, atol=1e-5)


def test_every_model_field_is_mapped():
    """A new ModelArgs field may change the function: map it here (architecture choice, config keys) and in
    the modeling file, then list it."""
    assert {f.name for f in dataclasses.fields(ModelArgs)} == {
        "vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_hidden", "activation",
        "max_seq_len", "rope_theta", "rope_scaling", "rope_scaling_factor", "rope_low_freq_factor",
        "rope_high_freq_factor", "rope_original_max_seq_len", "rope_fraction", "nope_every", "qk_norm", "norm_eps",
        "tie_embeddings", "logit_softcap", "residual_scalars", "n_experts", "top_k", "moe_hidden", "moe_every",
        "shared_expert", "renormalize_gates", "aux_loss_coef", "router_z_loss_coef", "bias_update_rate",
        "force_balanced_routing", "kv_share", "kv_share_group", "parametrization", "mup_base_dim",
        "mup_base_head_dim"}


def test_forced_balanced_routing_is_not_exported():
    """The benchmark-only routing stays out of config.json: an exported model routes by its router."""
    args = dataclasses.replace(_args("everything"), force_balanced_routing=True)
    layout = hf_layout(args)
    assert "force_balanced_routing" not in layout.config
    assert not args_from_config(layout.config, "config.json").force_balanced_routing


def test_remote_code_is_self_contained():
    files = remote_code_files()
    assert set(files) == {"configuration_torchtitan_ext.py", "modeling_torchtitan_ext.py"}
    for data in files.values():
        assert b"torchtitan_ext." not in data.replace(b"configuration_torchtitan_ext", b"")
        assert b"import torchtitan_ext" not in data


REFUSED = [
    ("Llama-3.2-1B", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling.rope_type = 'yarn'"),
    ("Llama-3.2-1B", {"rope_scaling": None, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}},
     "rope_parameters.rope_type = 'dynamic'"),
    ("Llama-3.2-1B", {"rope_scaling": {"type": "linear", "factor": 2.0}}, "rope_scaling.type = 'linear'"),
    ("Llama-3.2-1B", {"rope_scaling": {"rope_type": "default", "partial_rotary_factor": 0.5}},
     "rope_scaling.partial_rotary_factor = 0.5"),
    ("Llama-3.2-1B", {"attention_bias": True}, "attention_bias = True"),
    ("Llama-3.2-1B", {"mlp_bias": True}, "mlp_bias = True"),
    ("Llama-3.2-1B", {"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ("Llama-3.2-1B", {"model_type": "mistral"}, "model_type = 'mistral'"),
    ("Qwen3-0.6B", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1},
     "use_sliding_window = True"),
    ("Qwen3-30B-A3B", {"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window = True"),
    ("SmolLM3-3B", {"use_sliding_window": True, "sliding_window": 4096, "layer_types": None},
     "use_sliding_window = True"),
    ("Mixtral-8x7B", {"sliding_window": 4096}, "sliding_window = 4096"),
    ("SmolLM3-3B", {"no_rope_layers": [1, 0, 1, 1]}, "no_rope_layers = [1, 0, 1, 1]"),
    ("Qwen3-30B-A3B", {"mlp_only_layers": [0]}, "mlp_only_layers = [0]"),
]


@pytest.mark.parametrize("hub, change, words", REFUSED)
def test_refusals_name_the_key(hub, change, words):
    with pytest.raises(ExportError) as err:
        args_from_config({**HUB[hub], **change}, "in/config.json")
    message = str(err.value)
    assert "\n" not in message and message.startswith("in/config.json: ") and words in message


@pytest.mark.parametrize("hub, change", [
    ("Qwen3-0.6B", {"sliding_window": 4096}),  # use_sliding_window false
    ("Qwen3-0.6B", {"use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 2}),  # no layer slides
    ("SmolLM3-3B", {"use_sliding_window": True, "sliding_window": 4096}),  # layer_types: every layer full
    ("Llama-3.2-1B", {"rope_scaling": None, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}),
])
def test_unused_sliding_windows_and_default_rope_map(hub, change):
    assert args_from_config({**HUB[hub], **change}, "in/config.json").vocab_size == 128
