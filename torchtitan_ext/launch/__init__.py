"""``python -m torchtitan_ext.launch``: the command line is ``tools/launch.py``."""
