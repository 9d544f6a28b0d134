"""``python -m torchtitan_ext.mup.coord_check``: the command line of ``torchtitan_ext.mup.coord_check``."""
