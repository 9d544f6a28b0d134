"""Memory and communication planner: the figures in ``estimate.py``, the command line in ``tools/plan.py``."""
