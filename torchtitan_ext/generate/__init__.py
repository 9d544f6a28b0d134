"""Text generation with a KV cache: the decoding in ``decoding.py``, the command line in ``tools/generate.py``."""
