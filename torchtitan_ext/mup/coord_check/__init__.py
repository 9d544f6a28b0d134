"""``python -m torchtitan_ext.mup.coord_check``: the command line is ``tools/coord_check.py``, the check
``torchtitan_ext.mup``."""
