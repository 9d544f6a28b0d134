# Flavors of torchtitan 0.2.0's llama3 at this project's benchmark shapes (no patch to torchtitan itself), imported
# through [experimental] custom_import = "tt_flavors" (this folder on PYTHONPATH) before the trainer looks the
# flavor up:
#   1b          our 1b flavor: d_model 2048, 16 layers, 16 / 8 heads, SwiGLU 5632, vocabulary 32000, RoPE theta 5e5
#   8b_layers4  llama3's 8B with 4 layers and vocabulary 32000 (the plain script's 8b_layers4 shape)
#   32b_shape   our 32b flavor's shape (d_model 7168, 56 / 8 heads, SwiGLU 19456 (2/3 x 4 x 7168 rounded up to a
#               multiple of 1024), vocabulary 128256, RoPE theta 5e5, untied head) with TT_32B_LAYERS layers
#               (default 16); our rows run it with model.qk_norm = false, as llama3 has none.
import dataclasses
import os

from torchtitan.models.llama3 import TransformerModelArgs, llama3_args

llama3_args["1b"] = TransformerModelArgs(dim=2048, n_layers=16, n_heads=16, n_kv_heads=8, vocab_size=32000,
                                         multiple_of=256, ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=500000)
llama3_args["8b_layers4"] = dataclasses.replace(llama3_args["8B"], n_layers=4, vocab_size=32000)
llama3_args["32b_shape"] = TransformerModelArgs(dim=7168, n_layers=int(os.environ.get("TT_32B_LAYERS", "16")),
                                                n_heads=56, n_kv_heads=8, vocab_size=128256, multiple_of=1024,
                                                ffn_dim_multiplier=None, norm_eps=1e-5, rope_theta=500000)
