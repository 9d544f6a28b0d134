"""The sampling options of a generation request, checked before anything is loaded (no torch import, so the
command line says a bad value before its imports)."""

from __future__ import annotations

import math

from torchtitan_ext.errors import UserError

# Below the lowest temperature sampling is greedy decoding in all but name, and logits / temperature overflows
# float32 (1e-300 is 0 in float32: the division gives inf and the softmax NaN); above the highest the draw is
# uniform over the nucleus.
TEMPERATURE_RANGE = (1e-3, 1e3)


def check_sampling(max_new_tokens: int, temperature: float, top_p: float) -> None:
    """UserError naming the option and its value when one is out of range or not a finite number."""
    low, high = TEMPERATURE_RANGE
    if max_new_tokens < 1:
        raise UserError(f"--max-new-tokens {max_new_tokens}: expected a whole number >= 1")
    if not (temperature == 0 or low <= temperature <= high):  # NaN fails both comparisons
        raise UserError(f"--temperature {temperature}: expected 0 (greedy) or a number from {low:g} to {high:g}")
    if not (math.isfinite(top_p) and 0 < top_p <= 1):
        raise UserError(f"--top-p {top_p}: expected a number above 0 and at most 1")
