"""Data sources: one module each (built-in corpus, token shards, conversation trees, domains), listed in
``data/registry.py``. A source's ``build(data, ctx)`` returns (training loader, validation loader(s) or None)."""
