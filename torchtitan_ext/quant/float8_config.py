"""The float8 keys checked against each other and the job, without torch: the launcher runs this before any
worker starts (and before it imports torch); the trainer again in ``float8.check_float8_supported``."""

from __future__ import annotations

from torchtitan_ext.config.job_config import Float8Section
from torchtitan_ext.errors import ConfigError


def check_float8_config(cfg: Float8Section, fused_linear_ce: bool = False, tp: int = 1) -> None:
    """Refuse float8 keys that contradict each other or the job (no device or torchao needed: the launcher
    runs it before any worker starts). ``fused_linear_ce``: the trainer's ``training.fused_linear_ce``, which
    applies the head's high-precision weight itself and so would silently bypass a float8 head. ``tp``: the
    tensor-parallel degree."""
    for key in ("high_precision_eval", "experts"):
        if getattr(cfg, key) and not cfg.enabled:
            raise ConfigError(f"float8.{key} = true needs float8.enabled = true")
    if not cfg.enabled:
        return
    if cfg.recipe == "blockwise" and tp > 1:
        raise ConfigError(f"float8.recipe = 'blockwise' does not run under parallelism.tp = {tp}: its kernels "
                          f"take plain tensors, not TP's DTensors; use tensorwise or rowwise with TP")
    if cfg.include_output and fused_linear_ce:
        raise ConfigError("float8.include_output = true and training.fused_linear_ce = true are exclusive: the "
                          "fused loss multiplies by the head's weight itself, not through its Float8Linear")
    if cfg.recipe != "tensorwise":
        for key in ("enable_fsdp_float8_all_gather", "precompute_float8_dynamic_scale_for_fsdp"):
            if getattr(cfg, key):
                raise ConfigError(f"float8.{key} = true needs float8.recipe = 'tensorwise' (got "
                                  f"{cfg.recipe!r}): only tensorwise scales can be computed before the "
                                  f"all-gather")
    if cfg.precompute_float8_dynamic_scale_for_fsdp and not cfg.enable_fsdp_float8_all_gather:
        raise ConfigError("float8.precompute_float8_dynamic_scale_for_fsdp = true has no effect without "
                          "float8.enable_fsdp_float8_all_gather = true")
