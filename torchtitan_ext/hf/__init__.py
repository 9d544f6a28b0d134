"""Hugging Face interchange: our models as transformers folders (safetensors shards, config.json, tokenizer
files, and for architectures transformers lacks a modeling file loaded with ``trust_remote_code``), and back.

* ``architectures.py``: which transformers architecture computes the same function as a ``ModelArgs``, its
  ``config.json`` and the tensor names (``hf_layout``); the reverse mapping of a config (``args_from_config``).
* ``remote_code/``: the self-contained modeling file written beside the weights when no native class fits.
* ``safetensors_io.py``: sharded safetensors writing (index JSON) and per-tensor / per-slice reading.
* ``export.py``: a model or a DCP checkpoint -> folder, one shard in host memory at a time.
* ``load.py``: folder -> our Decoder (``load_hf``) or into a sharded model, each rank reading its slices.
"""
