"""Text generation with a KV cache (``python -m torchtitan_ext.generate``; the decoding in
``torchtitan_ext/generate/decoding.py``, the command line in ``__main__.py``)."""

from torchtitan_ext.generate.decoding import (
    CACHE_SLOTS,
    STOP_CHECK_EVERY,
    Completions,
    KVCache,
    check_supported,
    complete,
    forward_cached,
    generate,
    sample,
)

__all__ = ["CACHE_SLOTS", "STOP_CHECK_EVERY", "Completions", "KVCache", "check_supported", "complete",
           "forward_cached", "generate", "sample"]
