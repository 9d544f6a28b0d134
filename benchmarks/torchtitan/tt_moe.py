# Registers the "zen_moe" flavor of torchtitan 0.2.0's qwen3 MoE (no patch to torchtitan itself): imported through
# [experimental] custom_import = "tt_moe" (this folder on PYTHONPATH) before the trainer looks the flavor up.
# The shape of the mode_ep4 scenario's MoDE model (benchmarks/scenarios.toml): d_model 2048, 16 heads (8 KV) of
# head_dim 128, 8 layers, every layer MoE with 64 SwiGLU experts of hidden 1408, top-2, no shared expert,
# vocabulary 32000, untied head.
# Differences from our MoDE model (torchtitan_ext, mode_debug flavor resized), none of which changes the GEMM shapes:
#   - qk_norm off here to match ours (qwen3's flavors have it on);
#   - routing: both softmax over the router logits, top-2, gates renormalised to sum to 1 (route_norm); torchtitan
#     multiplies the gate after the experts (score_before_experts=False), as ours does;
#   - balancing: ours a Switch aux loss (0.01) + router z-loss (0.001); torchtitan's auxiliary-loss-free per-expert
#     bias (load_balance_coeff 1e-3, its default: an all-reduce of the token counts before each optimizer step);
#   - rope_theta 1e6 / norm_eps 1e-6 (qwen3's) against our 1e4 / 1e-5; hidden_dim (dense FFN) unused (all layers MoE).
from torchtitan.models.moe import MoEArgs
from torchtitan.models.qwen3 import qwen3_args
from torchtitan.models.qwen3.model.args import Qwen3ModelArgs

qwen3_args["zen_moe"] = Qwen3ModelArgs(
    vocab_size=32000,
    max_seq_len=4096,
    head_dim=128,
    dim=2048,
    n_layers=8,
    n_heads=16,
    n_kv_heads=8,
    qk_norm=False,
    hidden_dim=5632,
    rope_theta=1000000,
    enable_weight_tying=False,
    moe_enabled=True,
    moe_inter_dim=1408,
    moe_args=MoEArgs(
        num_experts=64,
        num_shared_experts=0,
        top_k=2,
        score_func="softmax",
        route_norm=True,
        route_scale=1.0,
        score_before_experts=False,
        load_balance_coeff=1e-3,
    ),
)
