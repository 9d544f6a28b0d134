"""The data layer. ``registry.py`` is its entry (``build_tokenizer``, ``build_loaders``); ``base.py`` holds the
base types and the loader protocol; ``sources/`` one module per source and ``packers/`` one per packer;
``prepare`` and ``domains_corpus`` are command-line tools (``python -m torchtitan_ext.data.<tool>``)."""
