# Registers "32b_shape" for torchtitan 0.2.0's llama3 (no patch to torchtitan itself): imported through
# [experimental] custom_import = "tt_layouts" (this folder on PYTHONPATH) before the trainer looks the flavor up.
# Our 32b flavor's shape: d_model 7168, 56 heads, 8 KV heads, SwiGLU 19456 (2/3 x 4 x 7168 rounded up to a multiple of
# 1024), vocabulary 128256, RoPE theta 5e5, untied head; TT_32B_LAYERS layers (benchmarks/bench_layouts.sh sets it
# with LAYERS_32B). Our rows run it with model.qk_norm = false, as llama3 has none.
import os

from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

llama3_args["32b_shape"] = TransformerModelArgs(
    dim=7168,
    n_layers=int(os.environ.get("TT_32B_LAYERS", "16")),
    n_heads=56,
    n_kv_heads=8,
    vocab_size=128256,
    multiple_of=1024,
    ffn_dim_multiplier=None,
    norm_eps=1e-5,
    rope_theta=500000,
)
