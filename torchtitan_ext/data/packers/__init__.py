"""Packers: how a training split's token shards become windows (``data.packing``); one module each, listed
in ``data/registry.py``."""
