"""Memory and communication planner: the figures in ``estimate.py``, the command line in ``__main__.py``."""
