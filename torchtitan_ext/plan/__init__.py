"""Memory and communication planner (``python -m torchtitan_ext.plan``; the figures in
``torchtitan_ext/plan/estimate.py``, the command line in ``__main__.py``)."""

from torchtitan_ext.plan.estimate import (
    ALLOCATOR_OVERHEAD,
    F32,
    FSDP_UNSHARDED_UNITS,
    GIB,
    GRADS,
    Plan,
    block_activations,
    communication,
    float8_input_saving,
    head_activations,
    mode_activations,
    plan,
    plan_job,
    report,
    selective_activations,
    tokenizer_vocab,
)

__all__ = ["ALLOCATOR_OVERHEAD", "F32", "FSDP_UNSHARDED_UNITS", "GIB", "GRADS", "Plan", "block_activations",
           "communication", "float8_input_saving", "head_activations", "mode_activations", "plan", "plan_job",
           "report", "selective_activations", "tokenizer_vocab"]
